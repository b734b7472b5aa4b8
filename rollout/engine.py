"""The public API: `RolloutEngine` (async; `rollout.sync_engine.SyncRolloutEngine` blocks).

Owns the lifecycle: resolve the model, start the engine pool, run the scheduler in one task group,
hand out groups and batches, and shut everything down (also on errors and cancellation).

    async with RolloutEngine(load_config("tiny")) as engine:
        engine.feed(prompts)                      # list: checked now; iterator: read lazily
        async for group in engine.groups(): ...   # ends once every fed prompt is handed out
        server = await engine.serve()             # agents' rewarded episodes come out of groups() too,
        await engine.stop_serving()               # which waits for them until serving stops
        batch = await engine.batches(groups=8)    # or: async for batch in engine.batches(groups=8)
        epoch = await engine.update_weights(model.state_dict())   # or a directory of safetensors
        await engine.commit(batch)                # with queue.durable_dir: never hand it out again
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from rollout.batch import Batch
from rollout.config import Config, load_config
from rollout.driver_process import catch_sigterm, restore_sigterm
from rollout.episodes.chat import chat_renderer
from rollout.episodes.env import EnvFactory, load_env
from rollout.errors import EngineClosedError, InvalidConfigError, InvalidPromptError
from rollout.handout.durable import Commits, DurableLog, DurableLogError
from rollout.handout.queue import Submission, TrajectoryQueue
from rollout.handout.staleness import StalenessFilter, StalenessStats, hand_out
from rollout.handout.to_learner import Batches, HandOut
from rollout.inputs.prompts import ModelLimits, as_async, check_all, sampling_problem
from rollout.inputs.rewards import RewardFn, load_reward
from rollout.log import configure, get_logger
from rollout.metrics.live import EngineMetrics, MetricsWindow
from rollout.metrics.prometheus import Collector, PrometheusExporter, start_exporter
from rollout.scheduling.protocols import EnginePool
from rollout.scheduling.scheduler import Scheduler
from rollout.tiny import resolve_model_path
from rollout.types import EngineStats, Group, Prompt, Trajectory, UpdateStats
from rollout.weights.updates import WeightUpdates

if TYPE_CHECKING:
    from rollout.serve.frontends import FrontEnds
    from rollout.serve.server import Server
    from rollout.weights.sync_client import WeightSyncClient
    from rollout.weights.transfer import WeightTransfer

log = get_logger(__name__)


async def start_pool(cfg: Config, model_path: str) -> EnginePool:
    """Start `cfg.engines.count` vLLM engines as Ray actors and wait until all serve."""
    from actors.pool import RayEnginePool  # the only way in to ray and vLLM, taken lazily

    return await RayEnginePool.start(cfg, model_path)


def check_engine_args(cfg: Config, model_path: str) -> None:
    """vLLM's view of the engine args, built in this process without starting an engine (`rollout
    validate`): what vLLM would refuse at engine start raises InvalidConfigError naming the key."""
    from policies.vllm_args import checked_engine_args  # the engine side's own check, taken lazily

    checked_engine_args(cfg, model_path)


class RolloutEngine:
    """Async rollout engine. Use as `async with RolloutEngine(cfg) as engine:`.

    `pool` replaces the Ray/vLLM engines (tests pass a fake); `on_trajectory` is called for
    every finished trajectory, as it finishes (progress bars, live metrics); `reward` (a function
    `(prompt, trajectory) -> float`, sync or async) replaces the config's `reward` path; `env` (a
    function returning a new environment, e.g. its class) replaces the config's `env` path.
    `start_epoch`: the epoch the run starts at (the learner's restored weights); None: the
    latest epoch recorded in `queue.durable_dir`, else 0. The first update is `start_epoch + 1`.
    """

    def __init__(
        self,
        cfg: Config | str | Path,
        *,
        pool: EnginePool | None = None,
        on_trajectory: Callable[[Trajectory], None] | None = None,
        reward: RewardFn | None = None,
        env: EnvFactory | None = None,
        start_epoch: int | None = None,
    ):
        if start_epoch is not None and start_epoch < 0:
            raise ValueError(f"start_epoch: expected >= 0, got {start_epoch}")
        self.cfg = cfg if isinstance(cfg, Config) else load_config(cfg)
        self._reward = reward
        self._env = env
        self._closed = False
        self._servers: list[Server | FrontEnds] = []  # `serve()`: stopped before the engines
        self.pool = pool
        self.model_path = ""
        self._on_trajectory = on_trajectory
        self._scheduler: Scheduler | None = None
        self._hand: HandOut | None = None  # the learner's end: next_group, next_batch, commit
        self._tg: anyio.abc.TaskGroup | None = None
        self._updates = WeightUpdates(self.cfg)  # epochs, weight updates, restarts
        self._transfer: WeightTransfer | None = None  # vLLM's weight-transfer calls (`weight_sync_client`)
        self.epoch = start_epoch or 0  # the weights every healthy engine serves; +1 per update_weights
        self._resume_at = start_epoch  # None: at the durable log's latest epoch
        self._start_epoch = self.epoch  # the epoch this run started at, once known
        self._staleness = StalenessFilter(self.cfg.staleness)
        self._durable: DurableLog | None = None
        self._recovered: list[Group] = []  # from the durable log of an earlier run: handed out first
        self._commits: Commits | None = None  # with a durable log: handed out, not yet committed
        self._old_sigterm: Any = None
        self._metrics: EngineMetrics | None = None
        self.exporter: PrometheusExporter | None = None  # serving `metrics.port`, when set

    async def __aenter__(self) -> RolloutEngine:
        configure(self.cfg.logging.level, self.cfg.logging.json)
        self._old_sigterm = catch_sigterm()
        reward = self._reward or load_reward(self.cfg.reward)  # a bad path fails before engines start
        env = self._env or load_env(self.cfg.env, self.cfg.env_args)
        path = await anyio.to_thread.run_sync(resolve_model_path, self.cfg.model.path, self.cfg.model.seed)
        self.model_path = str(path)
        limits = ModelLimits.from_model_dir(
            path, self.cfg.model.max_model_len, self.cfg.engines.max_inflight_per_engine
        )
        serve = self.cfg.serve  # the model's tool-call and reasoning formats, for episodes' actions too
        chat = (
            await anyio.to_thread.run_sync(chat_renderer, path, serve.tool_parser, serve.reasoning_parser)
            if env is not None
            else None
        )
        q = self.cfg.queue
        try:
            if (bad := sampling_problem(self.cfg.sampling, limits.vocab_size)) is not None:  # as `rollout validate`
                raise InvalidConfigError(f"sampling.{bad}")
            if q.durable_dir:  # before the engines: a directory that cannot be used starts nothing
                self._durable = DurableLog(q.durable_dir, q.durable_compact_bytes)
                self._recovered = await anyio.to_thread.run_sync(self._durable.open, self._resume_at)
                self._commits = Commits(self._durable, auto=q.durable_commit == "auto")
                self.epoch = self._durable.epoch
            self._start_epoch = self.epoch
            if self.pool is None:  # keeps this process's SIGTERM handler through Ray's start (`actors.cluster`)
                self.pool = await start_pool(self.cfg, self.model_path)
            queue = TrajectoryQueue(self.cfg.queue.max_groups, in_order=self.cfg.queue.order == "in_order")
            self._metrics = EngineMetrics(self, queue)
            on_trajectory = self._metrics.counting(self._on_trajectory)
            self._scheduler = Scheduler(
                self.cfg, self.pool.engines, queue, limits, on_trajectory, reward, self._durable,
                self._updates.restart_later, env, chat,
            )  # fmt: skip
            self._hand = HandOut(
                queue, self._staleness, self._scheduler.admission, lambda: self._updates.learner_epoch,
                self._commits, self._recovered, self.cfg.queue.max_groups,
            )  # fmt: skip
            self._scheduler.runner.on_load = self._metrics.busy.change
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
            self._updates.bind(self._scheduler, self.pool, self.model_path, self._tg, self._durable, self._start_epoch)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._shut_down(raise_errors=False)
            raise
        self._scheduler.start(self._tg)
        try:
            self.exporter = await start_exporter(self._metrics, self.cfg.metrics, self._tg)
        except BaseException:  # metrics.port taken: stop what started
            await self.__aexit__(None)
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """Stop the servers and every in-flight request; on a clean exit commit what was handed out
        (`queue.durable_commit: auto`). Whatever raised on the way, the durable log is closed and
        the pool shut down."""
        with anyio.CancelScope(shield=True):
            for server in self._servers:
                await server.stop()
        self._closed = True
        self._updates.close()  # an update in flight ends with EngineClosedError; nothing restarts any more
        if self._scheduler is not None:
            self._scheduler.fail(EngineClosedError("the engine was shut down"))
        clean = False
        try:
            self._tg.cancel_scope.cancel()  # aborts every in-flight request
            await self._tg.__aexit__(None, None, None)
            if exc_type is None and self._hand is not None:
                await self._hand.commit_on_exit()
            clean = exc_type is None
        finally:
            with anyio.CancelScope(shield=True):
                await self._shut_down(raise_errors=clean)

    async def _shut_down(self, raise_errors: bool) -> None:
        """Stop the metrics exporter, close the durable log, then shut the pool down even if that
        raised. A close error is raised only when nothing else is (it must not hide the error the
        run is unwinding with)."""
        try:
            if self.exporter is not None:
                await anyio.to_thread.run_sync(self.exporter.stop)
            if self._durable is not None:
                try:
                    self._durable.close()
                except DurableLogError as e:
                    if raise_errors:
                        raise
                    log.error("durable log did not close cleanly", error=str(e))
        finally:
            try:
                if self.pool is not None:
                    await self.pool.shutdown()
            finally:
                restore_sigterm(self._old_sigterm)
                self._old_sigterm = None

    @property
    def limits(self) -> ModelLimits:
        return self._live_scheduler().limits

    @property
    def healthy(self) -> bool:
        """Whether any engine is in rotation (a server's `/health`)."""
        return any(load.healthy for load in self._live_scheduler().runner.loads)

    @property
    def restarting(self) -> bool:
        """Whether any engine is being started again (after it died)."""
        return any(load.restarting for load in self._live_scheduler().runner.loads)

    def feed(self, prompts: Prompt | str | Iterable[Any] | AsyncIterable[Any]) -> None:
        """Queue prompts for generation.

        A Prompt, a string, or a list/tuple of prompts (Prompt, token-id list, text, dict) is
        checked now: raises InvalidPromptError naming every bad prompt, and admits none of them.
        Iterators, generators and async iterators are read lazily as capacity frees; a bad item
        there comes out of `groups()` as a group with `error` set, and the rest go on.
        """
        scheduler = self._live_scheduler()
        if isinstance(prompts, (Prompt, str, dict)):
            prompts = [prompts]
        if isinstance(prompts, (list, tuple)):
            prompts = check_all(prompts, self.cfg.sampling, scheduler.limits)
        elif (
            prompts is None
            or isinstance(prompts, (bytes, int, float))
            or not isinstance(prompts, (Iterable, AsyncIterable))
        ):
            raise InvalidPromptError(
                f"feed: expected prompts (a list, an iterator, a prompt), got {type(prompts).__name__}"
            )
        scheduler.add_source(as_async(prompts))

    def submit(
        self, prompts: Prompt | str | dict | Iterable[Any], *, train: bool = True,
        on_tokens: Callable[[int, int, int, list[int], list[float]], None] | None = None,
    ) -> Submission:  # fmt: skip
        """Run prompts now and get their groups back on a channel of the caller's own: `async for
        index, group in submission` as they finish, or `await submission.result()` in prompt order.
        Checked now, like `feed(list)`: raises InvalidPromptError naming every bad prompt, admitting
        none. `train`: the groups count in the staleness budget (`staleness.max_lag`) and are
        checked at hand-out like the learner's; False for traffic that is only served.
        `on_tokens(index, sample_index, position, token_ids, logprobs)`: stream them; called on
        this loop, without blocking, with each sample's new tokens after every engine step (only
        tokens its trajectory keeps: their epochs are in the group when it comes back)."""
        scheduler = self._live_scheduler()
        if isinstance(prompts, (Prompt, str, dict)):
            prompts = [prompts]
        if prompts is None or isinstance(prompts, (bytes, int, float)) or not isinstance(prompts, Iterable):
            raise InvalidPromptError(f"submit: expected prompts (a list, a prompt), got {type(prompts).__name__}")
        items = check_all(list(prompts), self.cfg.sampling, scheduler.limits)
        take = (
            (
                lambda g: hand_out(
                    g, self._updates.learner_epoch, self._staleness, scheduler.admission, keep_dropped=True
                )
            )
            if train
            else None
        )
        submission = Submission(items, train, take, on_tokens)
        scheduler.submit(submission)
        return submission

    async def serve(
        self, host: str | None = None, port: int | None = None, api_key: str | None = None
    ) -> Server | FrontEnds:
        """Start the OpenAI-compatible HTTP server (`rollout.serve`, `serve:` config) next to a learner
        using the engine: in this process, on this engine's loop, or in `serve.api_servers`
        front-end processes; stopped by `stop_serving()` or when the engine exits. Its URL is
        `server.url`. While it serves, the episodes agents reward over HTTP are a stream the
        learner iterates: `groups()`, `next_group()` and `batches()` wait for them instead of ending
        when the fed prompts run out. Raises OSError when it cannot listen."""
        from rollout.serve.frontends import serve

        scheduler = self._live_scheduler()
        server = await serve(self, self._tg, host, port, api_key)
        self._servers.append(server)
        scheduler.queue.producer_started()  # its episodes: the learner's stream waits for them
        return server

    async def stop_serving(self) -> None:
        """Stop every server `serve()` started, once the requests they accepted are answered (a reward
        answered 200 is in the learner's queue): the learner's signal that no more episodes come.
        `groups()`, `next_group()` and `batches()` then end once everything fed and accepted has
        been handed out. Shielded: a cancelled caller still leaves no server half stopped."""
        scheduler = self._live_scheduler()
        servers, self._servers = self._servers, []
        with anyio.CancelScope(shield=True):
            for server in servers:
                try:
                    await server.stop()
                finally:
                    scheduler.queue.producer_done()

    async def deliver(self, group: Group) -> None:
        """Put a group finished elsewhere (an episode served over HTTP) into the learner's queue.
        Raises RetryableError when the queue is full."""
        await self._live_scheduler().deliver(group)

    @property
    def staleness(self) -> StalenessStats:
        """Lags seen at hand-out and what `staleness.max_lag` dropped or masked (cumulative)."""
        return self._staleness.stats

    async def next_group(self, *, keep_dropped: bool = False) -> Group | None:
        """The next finished group, or None once every fed prompt has been handed out and no server
        accepts episodes (`serve()` until `stop_serving()`: a rewarded episode is waited for).
        `keep_dropped`: a group dropped as too stale comes back with `error` set instead of being
        skipped."""
        return await self._hand_out().next_group(keep_dropped)

    def admit_step(self, groups: int) -> None:
        """Let `groups` more groups start now, whatever `staleness.max_lag`: a step of a caller that takes
        all of its groups before it can update weights (`RolloutGeneration`). Lag is checked at hand-out."""
        self._live_scheduler().admission.grant(groups)

    async def commit(self, handed: Batch | Group | Iterable[Group] | None = None) -> None:
        """The learner is done with `handed` (default: everything handed out so far): with
        `queue.durable_dir`, no later run hands those groups out again; without one, a no-op.
        Groups already committed are skipped. With `queue.durable_commit: auto` (the default)
        asking for the next group or batch commits everything handed out before, and so does a
        clean exit; `explicit` leaves it to this call. Raises DurableLogError when the log cannot
        record it: those groups stay uncommitted, and a new run hands them out again.
        """
        if self._hand is not None:
            await self._hand.commit(handed)

    async def groups(self) -> AsyncIterator[Group]:
        """Finished groups as they complete, episodes rewarded over HTTP among them; ends once every
        prompt fed so far is handed out and, after `serve()`, `stop_serving()` was called and every
        episode its servers accepted is handed out too (a learner may also just `break`)."""
        while (group := await self.next_group()) is not None:
            yield group

    async def next_batch(self, groups: int) -> Batch | None:
        """`groups` complete groups with something to train on (fewer only at the end of the input),
        and any group met on the way with nothing to train on (a rejected prompt, every sample
        failed), for its errors; None when nothing is left."""
        return await self._hand_out().next_batch(groups)

    def batches(self, groups: int) -> Batches:
        """`await engine.batches(groups=k)` for one batch, `async for b in engine.batches(groups=k)` for all;
        like `groups()`, they wait for served episodes until `stop_serving()`."""
        return self._hand_out().batches(groups)

    async def update_weights(self, weights: Any, *, wait: bool = True) -> int:
        """Load new weights into every healthy engine while requests keep streaming; returns the new epoch.

        `weights`: a state dict (HF parameter names -> tensors, as `model.state_dict()` gives) or
        a directory of HF safetensors. Names, shapes and dtypes are checked against the model
        first (InvalidWeightsError, no engine touched). The weights move once (Ray's object
        store), every engine receives them, and only then does any engine load them
        (`weight_sync.mode` says what running requests do). An engine that fails to load, or
        takes longer than `weight_sync.timeout_s` (the load; a drain's wait is not counted),
        leaves rotation and the call raises WeightSyncError naming it; every other engine serves
        the new epoch. Epochs are never reused: once any engine may have loaded epoch N, the
        loads run to their end even if the caller is cancelled, and the next update is N+1.

        `wait=False` returns the new epoch once the weights are handed off (checked, in Ray's object
        store; a directory checked and fingerprinted) and the epoch allocated; the rest (every
        engine receives, then loads) runs in the background. Its tokens carry the epoch from each
        engine's load on, `epoch` changes once every engine serves it, and the next update waits
        for it first. A failure there is raised once by the next `update_weights` or
        `weights_loaded`; its epoch is never used again. (`rollout.weights.updates` runs it.)
        """
        self._live_scheduler()
        return await self._updates.update(weights, wait)

    async def weights_loaded(self) -> int:
        """Wait for an update that did not wait (`update_weights(wait=False)`, a weight-sync client's
        `finish_weight_update` with `wait=False`) to end; raises its failure (WeightSyncError), once.
        Returns the epoch every healthy engine serves."""
        self._live_scheduler()
        return await self._updates.settled()

    def weight_sync_client(self, *, wait: bool = True) -> WeightSyncClient:
        """vLLM's `VLLMWeightSyncClient` over every engine, for a learner on vLLM's trainer API
        (`TrainerWeightTransferEngine`: shm, or gloo across nodes, on CPU; nccl / ipc on GPUs); its calls block, so the
        learner makes them from a thread. `finish_weight_update` starts the new epoch and returns it;
        with `wait=False` it returns once every tensor was sent, the engines load in the background
        (as `update_weights(wait=False)`). Call on the engine's event loop. (`rollout.weights.transfer` runs it.)"""
        from rollout.weights.sync_client import WeightSyncClient, loop_caller

        self._live_scheduler()
        return WeightSyncClient(self.weight_transfer(), loop_caller(asyncio.get_running_loop()), wait)

    def weight_transfer(self) -> WeightTransfer:
        """The engine's one `WeightTransfer` (vLLM's four calls over every engine, our two-phase
        guarantee and epochs), shared by every `weight_sync_client` and NeMo RL's collective calls."""
        from rollout.weights.transfer import WeightTransfer

        if self._transfer is None:
            self._transfer = WeightTransfer(self._updates)
        return self._transfer

    async def pause_generation(self, mode: str = "keep") -> None:
        """vLLM's `pause_generation(mode)` on every engine (restarted ones too) until `resume_generation`:
        a learner's /pause. Raises EngineDeadError naming an engine that failed to pause."""
        self._live_scheduler()
        await self._updates.hold(True, mode)

    async def resume_generation(self) -> None:
        self._live_scheduler()
        await self._updates.hold(False)

    async def is_paused(self) -> bool:
        self._live_scheduler()
        return any(await self._updates.on_live("is_paused"))

    @property
    def epoch(self) -> int:
        """The weights every healthy engine serves: the run's start epoch, +1 per update."""
        return self._updates.epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:  # where the run starts (`start_epoch`, the durable log's)
        self._updates.epoch = epoch

    @property
    def durable_torn(self) -> tuple[int, int]:
        """(records, bytes) cut off the end of `queue.durable_dir`'s log when this run opened it: a
        crash's torn last record (0 or 1 of them); (0, 0) without a durable log."""
        d = self._durable
        return (d.torn_records, d.torn_bytes) if d is not None else (0, 0)

    @property
    def weight_updates(self) -> list[UpdateStats]:
        """Figures of every update so far (`UpdateStats`), oldest first."""
        return self._updates.history

    async def stats(self) -> list[EngineStats]:
        """Each engine's figures now. Raises EngineClosedError once the engine was shut down (its
        actors are gone; after a second engine started Ray again, Ray would answer "Can't find actor")."""
        self._live_scheduler()
        assert self.pool is not None
        return [await e.stats() for e in self.pool.engines]

    async def metrics(self) -> dict[str, float]:
        """Every figure since the previous call (the first: since start), flat and numeric, for a
        tracker: `wandb.log(await engine.metrics(), step=step)`. Names and meanings: `rollout.metrics.names`."""
        self._live_scheduler()
        assert self._metrics is not None
        return await self._metrics.window()

    def metrics_window(self) -> MetricsWindow:
        """A window of `metrics()`'s figures of its own: `await w.read()` (since it opened or was last
        reset), `await w.reset()`; `metrics()` and other windows are not affected."""
        self._live_scheduler()
        assert self._metrics is not None
        return self._metrics.opened()

    def prometheus_collector(self) -> Collector:
        """The engine's figures as a prometheus_client collector, for a registry of the caller's
        (`rollout serve`'s `/metrics`); `await c.refresh()` reads the engines' own counters."""
        self._live_scheduler()
        assert self._metrics is not None
        return Collector(self._metrics)

    def _live_scheduler(self) -> Scheduler:
        if self._closed:
            raise EngineClosedError("the engine was shut down: its `async with` block has exited")
        if self._scheduler is None:
            raise EngineClosedError(
                "the engine is not running: use it inside `async with RolloutEngine(cfg) as engine:`"
            )
        return self._scheduler

    def _hand_out(self) -> HandOut:
        self._live_scheduler()
        assert self._hand is not None
        return self._hand
