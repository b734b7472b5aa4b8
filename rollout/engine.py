"""The public API: `RolloutEngine` (async) and `SyncRolloutEngine` (for plain-script learners).

Owns the lifecycle: resolve the model, start the engine pool, run the scheduler in one task group,
hand out groups and batches, and shut everything down (also on errors and cancellation).

    async with RolloutEngine(load_config("configs/tiny.yaml")) as engine:
        engine.feed(prompts)                      # list: checked now; iterator: read lazily
        async for group in engine.groups(): ...   # ends once every fed prompt is handed out
        batch = await engine.batches(groups=8)    # or: async for batch in engine.batches(groups=8)
        epoch = await engine.update_weights(model.state_dict())   # or a directory of safetensors
"""

from __future__ import annotations

import asyncio
import gc
import signal
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread

from rollout.backend import EnginePool, start_pool
from rollout.config import Config, load_config
from rollout.durable import DurableLog
from rollout.errors import EngineDeadError, InvalidPromptError, WeightSyncError
from rollout.log import configure, get_logger
from rollout.prompts import BadPrompt, ModelLimits, as_async, check_prompt, coerce, effective_sampling
from rollout.queue import TrajectoryQueue
from rollout.rewards import RewardFn, load_reward
from rollout.scheduler import Scheduler
from rollout.staleness import StalenessFilter, StalenessStats
from rollout.types import Batch, EngineStats, Group, Prompt, Trajectory, UpdateStats

log = get_logger(__name__)


