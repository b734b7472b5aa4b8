"""Where finished groups go: the learner's trajectory queue, or one caller's `Submission`.

The trajectory queue holds finished groups waiting for the learner. Bounded, and the bound is admission.

Owns: capacity (`queue.max_groups` groups admitted but not yet taken), the hand-off order, and the
end-of-stream rule: the stream ends once nothing is queued or running and no producer is left (a
prompt source still being read, a server still accepting episodes). The scheduler `reserve()`s a
slot before it starts a group, so a full queue stops admission (backpressure from the learner to
the engines) and `put` never blocks or grows memory past the bound. A slot frees when the learner
takes the group.
Order: `ready_first` hands groups out as they finish; `in_order` in the order their slots were
reserved (the order prompts were fed), holding back a finished group until the ones before it.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from rollout.handout.token_stream import TokenStream
from rollout.types import Group


class TrajectoryQueue:
    def __init__(self, max_groups: int, in_order: bool = False):
        self.max_groups = max_groups
        self.in_order = in_order
        self._items: deque[Group] = deque()  # ready to hand out
        self._held: dict[int, Group] = {}  # in_order: finished, waiting for an earlier group
        self._next_seq = 0  # of the next reservation
        self._next_out = 0  # in_order: the reservation to hand out next
        # fast_acquire: a free slot is taken without a trip round the event loop, so admission
        # starts a burst of groups in one turn (and the engines get them in one call each).
        self._slots = anyio.Semaphore(max_groups, fast_acquire=True)
        self._reserved = 0  # slots taken by groups still running
        self._producers = 0  # sources still being read, servers still accepting episodes
        self._error: BaseException | None = None
        self._changed = asyncio.Event()
        self._getters = 0  # `get` calls waiting: only they need `_changed` set

    def __len__(self) -> int:
        return len(self._items)

    @property
    def in_flight(self) -> int:
        return self._reserved

    @property
    def idle(self) -> bool:
        """Nothing queued, nothing running, no producer left: every fed prompt and every episode
        accepted was handed out."""
        return not self._items and not self._reserved and not self._producers

    async def reserve(self) -> int:
        """Wait for a free slot and take it for one group about to start; returns its sequence number."""
        await self._slots.acquire()
        self._reserved += 1
        self._next_seq += 1
        return self._next_seq - 1

    def try_reserve(self) -> int | None:
        """`reserve` without waiting: None when the queue is full."""
        try:
            self._slots.acquire_nowait()
        except anyio.WouldBlock:
            return None
        self._reserved += 1
        self._next_seq += 1
        return self._next_seq - 1

    def put(self, group: Group, seq: int) -> None:
        """Deliver the finished group of reservation `seq`."""
        assert self._reserved > 0, "put without reserve"
        self._reserved -= 1
        if not self.in_order:
            self._items.append(group)
        else:
            self._held[seq] = group
            while self._next_out in self._held:
                self._items.append(self._held.pop(self._next_out))
                self._next_out += 1
        self._notify()

    def producer_started(self) -> None:
        """A producer (a prompt source, a server accepting episodes) may still put groups: `get`
        waits for them instead of ending, until `producer_done`."""
        self._producers += 1
        self._notify()

    def producer_done(self) -> None:
        self._producers -= 1
        self._notify()

    def fail(self, error: BaseException) -> None:
        """Make every waiting and later `get` raise `error` (the scheduler cannot go on)."""
        self._error = error
        self._notify()

    async def get(self) -> Group | None:
        """The next finished group; None once the queue is idle (see `idle`). Raises a fatal error."""
        while True:
            if self._items:
                group = self._items.popleft()
                self._slots.release()
                return group
            if self._error is not None:
                raise self._error
            if self.idle:
                return None
            changed = self._changed
            self._getters += 1
            try:
                await changed.wait()
            finally:
                self._getters -= 1

    def _notify(self) -> None:
        if self._getters:  # no new event per finished group while nobody waits: driver CPU for nothing
            self._changed.set()
            self._changed = asyncio.Event()


class Submission:
    """One caller's prompts (`RolloutEngine.submit`) and their groups, which come back here and
    nowhere else, each once: `async for index, group in submission` as they finish (`index`: the
    prompt's position in the call), or `await submission.result()` for all in prompt order.
    `cancel()` stops the ones still running (their engine requests are aborted). Bounded: it holds
    at most one group per prompt. Raises the engine's fatal error (every engine dead, the engine
    closed) instead of waiting for what can never come. Streamed (`on_tokens`): each prompt's
    samples' new tokens go to `on_tokens(index, sample_index, position, token_ids, logprobs)` as
    the engines generate them (`rollout.handout.token_stream`), and each group still comes back whole.
    """

    def __init__(
        self, prompts: list[Any], train: bool, on_take: Callable[[Group], Group] | None = None,
        on_tokens: Callable[[int, int, int, list[int], list[float]], None] | None = None,
    ):  # fmt: skip
        self.prompts = prompts
        self.train = train  # counted by staleness admission and checked at hand-out (`on_take`)
        self.on_tokens = on_tokens  # streamed: (prompt index, sample index, position, ids, logprobs)
        self.scope = anyio.CancelScope()
        self._send, self._recv = anyio.create_memory_object_stream[tuple[int, Group]](max(len(prompts), 1))
        self._left = len(prompts)
        self._error: BaseException | None = None
        self._on_take = on_take

    def put(self, group: Group, index: int) -> None:
        if self._error is None:  # after a failure nobody reads it
            self._send.send_nowait((index, group))  # never blocks: room for every prompt

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
            self._send.close()

    def cancel(self) -> None:
        self.scope.cancel()

    def stream(self, index: int) -> TokenStream | None:
        """The stream of prompt `index`'s new tokens, when the caller streams (`on_tokens`)."""
        if self.on_tokens is None:
            return None
        return TokenStream(functools.partial(self.on_tokens, index))

    async def next(self) -> tuple[int, Group] | None:
        """The next finished group and its prompt's index; None once every prompt's came back."""
        if not self._left:
            return None
        try:
            index, group = await self._recv.receive()
        except anyio.EndOfStream:
            assert self._error is not None
            raise self._error from None
        self._left -= 1
        return index, (self._on_take(group) if self._on_take is not None else group)

    def __aiter__(self) -> AsyncIterator[tuple[int, Group]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, Group]]:
        while (item := await self.next()) is not None:
            yield item

    async def result(self) -> list[Group]:
        """Every group, in the order of the prompts."""
        out: dict[int, Group] = {}
        async for index, group in self:
            out[index] = group
        return [out[i] for i in sorted(out)]
