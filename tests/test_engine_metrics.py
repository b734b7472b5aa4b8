"""The engine's figures (`rollout.metrics.live`, `rollout.metrics.prometheus`): `engine.metrics()`
(windows of flat numbers for trackers) and the Prometheus exporter, on fake engines."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request

import anyio
import msgspec
import pytest

from rollout.config import load_config
from rollout.engine import RolloutEngine
from rollout.errors import InvalidConfigError
from rollout.handout.staleness import StalenessStats
from rollout.metrics.live import BusyTime, Totals, figures
from rollout.sync_engine import SyncRolloutEngine
from rollout.types import Prompt, SpecCounters, UpdateStats
from tests.support.fake_engine_runs import settled
from tests.support.fakes import FakePool
from tests.support.metrics import scrape
from tests.support.model import STATE

TIMEOUT = 10
ALWAYS = {
    "rollout/window_s",
    "rollout/tokens",
    "rollout/tokens_per_s",
    "rollout/trajectories",
    "rollout/trajectories_per_s",
    "rollout/failed_trajectories",
    "rollout/groups",
    "rollout/stale_dropped",
    "rollout/stale_dropped_groups",
    "rollout/stale_masked_tokens",
    "rollout/epoch",
    "rollout/weight_updates",
    "rollout/update_stall_ms_max",
    "rollout/queue_depth",
    "rollout/queue_ready",
    "rollout/preemptions",
    "rollout/durable_torn_records",
    "rollout/durable_torn_bytes",
    "rollout/engine_busy_fraction/e0",
    "rollout/engine_busy_fraction/e1",
}
LAG = {"rollout/lag_mean", "rollout/lag_p99", "rollout/lag_max"}


def prompts(count: int) -> list[Prompt]:
    return [Prompt(token_ids=[10 + i] * 3, id=f"q{i}") for i in range(count)]


def numbers_only(m: dict) -> bool:
    return all(k.startswith("rollout/") and type(v) in (int, float) for k, v in m.items())


async def test_metrics_are_flat_numbers_over_the_window_since_the_previous_call(make_cfg):
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(make_cfg("staleness.max_lag=1", "staleness.batch_groups=2"), pool=pool) as engine:
            first = await engine.metrics()  # since start: nothing yet
            engine.feed(prompts(4))  # (epoch 0 + max_lag 1 + 1) * 2 groups may start: all 4, at epoch 0
            await settled()
            await engine.update_weights(STATE)
            await engine.update_weights(STATE)  # the 4 groups now lag 2 > max_lag 1: dropped at hand-out
            assert [g async for g in engine.groups()] == []
            pool.engines[0].preemptions = 5
            second = await engine.metrics()
            third = await engine.metrics()  # straight after: an empty window

            engine.feed(prompts(4))
            got = [g async for g in engine.groups()]
            pool.engines[0].preemptions = 2  # engine 0 restarted: its counter began again
            fourth = await engine.metrics()

    for m in (first, second, third, fourth):
        assert numbers_only(m) and ALWAYS <= set(m) and set(m) <= ALWAYS | LAG
    assert len(got) == 4
    assert first["rollout/tokens"] == 0 and "rollout/lag_mean" not in first  # no tokens handed out: no lag to tell
    assert (second["rollout/tokens"], second["rollout/trajectories"], second["rollout/groups"]) == (4 * 2 * 6, 8, 0)
    assert second["rollout/tokens_per_s"] == pytest.approx(48 / second["rollout/window_s"])
    assert (second["rollout/stale_dropped"], second["rollout/stale_dropped_groups"]) == (8, 4)
    assert (second["rollout/weight_updates"], second["rollout/epoch"], second["rollout/preemptions"]) == (2, 2, 5)
    assert second["rollout/update_stall_ms_max"] == pytest.approx(3.0)  # the fake's stall_s: 0.003
    assert (second["rollout/lag_mean"], second["rollout/lag_p99"]) == (
        2,
        2,
    )  # lags are seen at hand-out, dropped or not
    assert 0 < second["rollout/engine_busy_fraction/e0"] <= 1 and 0 < second["rollout/engine_busy_fraction/e1"] <= 1
    assert (third["rollout/tokens"], third["rollout/stale_dropped"], third["rollout/preemptions"]) == (0, 0, 0)  # reset
    assert (third["rollout/weight_updates"], third["rollout/update_stall_ms_max"]) == (0, 0)
    assert set(third) == ALWAYS  # nothing handed out in it: no lag
    assert (fourth["rollout/tokens"], fourth["rollout/groups"], fourth["rollout/stale_dropped"]) == (48, 4, 0)
    assert (fourth["rollout/lag_mean"], fourth["rollout/lag_p99"], fourth["rollout/preemptions"]) == (0, 0, 2)
    assert fourth["rollout/queue_depth"] == 0 and fourth["rollout/epoch"] == 2


def test_window_figures_from_two_readings():
    before = Totals(
        at=100.0, tokens=1000, staleness=StalenessStats(lag_tokens={0: 10}), busy_s=[1.0, 0.0], preemptions=3
    )
    after = Totals(
        at=110.0, tokens=3000, staleness=StalenessStats(lag_tokens={0: 10, 1: 90, 2: 10}, dropped_trajectories=4),
        busy_s=[3.0, 0.5], preemptions=3, queue_depth=7, queue_ready=2, epoch=5, weight_updates=2,
    )  # fmt: skip
    updates = [
        UpdateStats(epoch=4, mode="keep", stall_s={0: 0.010, 1: 0.025}),
        UpdateStats(epoch=5, mode="keep", stall_s={0: 0.02}),
    ]
    m = figures(before, after, updates)
    assert m["rollout/tokens_per_s"] == 200.0 and m["rollout/window_s"] == 10.0
    assert (
        m["rollout/lag_mean"] == pytest.approx((90 * 1 + 10 * 2) / 100)
        and m["rollout/lag_p99"] == 2
        and m["rollout/lag_max"] == 2
    )
    assert m["rollout/engine_busy_fraction/e0"] == pytest.approx(0.2) and m[
        "rollout/engine_busy_fraction/e1"
    ] == pytest.approx(0.05)
    assert m["rollout/update_stall_ms_max"] == pytest.approx(25.0) and m["rollout/stale_dropped"] == 4
    assert (m["rollout/queue_depth"], m["rollout/queue_ready"], m["rollout/epoch"], m["rollout/preemptions"]) == (
        7,
        2,
        5,
        0,
    )
    assert "rollout/spec_decode/acceptance_rate" not in m


def test_spec_decoding_figures_when_on():
    spec = SpecCounters(engine_id=-1, num_speculative_tokens=3)
    before, after = Totals(spec=spec), Totals(at=1.0, spec=msgspec.structs.replace(spec))
    m = figures(before, after, [], spec_decode=True)
    assert (
        m["rollout/spec_decode/drafts"] == 0 and "rollout/spec_decode/acceptance_rate" not in m
    )  # nothing drafted: no rate
    after.spec.add(10, 30, 15, [8, 5, 2])
    m = figures(before, after, [], spec_decode=True)
    assert m["rollout/spec_decode/acceptance_rate"] == 0.5 and m["rollout/spec_decode/mean_acceptance_length"] == 2.5


async def test_spec_decoding_in_the_engine_window(make_cfg):
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        cfg = make_cfg("speculative.method=ngram", "speculative.num_speculative_tokens=3")
        async with RolloutEngine(cfg, pool=pool) as engine:
            pool.engines[0].spec.add(4, 12, 6, [3, 2, 1])
            pool.engines[1].spec.add(6, 18, 9, [4, 3, 2])
            m = await engine.metrics()
            pool.engines[1].spec.add(2, 6, 0, [0, 0, 0])
            later = await engine.metrics()
    assert (m["rollout/spec_decode/drafts"], m["rollout/spec_decode/accepted_tokens"]) == (10, 15)
    assert m["rollout/spec_decode/acceptance_rate"] == 0.5 and later["rollout/spec_decode/acceptance_rate"] == 0.0


def test_busy_time_reads_the_clock_only_when_an_engine_turns_busy_or_idle():
    reads = []
    times = iter([0.0, 5.0, 7.0])

    def clock() -> float:
        reads.append(1)
        return next(times)

    busy = BusyTime(2, clock)
    busy.change(0, 3)  # busy at 0
    busy.change(0, 1)  # still busy: no clock read
    busy.change(0, 0)  # idle at 5
    busy.change(0, 2)  # busy at 7
    assert len(reads) == 3
    assert busy.seconds(10.0) == [5.0 + 3.0, 0.0]  # the open stretch counts up to now


async def test_prometheus_serves_cumulative_counters_and_stops_with_the_engine(make_cfg):
    pool = FakePool(2)
    threads = set(threading.enumerate())
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(make_cfg("metrics.port=0"), pool=pool) as engine:  # 0: any free port
            assert engine.exporter is not None and engine.exporter.url.startswith("http://127.0.0.1:")
            engine.feed(prompts(3))
            _ = [g async for g in engine.groups()]
            pool.engines[1].preemptions = 4
            await engine.metrics()  # refreshes the engines' own counters now (else every metrics.refresh_s)
            await engine.metrics()  # a window: the exporter's counters do not reset
            url = engine.exporter.url
            got = await anyio.to_thread.run_sync(scrape, url)
    assert got["rollout_generated_tokens_total"] == 3 * 2 * 6 and got["rollout_trajectories_total"] == 6
    assert got["rollout_groups_total"] == 3 and got["rollout_preemptions_total"] == 4
    assert got['rollout_token_lag_bucket{le="0"}'] == 36 and got["rollout_token_lag_count"] == 36
    assert (
        got['rollout_engine_busy_seconds_total{engine="0"}'] > 0
        and 'rollout_engine_busy_seconds_total{engine="1"}' in got
    )
    assert (
        got["rollout_queue_depth"] == 0 and got["rollout_epoch"] == 0 and got["rollout_update_stall_seconds_max"] == 0
    )
    with pytest.raises(urllib.error.URLError):
        await anyio.to_thread.run_sync(scrape, url)  # stopped with the engine
    left = [t for t in set(threading.enumerate()) - threads if t.name != "AnyIO worker thread"]  # anyio's pool stays
    assert left == []  # the server's thread is gone


async def test_a_taken_port_names_the_key_and_stops_the_engines(make_cfg):
    pool = FakePool(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(InvalidConfigError, match=f"metrics.port: cannot serve on 127.0.0.1:{port}"):
            async with RolloutEngine(make_cfg(f"metrics.port={port}"), pool=pool):
                pass
    assert pool.shutdown_calls == 1


def test_metrics_config_defaults_off_and_on_loopback():
    cfg = load_config(None)
    assert cfg.metrics.port is None and cfg.metrics.host == "127.0.0.1"
    with pytest.raises(InvalidConfigError, match="metrics.port"):
        load_config(None, ["metrics.port=70000"])


def test_the_sync_facade_gives_the_same_windows(make_cfg):
    pool = FakePool(2)
    with SyncRolloutEngine(make_cfg(), pool=pool) as engine:
        engine.feed(prompts(3))
        groups = list(engine.groups())
        m = engine.metrics()
        again = engine.metrics()
    assert len(groups) == 3 and numbers_only(m)
    assert (m["rollout/tokens"], m["rollout/groups"], again["rollout/tokens"]) == (3 * 2 * 6, 3, 0)
