"""Handing finished groups to the learner: `RolloutEngine.next_group`, `next_batch` and `commit`.

Owns the order (groups an earlier run logged to the durable log first, then the queue's as they
finish), the staleness check at hand-out (`rollout.handout.staleness`), and, with a durable log, holding
what was handed out until the learner commits it (`rollout.handout.durable.Commits`).
Does not own: finishing groups (the scheduler puts them in the queue), the learner's epoch
(`rollout.weights.updates`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Generator, Iterable
from typing import Any

from rollout.batch import Batch
from rollout.handout.durable import Commits
from rollout.handout.queue import TrajectoryQueue
from rollout.handout.staleness import Admission, StalenessFilter, hand_out, trainable
from rollout.types import Group


class HandOut:
    """The learner's end of the queue. `learner_epoch()`: the epoch hand-out measures lag against."""

    def __init__(
        self,
        queue: TrajectoryQueue,
        staleness: StalenessFilter,
        admission: Admission,
        learner_epoch: Callable[[], int],
        commits: Commits | None,
        recovered: list[Group],
        max_groups: int,
    ):
        self._queue, self._staleness, self._admission = queue, staleness, admission
        self._learner_epoch, self._commits, self._recovered = learner_epoch, commits, recovered
        self._max_groups = max_groups

    async def next_group(self, keep_dropped: bool = False) -> Group | None:
        if self._commits is not None:
            await self._commits.poll()
        if self._admission.batch_groups is None:
            self._admission.learner_batch(1)  # a learner taking single groups
        return await self._next(keep_dropped)

    async def next_batch(self, groups: int) -> Batch | None:
        self.check_batch_size(groups)
        self._admission.learner_batch(groups)
        if self._commits is not None:
            await self._commits.poll()
        batch, to_train = Batch(), 0
        while to_train < groups and (group := await self._next()) is not None:
            batch.groups.append(group)
            to_train += trainable(group)
        return batch if batch.groups else None

    def batches(self, groups: int) -> Batches:
        self.check_batch_size(groups)
        return Batches(self, groups)

    async def commit(self, handed: Batch | Group | Iterable[Group] | None = None) -> None:
        if self._commits is not None:
            await self._commits.commit(handed)

    async def commit_on_exit(self) -> None:
        """A clean exit commits everything handed out (`queue.durable_commit: auto`)."""
        if self._commits is not None and self._commits.auto:
            await self._commits.commit()

    def check_batch_size(self, groups: int) -> None:
        if groups < 1:
            raise ValueError(f"groups: expected >= 1, got {groups}")
        if groups > self._max_groups:
            raise ValueError(f"groups: {groups} can never fill, queue.max_groups is {self._max_groups}")

    async def _next(self, keep_dropped: bool = False) -> Group | None:
        while self._recovered:  # logged by an earlier run: first, and checked like any other
            if (kept := await self._checked(self._recovered.pop(0), recovered=True)) is not None:
                return kept
        while (group := await self._queue.get()) is not None:
            if (out := await self._checked(group, keep_dropped=keep_dropped)) is not None:
                return out  # else: every sample too stale, dropped
        return None

    async def _checked(self, group: Group, *, recovered: bool = False, keep_dropped: bool = False) -> Group | None:
        """`group` through the staleness check (None: dropped); with a durable log, taken until committed.
        A recovered group was not admitted by this run, so this run's admission does not count it."""

        def keep(g: Group) -> Group | None:
            if recovered:
                return self._staleness.apply(g, self._learner_epoch())
            return hand_out(g, self._learner_epoch(), self._staleness, self._admission, keep_dropped)

        return keep(group) if self._commits is None else await self._commits.hand_out(group, keep)


class Batches:
    """`await engine.batches(groups=k)` for one batch, `async for b in engine.batches(groups=k)` for all."""

    def __init__(self, hand: HandOut, groups: int):
        self._hand, self._groups = hand, groups

    def __await__(self) -> Generator[Any, None, Batch | None]:
        return self._hand.next_batch(self._groups).__await__()

    def __aiter__(self) -> AsyncIterator[Batch]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Batch]:
        while (batch := await self._hand.next_batch(self._groups)) is not None:
            yield batch
