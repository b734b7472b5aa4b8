"""Live metrics of a running `RolloutEngine`: a flat dict for the trackers researchers read
(Prometheus reads the same totals: `rollout.metrics.prometheus`).

Owns: the running totals nothing else keeps (tokens and trajectories finished, each engine's busy
time, each engine's preemptions and speculative decoding counts summed across restarts), the
window math behind `engine.metrics()` (every figure since the previous call, as one flat dict of
numbers named `rollout/...`, ready for `wandb.log` or `SummaryWriter.add_scalar`).
Does not own the counts kept elsewhere, which it reads: lags and stale drops (`StalenessStats`),
weight updates (`engine.weight_updates`), queue depth (`TrajectoryQueue`), each engine's own
counters (`EngineStats.preemptions`, `SpecCounters`).

Busy time is fed by the scheduler where an engine's request count changes (`BusyTime.change`:
two comparisons, and a clock read only when an engine turns idle or busy). Everything else is
read when asked for, off the hot path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import msgspec

from rollout.aio import fan_out
from rollout.errors import EngineDeadError
from rollout.handout.staleness import StalenessStats
from rollout.log import get_logger
from rollout.metrics.specdecode import SpecDecodeMeter, delta, derive
from rollout.types import SpecCounters, Trajectory

if TYPE_CHECKING:
    from rollout.config import Config
    from rollout.handout.queue import TrajectoryQueue
    from rollout.scheduling.protocols import EnginePool
    from rollout.types import UpdateStats

log = get_logger(__name__)


class BusyTime:
    """Seconds each engine had at least one request in flight (as the scheduler counts them)."""

    def __init__(self, engines: int, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._total = [0.0] * engines
        self._since: list[float | None] = [None] * engines  # busy since, or None while idle

    def change(self, i: int, requests: int) -> None:
        """Engine `i` now has `requests` in flight."""
        since = self._since[i]
        if since is None:
            if requests:
                self._since[i] = self._clock()
        elif not requests:
            self._total[i] += self._clock() - since
            self._since[i] = None

    def seconds(self, now: float) -> list[float]:
        """Busy seconds of each engine up to `now` (a busy stretch still open counts up to `now`)."""
        return [t + (now - s if s is not None else 0.0) for t, s in zip(self._total, self._since)]


class Totals(msgspec.Struct):
    """Cumulative since the engine started, and gauges as of `at` (monotonic seconds)."""

    at: float = 0.0
    tokens: int = 0  # generated tokens of ok trajectories, as they finish
    trajectories: int = 0
    failed: int = 0
    staleness: StalenessStats = msgspec.field(default_factory=StalenessStats)
    weight_updates: int = 0
    busy_s: list[float] = msgspec.field(default_factory=list)
    preemptions: int = 0
    spec: SpecCounters = msgspec.field(default_factory=lambda: SpecCounters(engine_id=-1))
    epoch: int = 0
    queue_ready: int = 0  # finished groups waiting for the learner
    queue_depth: int = 0  # ... and groups running
    durable_torn_records: int = 0  # a crash's torn last record cut off the durable log at open
    durable_torn_bytes: int = 0


class MeteredEngine(Protocol):
    """What the metrics read of the engine they count (`RolloutEngine` is one)."""

    cfg: Config
    pool: EnginePool | None

    @property
    def epoch(self) -> int: ...
    @property
    def weight_updates(self) -> list[UpdateStats]: ...
    @property
    def durable_torn(self) -> tuple[int, int]: ...
    @property
    def staleness(self) -> StalenessStats: ...


class EngineMetrics:
    """The metrics of one `RolloutEngine`; created by it once the engines run."""

    def __init__(self, engine: MeteredEngine, queue: TrajectoryQueue, clock: Callable[[], float] = time.monotonic):
        self._engine, self._queue, self._clock = engine, queue, clock
        count = len(engine.pool.engines) if engine.pool is not None else 0
        self.busy = BusyTime(count, clock)
        self._tokens = self._trajectories = self._failed = 0
        self._preemptions = 0
        self._spec = SpecCounters(engine_id=-1)
        self._last_preemptions: dict[int, int] = {}  # engine index -> its counter at the last reading
        self._spec_meter = SpecDecodeMeter(engine) if engine.cfg.speculative.enabled else None
        self._refreshing = anyio.Lock()
        # the durable log was opened (and a torn tail cut) before: the first window reports it
        self._previous = msgspec.structs.replace(self.totals(), durable_torn_records=0, durable_torn_bytes=0)

    def counting(self, then: Callable[[Trajectory], None] | None) -> Callable[[Trajectory], None]:
        """The scheduler's `on_trajectory`: count each finished trajectory, then call `then`."""

        def on_trajectory(t: Trajectory) -> None:
            if t.ok:
                self._tokens += len(t.token_ids)
                self._trajectories += 1
            else:
                self._failed += 1
            if then is not None:
                then(t)

        return on_trajectory

    async def refresh(self) -> None:
        """Read every live engine's own counters and add what they counted since the last reading
        (an engine whose counter went back was restarted: it counts from zero)."""
        assert self._engine.pool is not None
        async with self._refreshing:  # two readings interleaved would count one stretch twice
            engines = list(self._engine.pool.engines)
            stats = await fan_out(e.stats() for e in engines)
            for i, s in enumerate(stats):
                if isinstance(s, EngineDeadError):
                    continue
                if isinstance(s, BaseException):
                    raise s
                last = self._last_preemptions.get(i, 0)
                self._preemptions += s.preemptions - last if s.preemptions >= last else s.preemptions
                self._last_preemptions[i] = s.preemptions
            if self._spec_meter is not None:
                t = (await self._spec_meter.read()).total
                self._spec.add(t.drafts, t.draft_tokens, t.accepted_tokens, t.accepted_per_pos)

    def totals(self) -> Totals:
        """Everything counted so far, now. Safe from another thread (the Prometheus exporter's):
        it only reads, and copies the one dict it reads (in one C call, under the GIL)."""
        now = self._clock()
        s = self._engine.staleness
        return Totals(
            at=now,
            tokens=self._tokens,
            trajectories=self._trajectories,
            failed=self._failed,
            staleness=msgspec.structs.replace(s, lag_tokens=dict(s.lag_tokens)),
            weight_updates=len(self._engine.weight_updates),
            busy_s=self.busy.seconds(now),
            preemptions=self._preemptions,
            spec=msgspec.structs.replace(self._spec, accepted_per_pos=list(self._spec.accepted_per_pos)),
            epoch=self._engine.epoch,
            queue_ready=len(self._queue),
            queue_depth=len(self._queue) + self._queue.in_flight,
            durable_torn_records=self._engine.durable_torn[0],
            durable_torn_bytes=self._engine.durable_torn[1],
        )

    async def window(self) -> dict[str, float]:
        """The figures since the previous call (the first: since the engine started); see `figures`."""
        await self.refresh()
        now = self.totals()
        out = figures(
            self._previous,
            now,
            self._engine.weight_updates[self._previous.weight_updates :],
            self._spec_meter is not None,
        )
        self._previous = now
        return out

    def opened(self) -> MetricsWindow:
        """A window of figures of its own, beside `window()`'s (`RolloutEngine.metrics_window`)."""
        return MetricsWindow(self)

    def last_updates(self, count: int) -> list[UpdateStats]:
        """The latest `count` weight updates (`UpdateStats`)."""
        return self._engine.weight_updates[-count:]

    async def refresh_every(self, seconds: float) -> None:
        """Keep the engines' own counters fresh for Prometheus's exporter (a task in the engine's task group)."""
        while True:
            await anyio.sleep(seconds)
            try:
                await self.refresh()
            # A failed reading must not end the engine's task group: a scrape shows the last good one.
            except Exception as e:  # noqa: BLE001
                log.warning("metrics: reading the engines' counters failed", error=f"{type(e).__name__}: {e}")