class RolloutEngine:
    """Async rollout engine. Use as `async with RolloutEngine(cfg) as engine:`.

    `pool` replaces the Ray/vLLM engines (tests pass a fake); `on_trajectory` is called for
    every finished trajectory, as it finishes (progress bars, live metrics); `reward` (a function
    `(prompt, trajectory) -> float`, sync or async) replaces the config's `reward` path.
    """

    def __init__(
        self,
        cfg: Config | str | Path,
        *,
        pool: EnginePool | None = None,
        on_trajectory: Callable[[Trajectory], None] | None = None,
        reward: RewardFn | None = None,
    ):
        self.cfg = cfg if isinstance(cfg, Config) else load_config(cfg)
        self._reward = reward
        self.pool = pool
        self.model_path = ""
        self._on_trajectory = on_trajectory
        self._scheduler: Scheduler | None = None
        self._queue: TrajectoryQueue | None = None
        self._tg: Any = None
        self.epoch = 0  # the weights every healthy engine serves; +1 per update_weights
        self.weight_updates: list[UpdateStats] = []
        self._update_lock = anyio.Lock()
        self._manifest: Any = None
        self._staleness = StalenessFilter(self.cfg.staleness)
        self._durable: DurableLog | None = None
        self._recovered: list[Group] = []  # from the durable log of an earlier run: handed out first
        self._old_sigterm: Any = None
        self._weights: Any = None  # the latest weights as shared with the engines (restarts load them)
        self._restarts: dict[int, int] = {}

    async def __aenter__(self) -> RolloutEngine:
        configure(self.cfg.logging.level, self.cfg.logging.json)
        self._catch_sigterm()
        reward = self._reward or load_reward(self.cfg.reward)  # a bad path fails before engines start
        from policies.tiny import resolve_model_path

        path = await anyio.to_thread.run_sync(resolve_model_path, self.cfg.model.path, self.cfg.model.seed)
        self.model_path = str(path)
        limits = ModelLimits.from_model_dir(path, self.cfg.model.max_model_len, self.cfg.engines.max_inflight_per_engine)
        if self.cfg.queue.durable_dir:
            self._durable = DurableLog(self.cfg.queue.durable_dir)
            self._recovered = await anyio.to_thread.run_sync(self._durable.open)
        if self.pool is None:
            self.pool = await start_pool(self.cfg, self.model_path)
            if self._old_sigterm is not None:  # take it back: Ray's driver installs a handler that aborts
                signal.signal(signal.SIGTERM, _exit_on_sigterm)
        self._queue = TrajectoryQueue(self.cfg.queue.max_groups, in_order=self.cfg.queue.order == "in_order")
        self._scheduler = Scheduler(
            self.cfg, self.pool.engines, self._queue, limits, self._on_trajectory, reward, self._durable, self._restart_later
        )
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._scheduler.run, self._tg)
        self._tg.start_soon(self._scheduler.watch)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            self._tg.cancel_scope.cancel()  # aborts every in-flight request
            await self._tg.__aexit__(None, None, None)
        finally:
            with anyio.CancelScope(shield=True):
                if self._durable is not None:
                    self._durable.close()
                if self.pool is not None:
                    await self.pool.shutdown()
            self._restore_sigterm()

    def _catch_sigterm(self) -> None:
        self._old_sigterm = _catch_sigterm()

    def _restore_sigterm(self) -> None:
        _restore_sigterm(self._old_sigterm)
        self._old_sigterm = None

    @property
    def limits(self) -> ModelLimits:
        return self._live_scheduler().limits

    def feed(self, prompts: Prompt | str | Iterable[Any] | AsyncIterable[Any]) -> None:
        """Queue prompts for generation.

        A Prompt, a string, or a list/tuple of prompts (Prompt, token-id list, text, dict) is
        checked now: raises InvalidPromptError naming every bad prompt, and admits none of them.
        Iterators, generators and async iterators are read lazily as capacity frees; a bad item
        there comes out of `groups()` as a group with `error` set, and the rest go on.
        """
        scheduler = self._live_scheduler()
        if isinstance(prompts, (Prompt, str)):
            prompts = [prompts]
        if isinstance(prompts, (list, tuple)):
            items = [coerce(p) for p in prompts]
            problems = []
            for i, item in enumerate(items):
                try:
                    if isinstance(item, BadPrompt):
                        raise InvalidPromptError(item.reason)
                    check_prompt(item, effective_sampling(self.cfg.sampling, item), scheduler.limits)
                except InvalidPromptError as e:
                    problems.append(f"[{i}] {e}")
            if problems:
                raise InvalidPromptError(f"{len(problems)} of {len(items)} prompts rejected: " + "; ".join(problems))
            prompts = items
        scheduler.add_source(as_async(prompts))

    @property
    def staleness(self) -> StalenessStats:
        """Lags seen at hand-out and what `staleness.max_lag` dropped or masked (cumulative)."""
        return self._staleness.stats

    async def next_group(self) -> Group | None:
        """The next finished group, or None once every fed prompt has been handed out."""
        scheduler = self._live_scheduler()
        if scheduler.admission.batch_groups is None:
            scheduler.admission.learner_batch(1)  # a learner taking single groups
        return await self._next_group()

    async def _next_group(self) -> Group | None:
        assert self._queue is not None
        if self._recovered:  # logged by an earlier run, handed out as they were
            group = self._recovered.pop(0)
            await self._ack(group)
            return group
        while (group := await self._queue.get()) is not None:
            await self._ack(group)
            if (kept := self._staleness.apply(group, self.epoch)) is not None:  # None: every sample too stale
                return kept
        return None

    async def _ack(self, group: Group) -> None:
        if self._durable is not None:
            await anyio.to_thread.run_sync(self._durable.ack, group)

    async def groups(self) -> AsyncIterator[Group]:
        """Finished groups as they complete; ends once every prompt fed so far is handed out."""
        while (group := await self.next_group()) is not None:
            yield group

    async def next_batch(self, groups: int) -> Batch | None:
        """`groups` complete groups (fewer only at the end of the input); None when nothing is left."""
        self._check_batch_size(groups)
        self._live_scheduler().admission.learner_batch(groups)
        batch = Batch()
        while len(batch.groups) < groups and (group := await self._next_group()) is not None:
            batch.groups.append(group)
        return batch if batch.groups else None

    def batches(self, groups: int) -> _Batches:
        """`await engine.batches(groups=k)` for one batch, `async for b in engine.batches(groups=k)` for all."""
        self._check_batch_size(groups)
        return _Batches(self, groups)

    async def update_weights(self, weights: Any) -> int:
        """Load new weights into every healthy engine while requests keep streaming; returns the new epoch.

        `weights`: a state dict (HF parameter names -> tensors, as `model.state_dict()` gives) or
        a directory of HF safetensors. Names, shapes and dtypes are checked against the model
        first (InvalidWeightsError, no engine touched). The weights move once (Ray's object
        store), every engine receives them, and only then does any engine load them
        (`weight_sync.mode` says what running requests do). An engine that fails to load, or
        takes longer than `weight_sync.timeout_s`, leaves rotation and the call raises
        WeightSyncError naming it; every other engine serves the new epoch.
        """
        from policies.weights import pack, read_manifest

        scheduler = self._live_scheduler()
        assert self.pool is not None
        async with self._update_lock:
            if self._manifest is None:
                self._manifest = await anyio.to_thread.run_sync(read_manifest, self.model_path)
            payload = await anyio.to_thread.run_sync(pack, weights, self._manifest)
            live = [i for i, load in enumerate(scheduler.loads) if load.healthy]
            if not live:
                raise EngineDeadError("every engine is dead")
            engines = [self.pool.engines[i] for i in live]
            epoch, t0 = self.epoch + 1, time.perf_counter()
            shared = self.pool.share(payload)
            received = await asyncio.gather(*(e.stage_weights(epoch, shared) for e in engines), return_exceptions=True)
            if bad := _failures(live, received):
                await asyncio.gather(*(e.drop_weights(epoch) for e in engines), return_exceptions=True)
                raise WeightSyncError(f"epoch {epoch}: weights did not reach {_describe(bad)}; no engine changed", list(bad))
            timeout = self.cfg.weight_sync.timeout_s
            results = await asyncio.gather(
                *(asyncio.wait_for(e.commit_weights(epoch), timeout) for e in engines), return_exceptions=True
            )
            bad = _failures(live, results, f"no answer within weight_sync.timeout_s={timeout}")
            for i in bad:
                scheduler.mark_dead(i, bad[i])
            stats = UpdateStats(
                epoch=epoch,
                mode=self.cfg.weight_sync.mode,
                bytes=getattr(payload, "nbytes", 0),
                bytes_received=sum(r for r in received if isinstance(r, int)),
                seconds=time.perf_counter() - t0,
                stall_s={i: r["stall_s"] for i, r in zip(live, results) if isinstance(r, dict)},
                load_s={i: r["load_s"] for i, r in zip(live, results) if isinstance(r, dict)},
                failed=sorted(bad),
            )
            self.weight_updates.append(stats)
            if len(bad) < len(live):
                self._weights = shared
            if len(bad) == len(live):
                raise WeightSyncError(f"epoch {epoch}: every engine failed to load it: {_describe(bad)}", list(bad))
            self.epoch = epoch
            scheduler.admission.set_epoch(epoch)
            log.info("weights updated", epoch=epoch, seconds=round(stats.seconds, 3), mode=stats.mode, failed=stats.failed)
            if bad:
                raise WeightSyncError(f"epoch {epoch}: {_describe(bad)}; out of rotation, the others serve epoch {epoch}", list(bad))
            return epoch

    def _restart_later(self, i: int) -> bool:
        """The scheduler lost engine `i`: restart it in the background, unless it used up its restarts."""
        n = self._restarts.get(i, 0)
        if n >= self.cfg.engines.max_restarts or not hasattr(self.pool, "restart"):
            return False
        self._restarts[i] = n + 1
        self._tg.start_soon(self._restart, i, n + 1)
        return True

    async def _restart(self, i: int, n: int) -> None:
        """Restart engine `i` (the `n`-th time), load the current epoch's weights, readmit it."""
        scheduler = self._live_scheduler()
        assert self.pool is not None
        await anyio.sleep(self.cfg.engines.restart_backoff_s * 2 ** (n - 1))
        try:
            log.warning("restarting engine", engine=i, restart=n, of=self.cfg.engines.max_restarts)
            engine = await self.pool.restart(i)
            async with self._update_lock:  # no update may slip between loading and readmission
                if self.epoch:
                    await engine.stage_weights(self.epoch, self._weights)
                    with anyio.fail_after(self.cfg.weight_sync.timeout_s):
                        await engine.commit_weights(self.epoch)
                scheduler.revive(i, engine)
        except Exception as e:
            reason = f"restart {n} failed: {type(e).__name__}: {e}"
            if not self._restart_later(i):
                scheduler.give_up(i, reason)
            else:
                log.error("engine restart failed; trying again", engine=i, reason=reason)

    async def stats(self) -> list[EngineStats]:
        assert self.pool is not None
        return [await e.stats() for e in self.pool.engines]

    def _check_batch_size(self, groups: int) -> None:
        if groups < 1:
            raise ValueError(f"groups: expected >= 1, got {groups}")
        if groups > self.cfg.queue.max_groups:
            raise ValueError(f"groups: {groups} can never fill, queue.max_groups is {self.cfg.queue.max_groups}")

    def _live_scheduler(self) -> Scheduler:
        if self._scheduler is None:
            raise RuntimeError("use RolloutEngine inside `async with RolloutEngine(cfg) as engine:`")
        return self._scheduler


