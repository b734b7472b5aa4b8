"""A group of the learner's run without a task of its own (`CallbackGroup`): the common case, and
cheaper on the driver's CPU and memory than a task per group.

Its path is three callbacks. The lobby starts it (`start`) when it is first in line and an engine
has room; the engine hands back each results frame's samples of it (`on_result`, from the data
path's reader), each sample's room given back at once so the lobby starts the next groups on the
loop's next turn (one look for all the room a turn freed); its last sample completes it into the
learner's queue (`Scheduler.complete`).
What must wait runs as a task, then: what follows an engine ending it (its samples moving on from
an engine that died, `Runner.carry_on`), a reward to score or the durable log to write. Nothing on
the callback path may use anyio, which finds no task there (`anyio.get_cancelled_exc_class`,
a task group's `start_soon` raise NoEventLoopError): `GroupSink.spawn` makes plain asyncio tasks.
A group that needs a task throughout (an episode, a session's turn, a caller's submission, a
request timeout) is not a callback group (`Scheduler._start`).
Owns: one group's requests, samples and room from its start to its delivery. Does not own: where it
goes, what spawned tasks belong to, or stopping at exit (its `GroupSink`, the scheduler).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from rollout.errors import RolloutError
from rollout.inputs.usercode import passes_through
from rollout.scheduling.runner import Runner
from rollout.types import Prompt, Request, Sampling, Trajectory


class GroupSink(Protocol):
    """What a callback group needs of the scheduler that started it (`Scheduler` is one)."""

    runner: Runner  # its engine, the room it holds there, its samples moving on from a dead one
    callback_groups: set[CallbackGroup]  # the callback groups started and not over: stopped when the scheduler exits
    on_trajectory: Callable[[Trajectory], None] | None  # each sample as it finishes

    def spawn(self, fn: Callable[..., Awaitable[None]], *args: object) -> asyncio.Task:
        """Run `fn(*args)` as a task, from a callback too; cancelled when the scheduler exits."""
        ...

    def complete(self, prompt: Prompt, trajectories: list[Trajectory], seq: int, train: bool) -> None:
        """The group's last sample ended: hand it in."""
        ...

    def crash(self, error: BaseException, prompt: Prompt, seq: int, train: bool) -> None:
        """The group failed for a reason of ours: hand it in failed, saying why."""
        ...


class CallbackGroup:
    __slots__ = (
        "sink",
        "prompt",
        "sampling",
        "number",
        "seq",
        "cost",
        "queued_at",
        "train",
        "n",
        "engine",
        "pending",
        "done",
        "abort",
        "over",
    )

    def __init__(
        self,
        sink: GroupSink,
        prompt: Prompt,
        sampling: Sampling,
        number: int,
        seq: int,
        cost: int,
        queued_at: float,
        train: bool,
    ):
        self.sink, self.prompt, self.sampling, self.number, self.seq = sink, prompt, sampling, number, seq
        self.cost, self.queued_at, self.train, self.n = cost, queued_at, train, sampling.n
        self.engine = -1
        self.pending: dict[int, Request] = {}
        self.done: dict[int, Trajectory] = {}
        self.abort: Callable[[], None] | None = None  # aborts what is still running on the engine
        self.over = False  # completed or crashed: nothing more happens to it

    def start(self, i: int) -> None:
        """Room for it is taken on engine `i` (`Lobby`): send it there."""
        p, sampling = self.prompt, self.sampling
        self.engine = i
        self.pending = {
            k: Request(f"r{self.number}-{k}", p.id, k, sampling, token_ids=p.token_ids, text=p.text)
            for k in range(self.n)
        }
        self.sink.callback_groups.add(self)
        try:
            self.abort = self.sink.runner.engines[i].start_group(list(self.pending.values()), self.on_result)
        except BaseException as e:
            self.crash(e)

    def on_result(self, item: list[Trajectory] | BaseException) -> None:
        """Samples of it that finished on its engine, or what ended it there."""
        if self.over:
            return
        if isinstance(item, BaseException):  # what follows (an engine out of rotation, its restart) runs in a task
            self.sink.spawn(self._end, item)
            return
        try:
            release, i, cost = self.sink.runner.release, self.engine, self.cost
            for traj in item:
                del self.pending[traj.sample_index]
                release(i, 1, cost)  # per sample, before anything of ours can raise: a crash gives back the rest
                self.finish(traj)
            if not self.pending:
                self._complete()
        except BaseException as e:  # a bug, or a callback that raised: this group fails with the reason
            if isinstance(e, KeyboardInterrupt):  # the process's own Ctrl-C: nothing here may swallow it
                raise
            self.crash(e)

    def finish(self, traj: Trajectory) -> None:
        traj.queued_at = self.queued_at
        self.done[traj.sample_index] = traj
        if self.sink.on_trajectory is not None:
            self.sink.on_trajectory(traj)

    async def _end(self, error: BaseException) -> None:
        """Its engine ended it with samples unfinished: they move on if it died (`Runner.carry_on`),
        else fail saying why."""
        try:
            if not isinstance(error, RolloutError):  # a bug at the engine's edge (a fake's)
                raise error
            runner, i = self.sink.runner, self.engine
            failure, moved = runner.failed_on(i, error)
            runner.release(i, len(self.pending), self.cost)
            self.abort, self.engine = None, -1  # its room there is given back: a crash below must not give it twice
            await runner.carry_on(i, self.pending, self.cost, self.finish, failure, moved)
            self._complete()
        except BaseException as e:
            if passes_through(e):
                raise
            self.crash(e)

    def _complete(self) -> None:
        self.over = True
        self.sink.callback_groups.discard(self)
        self.sink.complete(self.prompt, [self.done[k] for k in range(self.n)], self.seq, self.train)

    def crash(self, error: BaseException) -> None:
        """It fails with `error` as the reason (a bug of ours, or a callback that raised)."""
        if self.over:
            return
        self.over = True
        self.sink.callback_groups.discard(self)
        if self.pending and self.engine >= 0:
            if self.abort is not None:
                self.abort()
            self.sink.runner.release(self.engine, len(self.pending), self.cost)
        self.sink.crash(error, self.prompt, self.seq, self.train)

    def stop(self) -> None:
        """The scheduler stops: abort what still runs on the engine."""
        self.over = True
        if self.abort is not None:
            self.abort()
