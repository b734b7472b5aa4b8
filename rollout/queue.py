"""The trajectory queue: finished groups waiting for the learner. Bounded, and the bound is admission.

Owns: capacity (`queue.max_groups` groups admitted but not yet taken), the hand-off order, and the
end-of-stream rule. The scheduler `reserve()`s a slot before it starts a group, so a full queue
stops admission (backpressure from the learner to the engines) and `put` never blocks or grows
memory past the bound. A slot frees when the learner takes the group.
Order: `ready_first` hands groups out as they finish; `in_order` in the order their slots were
reserved (the order prompts were fed), holding back a finished group until the ones before it.
"""

from __future__ import annotations

from collections import deque

import anyio

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
        self._producers = 0  # sources still being read
        self._error: BaseException | None = None
        self._changed = anyio.Event()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def in_flight(self) -> int:
        return self._reserved

    @property
    def idle(self) -> bool:
        """Nothing queued, nothing running, nothing left to read: every fed prompt was handed out."""
        return not self._items and not self._reserved and not self._producers

    async def reserve(self) -> int:
        """Wait for a free slot and take it for one group about to start; returns its sequence number."""
        await self._slots.acquire()
        self._reserved += 1
        self._next_seq += 1
        return self._next_seq - 1

    def put(self, group: Group, seq: int) -> None:
        """Hand in the finished group of reservation `seq`."""
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
            await changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()