def freeze_heap() -> None:
    """Take every object alive now out of the garbage collector's view, as vLLM's servers and its
    benchmark client do once started. For a driver process after `RolloutEngine` has started: its
    heap then holds torch, transformers, Ray and vLLM's config classes, and a full collection
    walking it stalled the scheduler for 0.2-0.3 s every few seconds on the tiny bench. Objects
    alive now that later form unreachable cycles are never freed, so call it once, after start-up
    (the `rollout` command does), and `gc.unfreeze()` before the process exits.
    """
    gc.collect()
    gc.freeze()


def _catch_sigterm() -> Any:
    """SIGTERM exits like Ctrl-C does, through `__aexit__`/`__exit__`, so the engines shut down
    cleanly. Only where nobody else handles it (the default handler, in the main thread).
    Returns the handler to restore, or None when nothing was installed."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        return signal.signal(signal.SIGTERM, _exit_on_sigterm)
    return None


def _restore_sigterm(old: Any) -> None:
    if old is not None:
        signal.signal(signal.SIGTERM, old)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the shutdown short
    raise SystemExit(128 + signum)  # unwinds the event loop; asyncio.run cancels the tasks, __aexit__ runs


def _failures(ids: list[int], results: list[Any], timeout_reason: str = "timed out") -> dict[int, str]:
    """Engine id -> reason, for every result that is an exception."""
    out = {}
    for i, r in zip(ids, results):
        if isinstance(r, BaseException):
            out[i] = timeout_reason if isinstance(r, (asyncio.TimeoutError, TimeoutError)) else f"{type(r).__name__}: {r}"
    return out


def _describe(failures: dict[int, str]) -> str:
    return "; ".join(f"engine {i}: {reason}" for i, reason in sorted(failures.items()))


class _Batches:
    def __init__(self, engine: RolloutEngine, groups: int):
        self._engine, self._groups = engine, groups

    def __await__(self) -> Generator[Any, None, Batch | None]:
        return self._engine.next_batch(self._groups).__await__()

    def __aiter__(self) -> AsyncIterator[Batch]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Batch]:
        while (batch := await self._engine.next_batch(self._groups)) is not None:
            yield batch


class SyncRolloutEngine:
    """Blocking facade: the async engine runs on an event loop in a thread this object owns.

        with SyncRolloutEngine("configs/tiny.yaml") as engine:
            engine.feed(prompts)
            for group in engine.groups(): ...
    """

    def __init__(self, cfg: Config | str | Path, **kwargs: Any):
        self._engine = RolloutEngine(cfg, **kwargs)
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        self._engine_cm = self._portal.wrap_async_context_manager(self._engine)

    def __enter__(self) -> SyncRolloutEngine:
        self._old_sigterm = _catch_sigterm()  # the engine's loop runs in a thread: catch it here
        try:
            self._engine_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            _restore_sigterm(self._old_sigterm)
            raise
        if self._old_sigterm is not None:  # take it back from Ray's driver, which aborts on it
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._engine_cm.__exit__(*exc)
        finally:
            # With an exception (a signal in the middle of a call), calls still running are cancelled.
            self._portal_cm.__exit__(*exc)
            _restore_sigterm(self._old_sigterm)

    def feed(self, prompts: Any) -> None:
        self._portal.call(self._engine.feed, prompts)

    def groups(self) -> Iterator[Group]:
        while (group := self._portal.call(self._engine.next_group)) is not None:
            yield group

    def batch(self, groups: int) -> Batch | None:
        return self._portal.call(self._engine.next_batch, groups)

    def update_weights(self, weights: Any) -> int:
        return self._portal.call(self._engine.update_weights, weights)

    @property
    def epoch(self) -> int:
        return self._engine.epoch

    @property
    def staleness(self) -> StalenessStats:
        return self._engine.staleness

    def stats(self) -> list[EngineStats]:
        return self._portal.call(self._engine.stats)
