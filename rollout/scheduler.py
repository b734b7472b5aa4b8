"""The async scheduler: admits prompts, routes each group to one engine, runs its samples.

Owns the data path between the prompt sources and the trajectory queue:
  1) read the next prompt from the fed sources (lazily, one at a time);
  2) wait for the staleness budget (`staleness.max_lag`, see `staleness.Admission`), then reserve a
     queue slot (a full queue stops admission here);
  3) validate it against the model and its sampling values (a bad one becomes a failed group);
  4) wait for an engine with room for the whole group (`router.route`, least outstanding tokens);
  5) run the group's `n` samples on that engine, so they share its prefix cache;
  6) score its trajectories with the reward function, if any (off the engine path);
  7) hand the finished group to the queue as soon as its last sample ends (after logging it to
     `queue.durable_dir`, when set).
One task group (the caller's) owns every in-flight group; cancelling it aborts the engine requests.
Does not own: engines (see `backend`), hand-out order and capacity (see `queue`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence

import anyio
import msgspec
from anyio.abc import TaskGroup

from rollout.backend import Engine
from rollout.config import Config
from rollout.durable import DurableLog
from rollout.errors import EngineDeadError, InvalidPromptError, RolloutError
from rollout.log import get_logger
from rollout.prompts import BadPrompt, ModelLimits, check_prompt, coerce, effective_sampling
from rollout.queue import TrajectoryQueue
from rollout.rewards import RewardFn, score
from rollout.router import EngineLoad, route
from rollout.staleness import Admission
from rollout.types import Group, Prompt, Request, Sampling, Trajectory

log = get_logger(__name__)


class Scheduler:
    def __init__(
        self,
        cfg: Config,
        engines: Sequence[Engine],
        queue: TrajectoryQueue,
        limits: ModelLimits,
        on_trajectory: Callable[[Trajectory], None] | None = None,
        reward: RewardFn | None = None,
        durable: DurableLog | None = None,
    ):
        self.cfg = cfg
        self.engines = list(engines)
        self.queue = queue
        self.limits = limits
        self.on_trajectory = on_trajectory
        self.reward = reward
        self.durable = durable
        self.loads = [EngineLoad() for _ in self.engines]
        self._sources: deque[AsyncIterator] = deque()
        self._new_source = anyio.Event()
        self._capacity_freed = anyio.Event()
        self.admission = Admission(cfg.staleness)

    def add_source(self, source: AsyncIterator) -> None:
        """Queue a prompt source; it is read lazily, after the ones fed before it."""
        self._sources.append(source)
        self.queue.producer_started()
        self._new_source.set()

    async def run(self, tg: TaskGroup) -> None:
        """Read sources forever, starting groups in `tg`. A fatal error fails the queue instead of raising."""
        try:
            while True:
                if not self._sources:
                    self._new_source = anyio.Event()
                    await self._new_source.wait()
                    continue
                source = self._sources[0]
                try:
                    async for item in source:
                        await self._admit(coerce(item), tg)
                except EngineDeadError:
                    raise
                except RolloutError as e:  # a source that cannot be read further (e.g. a bad file)
                    seq = await self.queue.reserve()
                    await self._hand_in(Group(prompt_id="", prompt=Prompt(), error=str(e)), seq)
                finally:
                    self._sources.popleft()
                    self.queue.producer_done()
        except EngineDeadError as e:
            log.error("scheduler stopped", error=str(e))
            self.queue.fail(e)

    async def _admit(self, item: Prompt | BadPrompt, tg: TaskGroup) -> None:
        await self.admission.acquire()
        seq = await self.queue.reserve()
        queued_at = time.time()
        if isinstance(item, BadPrompt):
            await self._hand_in(Group(prompt_id=item.id, prompt=Prompt(id=item.id), error=item.reason), seq)
            return
        prompt = item if item.id else _with_id(item, f"p{seq + 1}")
        try:
            sampling = effective_sampling(self.cfg.sampling, prompt)
            check_prompt(prompt, sampling, self.limits)
        except InvalidPromptError as e:
            await self._hand_in(Group(prompt_id=prompt.id, prompt=prompt, error=str(e)), seq)
            return
        cost = len(prompt.token_ids or prompt.text or "") + sampling.max_tokens
        engine = await self._acquire_engine(sampling.n, cost)
        tg.start_soon(self._run_group, engine, prompt, sampling, seq, cost, queued_at)

    async def _acquire_engine(self, n: int, cost: int) -> int:
        capacity = self.cfg.engines.max_inflight_per_engine
        while (i := route(self.loads, n, capacity)) is None:
            if not any(load.healthy for load in self.loads):
                raise EngineDeadError("every engine is dead")
            freed = self._capacity_freed
            await freed.wait()
        self.loads[i].requests += n
        self.loads[i].tokens += n * cost
        return i

    def _release_engine(self, i: int, n: int, cost: int) -> None:
        self.loads[i].requests -= n
        self.loads[i].tokens -= n * cost
        self._wake_admission()

    def _wake_admission(self) -> None:
        self._capacity_freed.set()
        self._capacity_freed = anyio.Event()

    async def _run_group(self, i: int, prompt: Prompt, sampling: Sampling, seq: int, cost: int, queued_at: float) -> None:
        requests = [
            Request(f"r{seq + 1}-{k}", prompt.id, k, sampling, token_ids=prompt.token_ids, text=prompt.text)
            for k in range(sampling.n)
        ]
        done: dict[int, Trajectory] = {}
        failure = None
        try:
            async for traj in self.engines[i].generate_group(requests):
                self._release_engine(i, 1, cost)  # per sample: the engine has room as soon as one ends
                self._finish(traj, queued_at, done)
        except EngineDeadError as e:
            self.mark_dead(i, str(e))
            failure = str(e)
        except RolloutError as e:
            failure = str(e)
        finally:
            if len(done) < len(requests):
                self._release_engine(i, len(requests) - len(done), cost)
        for req in requests:
            if req.sample_index not in done:
                self._finish(_failed(req, i, failure or "engine returned no result"), queued_at, done)
        trajectories = [done[k] for k in range(sampling.n)]
        if self.reward is not None:
            async with anyio.create_task_group() as tg:
                for t in trajectories:
                    tg.start_soon(score, self.reward, prompt, t)
        await self._hand_in(Group(prompt_id=prompt.id, prompt=prompt, trajectories=trajectories), seq)

    async def _hand_in(self, group: Group, seq: int) -> None:
        """Into the queue, after the durable log (if any) holds it."""
        if self.durable is not None:
            await anyio.to_thread.run_sync(self.durable.append, group)
        self.queue.put(group, seq)

    def mark_dead(self, i: int, reason: str) -> None:
        """Take engine `i` out of rotation (its running groups fail with EngineDeadError)."""
        if self.loads[i].healthy:
            self.loads[i].healthy = False
            log.error("engine out of rotation", engine=i, reason=reason)
        self._wake_admission()  # admission re-checks: there may be no engine left at all

    def _finish(self, traj: Trajectory, queued_at: float, done: dict[int, Trajectory]) -> None:
        traj.queued_at = queued_at
        done[traj.sample_index] = traj
        if self.on_trajectory is not None:
            self.on_trajectory(traj)


def _failed(req: Request, engine_id: int, reason: str) -> Trajectory:
    return Trajectory(
        request_id=req.request_id,
        prompt_id=req.prompt_id,
        sample_index=req.sample_index,
        prompt_token_ids=list(req.token_ids or []),
        finish_reason="error",
        error=reason,
        engine_id=engine_id,
        finished_at=time.time(),
    )


def _with_id(prompt: Prompt, pid: str) -> Prompt:
    return msgspec.structs.replace(prompt, id=pid)
