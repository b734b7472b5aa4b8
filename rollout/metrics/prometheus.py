"""The engine's figures for Prometheus: the exporter a run starts (`metrics.port`), the collector
that reads them at each scrape, and `rollout serve`'s own HTTP figures served beside them.

Owns: the Prometheus names and types of `EngineMetrics.totals()` (counters cumulative since start,
gauges current; a dashboard derives windows with `rate(...)`), the exporter's thread and socket,
the server's registry (`HttpStats`, for `GET /metrics`).
Does not own: the counts themselves (`rollout.metrics.live`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import anyio

from rollout.errors import InvalidConfigError
from rollout.log import get_logger
from rollout.metrics.live import EngineMetrics

if TYPE_CHECKING:
    from rollout.config import MetricsConfig

log = get_logger(__name__)


async def start_exporter(
    metrics: EngineMetrics, cfg: MetricsConfig, tg: anyio.abc.TaskGroup
) -> PrometheusExporter | None:
    """Start the Prometheus exporter if `metrics.port` is set, with its refresher in `tg`."""
    if cfg.port is None:
        return None
    exporter = await anyio.to_thread.run_sync(PrometheusExporter, metrics, cfg.host, cfg.port)
    tg.start_soon(metrics.refresh_every, cfg.refresh_s)
    log.info("metrics served", url=exporter.url)
    return exporter


class PrometheusExporter:
    """Serves an engine's metrics for Prometheus at `http://host:port/metrics`.

    Counters are cumulative since the engine started and gauges are current, as Prometheus
    expects; a dashboard derives the windowed figures (`rate(rollout_generated_tokens_total[1m])`
    is `rollout/tokens_per_s`). Started by `RolloutEngine.__aenter__` when `metrics.port` is
    set, stopped (server closed, thread joined) by `__aexit__`. Each scrape reads the totals in
    the server's thread; the engines' own counters are as of the last refresh
    (`metrics.refresh_s`, or the last `engine.metrics()` call).
    """

    def __init__(self, metrics: EngineMetrics, host: str, port: int):
        from prometheus_client import CollectorRegistry, start_http_server  # installed with vLLM

        registry = CollectorRegistry()
        registry.register(Collector(metrics))
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            raise InvalidConfigError(f"metrics.port: cannot serve on {host}:{port}: {e}") from e
        self.host, self.port = host, self._server.server_port  # port 0 asks for any free one

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        """Stop serving, close the socket and join the server's thread (blocks up to ~0.5 s)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class Collector:
    """A prometheus_client custom collector: one scrape, one `EngineMetrics.totals()`; `refresh()`
    reads the engines' own counters first (`RolloutEngine.prometheus_collector`)."""

    def __init__(self, metrics: EngineMetrics):
        self._metrics = metrics

    async def refresh(self) -> None:
        await self._metrics.refresh()

    def describe(self) -> list[Any]:
        return []  # names are fixed but not worth listing twice; registering must not collect

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        t = self._metrics.totals()
        s = t.staleness
        for name, doc, value in (
            ("rollout_generated_tokens", "generated tokens of finished ok trajectories", t.tokens),
            ("rollout_trajectories", "finished ok trajectories", t.trajectories),
            ("rollout_failed_trajectories", "trajectories that failed", t.failed),
            ("rollout_groups", "groups handed out to the learner", s.groups),
            ("rollout_stale_dropped", "trajectories dropped at hand-out as too stale", s.dropped_trajectories),
            ("rollout_stale_dropped_groups", "groups not handed out: every trajectory too stale", s.dropped_groups),
            ("rollout_stale_masked_tokens", "tokens masked out of the loss as too stale", s.masked_tokens),
            ("rollout_weight_updates", "weight updates", t.weight_updates),
            ("rollout_preemptions", "engine preemptions (KV dropped and recomputed)", t.preemptions),
            (
                "rollout_durable_torn_records",
                "torn last records cut off the durable log at open (a crash)",
                t.durable_torn_records,
            ),
            ("rollout_spec_decode_drafts", "speculative decoding: verification steps with drafts", t.spec.drafts),
            ("rollout_spec_decode_draft_tokens", "speculative decoding: draft tokens", t.spec.draft_tokens),
            (
                "rollout_spec_decode_accepted_tokens",
                "speculative decoding: accepted draft tokens",
                t.spec.accepted_tokens,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        busy = CounterMetricFamily(
            "rollout_engine_busy_seconds", "time the engine had a request in flight", labels=["engine"]
        )
        for i, seconds in enumerate(t.busy_s):
            busy.add_metric([str(i)], seconds)
        yield busy
        for name, doc, value in (
            ("rollout_epoch", "policy epoch the engines serve", t.epoch),
            ("rollout_queue_depth", "groups running or waiting for the learner", t.queue_depth),
            ("rollout_queue_ready", "finished groups waiting for the learner", t.queue_ready),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        updates = self._metrics.last_updates(1)
        stall = max((x for u in updates for x in u.stall_s.values()), default=0.0)
        yield GaugeMetricFamily(
            "rollout_update_stall_seconds_max", "longest engine stall of the latest weight update", value=stall
        )
        yield HistogramMetricFamily(
            "rollout_token_lag", "lag in epochs of generated tokens at hand-out", buckets=_lag_buckets(s.lag_tokens),
            sum_value=sum(lag * n for lag, n in s.lag_tokens.items()),
        )  # fmt: skip


def _lag_buckets(lag_tokens: dict[int, int]) -> list[tuple[str, float]]:
    """Cumulative buckets at lags 0, 1, 2, 4, 8, 16 and +Inf."""
    bounds = (0, 1, 2, 4, 8, 16)
    out = [(str(b), float(sum(n for lag, n in lag_tokens.items() if lag <= b))) for b in bounds]
    return [*out, ("+Inf", float(sum(lag_tokens.values())))]


class HttpStats:
    """`rollout serve`'s own figures (HTTP requests, latency, tokens, forgotten episodes) beside the
    engine's (`Collector`), in one registry, for the server's `GET /metrics`."""

    def __init__(self, collector: Collector):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.collector = collector  # the engine's own figures (`RolloutEngine.prometheus_collector`)
        self.registry = CollectorRegistry()
        self.registry.register(collector)
        self.requests = Counter(
            "rollout_http_requests", "HTTP requests by path and status", ["path", "status"], registry=self.registry
        )
        self.latency = Histogram("rollout_http_latency_seconds", "HTTP request latency", ["path"],
                                 registry=self.registry,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))  # fmt: skip
        self.prompt_tokens = Counter("rollout_http_prompt_tokens", "prompt tokens served", registry=self.registry)
        self.generated = Counter(
            "rollout_http_generated_tokens", "tokens generated for HTTP requests", registry=self.registry
        )
        self.episodes_forgotten = Counter("rollout_http_episodes_forgotten",
                                          "open episodes (turns kept, never rewarded) "
                                          "forgotten, the oldest first, past the server's bound",
                                          registry=self.registry)  # fmt: skip

    def request(self, path: str, status: int, seconds: float) -> None:
        self.requests.labels(path, str(status)).inc()
        self.latency.labels(path).observe(seconds)

    def tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.generated.inc(generated)

    async def exposition(self) -> str:
        from prometheus_client import generate_latest

        await self.collector.refresh()
        return generate_latest(self.registry).decode()
