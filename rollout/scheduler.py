"""The async scheduler: admits prompts, routes each group to one engine, runs its samples.

Owns the data path between the prompt sources and the trajectory queue:
  1) read the next prompt from the fed sources (lazily, one at a time);
  2) wait for the staleness budget (`staleness.max_lag`, see `staleness.Admission`), then reserve a
     queue slot (a full queue stops admission here);
  3) validate it against the model and its sampling values (a bad one becomes a failed group);
  4) wait for an engine with room for the whole group (`router.route`, least outstanding tokens);
  5) run the group's `n` samples on that engine, so they share its prefix cache; if the engine dies
     (or the group outlives `engines.request_timeout_s`), its unfinished samples continue on
     another engine from the engine's last progress report (`watch`), up to `engines.max_retries`;
  6) score its trajectories with the reward function, if any (off the engine path);
  7) hand the finished group to the queue as soon as its last sample ends (after logging it to
     `queue.durable_dir`, when set).
One task group (the caller's) owns every in-flight group; cancelling it aborts the engine requests.
Does not own: engines (see `backend`), hand-out order and capacity (see `queue`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

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
        on_engine_dead: Callable[[int], bool] | None = None,
    ):
        self.cfg = cfg
        self.engines = list(engines)
        self.queue = queue
        self.limits = limits
        self.on_trajectory = on_trajectory
        self.reward = reward
        self.durable = durable
        self.on_engine_dead = on_engine_dead  # starts a restart; False when it will not
        self.reports: list[Mapping[str, Trajectory]] = [{} for _ in self.engines]  # each engine's latest progress report
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
        capacity = self.cfg.engines.max_inflight_per_engine + self.cfg.engines.queued_per_engine
        while (i := route(self.loads, n, capacity)) is None:
            if not any(load.healthy or load.restarting for load in self.loads):
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
        pending = {
            k: Request(f"r{seq + 1}-{k}", prompt.id, k, sampling, token_ids=prompt.token_ids, text=prompt.text)
            for k in range(sampling.n)
        }
        done: dict[int, Trajectory] = {}
        retries, timeout = 0, self.cfg.engines.request_timeout_s
        while True:
            failure, moved = await self._attempt(i, pending, cost, queued_at, done, timeout)
            if not pending or not moved or retries == self.cfg.engines.max_retries:
                break
            retries += 1
            for k, req in list(pending.items()):  # continue from the failed engine's last progress report
                partial = self.reports[i].get(req.request_id)
                if partial is not None and partial.finished_at:
                    self._finish(partial, queued_at, done)
                    del pending[k]
                elif partial is not None and partial.token_ids:
                    pending[k] = msgspec.structs.replace(req, resume=partial)
            if not pending:
                break
            try:
                i = await self._acquire_engine(len(pending), cost)
            except EngineDeadError as e:
                failure = str(e)
                break
            log.warning("samples moved to another engine", prompt=prompt.id, samples=len(pending), engine=i,
                        reason=failure, resumed_tokens=sum(len(r.resume.token_ids) for r in pending.values() if r.resume))  # fmt: skip
        for k, req in pending.items():
            reason = failure or "engine returned no result"
            self._finish(_failed(req, i, f"{reason} (moved {retries} times)" if retries else reason), queued_at, done)
        trajectories = [done[k] for k in range(sampling.n)]
        if self.reward is not None:
            async with anyio.create_task_group() as tg:
                for t in trajectories:
                    tg.start_soon(score, self.reward, prompt, t)
        await self._hand_in(Group(prompt_id=prompt.id, prompt=prompt, trajectories=trajectories), seq)

    async def _attempt(
        self, i: int, pending: dict[int, Request], cost: int, queued_at: float, done: dict[int, Trajectory], timeout: float | None
    ) -> tuple[str | None, bool]:
        """Run `pending` on engine `i` (capacity already taken), moving finished ones to `done`.

        Returns (failure, whether the rest may move to another engine)."""
        failure, moved = None, False
        try:
            with anyio.fail_after(timeout):
                async for traj in self.engines[i].generate_group(list(pending.values())):
                    del pending[traj.sample_index]
                    self._release_engine(i, 1, cost)  # per sample: the engine has room as soon as one ends
                    self._finish(traj, queued_at, done)
        except EngineDeadError as e:
            self.mark_dead(i, str(e))
            failure, moved = str(e), True
        except TimeoutError:
            failure, moved = f"no result within engines.request_timeout_s={timeout} on engine {i}", True
        except RolloutError as e:
            failure = str(e)
        finally:
            if pending:
                self._release_engine(i, len(pending), cost)
        return failure, moved

    async def watch(self) -> None:
        """Every `engines.health_interval_s`: each healthy engine reports its requests' progress.

        The reports are what a crash keeps. An engine that fails to answer within
        `engines.health_timeout_s` is killed, so its running groups move on instead of hanging.
        """
        while True:
            await anyio.sleep(self.cfg.engines.health_interval_s)
            async with anyio.create_task_group() as tg:
                for i, load in enumerate(self.loads):
                    if load.healthy:
                        tg.start_soon(self._check, i)

    async def _check(self, i: int) -> None:
        engine, timeout = self.engines[i], self.cfg.engines.health_timeout_s
        try:
            with anyio.fail_after(timeout):
                reports = await engine.progress()
        except TimeoutError:
            reason = f"engine {i}: no health report within engines.health_timeout_s={timeout}"
        except RolloutError as e:
            reason = str(e)
        else:
            if engine is self.engines[i]:
                self.reports[i] = reports
            return
        if engine is self.engines[i]:
            self.mark_dead(i, reason)
            await engine.kill()  # its calls fail now, and its groups move on

    def revive(self, i: int, engine: Engine) -> None:
        """A restarted engine `i`, at the current epoch: back into rotation."""
        self.engines[i] = engine
        self.reports[i] = {}  # the old engine's: the samples it held have moved on
        self.loads[i].healthy, self.loads[i].restarting = True, False
        log.info("engine back in rotation", engine=i)
        self._wake_admission()

    def give_up(self, i: int, reason: str) -> None:
        """Engine `i` will not come back."""
        self.loads[i].restarting = False
        log.error("engine gone for good", engine=i, reason=reason)
        self._check_alive()

    def _check_alive(self) -> None:
        if not any(load.healthy or load.restarting for load in self.loads):
            self.queue.fail(EngineDeadError("every engine is dead (and none is restarting)"))
        self._wake_admission()  # admission re-checks: there may be no engine left at all

    async def _hand_in(self, group: Group, seq: int) -> None:
        """Into the queue, after the durable log (if any) holds it."""
        if self.durable is not None:
            await anyio.to_thread.run_sync(self.durable.append, group)
        self.queue.put(group, seq)

    def mark_dead(self, i: int, reason: str) -> None:
        """Take engine `i` out of rotation (its running groups move on) and have it restarted."""
        if self.loads[i].healthy:
            self.loads[i].healthy = False
            log.error("engine out of rotation", engine=i, reason=reason)
            self.loads[i].restarting = self.on_engine_dead is not None and self.on_engine_dead(i)
        self._check_alive()

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