class MetricsWindow:
    """Figures since this window opened or was last `reset` (`read` does not reset it); other
    readers (`engine.metrics()`, other windows) keep windows of their own."""

    def __init__(self, metrics: EngineMetrics):
        self._metrics = metrics
        self._since = metrics.totals()

    async def read(self) -> dict[str, float]:
        m = self._metrics
        await m.refresh()
        now = m.totals()
        return figures(
            self._since, now, m._engine.weight_updates[self._since.weight_updates :], m._spec_meter is not None
        )

    async def reset(self) -> None:
        await self._metrics.refresh()
        self._since = self._metrics.totals()


def figures(before: Totals, after: Totals, updates: list[Any], spec_decode: bool = False) -> dict[str, float]:
    """One window's figures, flat and numeric, named for trackers (`rollout/...`).

    Rates are over the window's wall time. Figures with nothing to say in a window are left out
    rather than made up: lag (no tokens handed out) and speculative acceptance (nothing drafted).
    """
    seconds = after.at - before.at
    rate = (lambda n: n / seconds) if seconds > 0 else (lambda n: 0.0)
    sa, sb = after.staleness, before.staleness
    out: dict[str, float] = {
        "rollout/window_s": seconds,
        "rollout/tokens": after.tokens - before.tokens,
        "rollout/tokens_per_s": rate(after.tokens - before.tokens),
        "rollout/trajectories": after.trajectories - before.trajectories,
        "rollout/trajectories_per_s": rate(after.trajectories - before.trajectories),
        "rollout/failed_trajectories": after.failed - before.failed,
        "rollout/groups": sa.groups - sb.groups,
        "rollout/stale_dropped": sa.dropped_trajectories - sb.dropped_trajectories,
        "rollout/stale_dropped_groups": sa.dropped_groups - sb.dropped_groups,
        "rollout/stale_masked_tokens": sa.masked_tokens - sb.masked_tokens,
        "rollout/epoch": after.epoch,
        "rollout/weight_updates": after.weight_updates - before.weight_updates,
        "rollout/update_stall_ms_max": 1e3 * max((s for u in updates for s in u.stall_s.values()), default=0.0),
        "rollout/queue_depth": after.queue_depth,
        "rollout/queue_ready": after.queue_ready,
        "rollout/preemptions": after.preemptions - before.preemptions,
        "rollout/durable_torn_records": after.durable_torn_records - before.durable_torn_records,
        "rollout/durable_torn_bytes": after.durable_torn_bytes - before.durable_torn_bytes,
    }
    lags = {lag: n - sb.lag_tokens.get(lag, 0) for lag, n in sa.lag_tokens.items() if n > sb.lag_tokens.get(lag, 0)}
    if lags:
        out["rollout/lag_mean"] = sum(lag * n for lag, n in lags.items()) / sum(lags.values())
        out["rollout/lag_p99"] = StalenessStats(lag_tokens=lags).lag_quantile(0.99) or 0
        out["rollout/lag_max"] = max(lags)
    for i, busy in enumerate(after.busy_s):
        was = before.busy_s[i] if i < len(before.busy_s) else 0.0
        out[f"rollout/engine_busy_fraction/e{i}"] = min(1.0, (busy - was) / seconds) if seconds > 0 else 0.0
    if spec_decode:
        m = derive(delta(after.spec, before.spec))
        out["rollout/spec_decode/drafts"] = m.drafts
        out["rollout/spec_decode/draft_tokens"] = m.draft_tokens
        out["rollout/spec_decode/accepted_tokens"] = m.accepted_tokens
        if m.mean_acceptance_length is not None and m.acceptance_rate is not None:
            out["rollout/spec_decode/mean_acceptance_length"] = m.mean_acceptance_length
            out["rollout/spec_decode/acceptance_rate"] = m.acceptance_rate
    return out
