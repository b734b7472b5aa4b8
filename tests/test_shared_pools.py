"""The integration tier's shared engine pools (`tests/support/engines.py`), over fake pools: one
start per kind, a pool handed back as a fresh one (the model's weights, same engines), a failed
test's pool dropped so that the next test starts a new one, at most `max_engines` engines alive;
and the run's summary of its engine starts (`tests/support/starts.py`), each named by its kind
and the tests that caused and used it."""

from __future__ import annotations

import json

import pytest

from rollout.log import STARTS_ENV
from tests.support.engines import SharedPools, integration_config, kind
from tests.support.fakes import FakePool
from tests.support.model import STATE
from tests.support.oracle_runs import SMALL_KV
from tests.support.starts import summary


@pytest.fixture(autouse=True)
def unrecorded(monkeypatch):
    """Fake pools are no engine starts: the pools these tests drop stay out of the run's summary."""
    monkeypatch.delenv(STARTS_ENV, raising=False)


@pytest.fixture
def make_cfg(make_cfg):
    """The unit tier's config, with room a shared pool has (it runs at most 128 requests an engine)."""
    return lambda *overrides: make_cfg("engines.max_inflight_per_engine=8", *overrides)


def pools_of_fakes(max_engines: int = 4) -> tuple[SharedPools, list[FakePool]]:
    started: list[FakePool] = []

    async def start(cfg):
        started.append(FakePool(cfg.engines.count))
        return started[-1]

    return SharedPools(max_engines=max_engines, start=start), started


async def test_a_kind_starts_once_and_comes_back_at_the_models_weights(make_cfg):
    pools, started = pools_of_fakes()
    async with pools.engine(make_cfg()) as engine:
        assert engine.epoch == 0
        changed = {k: v + 1 for k, v in STATE.items()}
        assert await engine.update_weights(changed) == 1
    assert len(started) == 1 and started[0].shutdown_calls == 0
    assert [e.epoch for e in started[0].engines] == [2, 2], "handed back: the model's own weights, one more epoch"
    async with pools.engine(make_cfg("sampling.n=4", "weight_sync.mode=drain")) as engine:  # driver-side only
        assert engine.epoch == 2 and engine.pool.engines is started[0].engines
    assert len(started) == 1 and [e.epoch for e in started[0].engines] == [2, 2], "nothing changed: nothing loaded"
    await pools.close()
    assert started[0].shutdown_calls == 1


async def test_a_failed_test_leaves_no_pool_for_the_next(make_cfg):
    pools, started = pools_of_fakes()
    with pytest.raises(AssertionError, match="planted"):
        async with pools.engine(make_cfg()) as engine:
            await engine.update_weights({k: v + 1 for k, v in STATE.items()})
            raise AssertionError("planted")
    assert started[0].shutdown_calls == 1, "the failed test's pool is shut down"
    async with pools.engine(make_cfg()) as engine:
        assert engine.epoch == 0 and len(started) == 2, "the next test gets a new pool"
    await pools.close()


async def test_engines_out_of_rotation_are_not_handed_on(make_cfg):
    pools, started = pools_of_fakes()
    async with pools.engine(make_cfg("engines.max_restarts=0")) as engine:
        engine._scheduler.runner.mark_dead(1, "planted: engine 1 died")
    assert started[0].shutdown_calls == 1
    await pools.close()


async def test_other_kinds_stop_the_least_recently_used_idle_pool(make_cfg):
    pools, started = pools_of_fakes(max_engines=4)
    for overrides in [(), ("model.max_model_len=32",), ("model.max_model_len=16",), ()]:
        async with pools.engine(make_cfg(*overrides)):
            pass
    # 2 + 2 engines fit; the third kind stops the first, the first again (started anew) the second
    assert [p.shutdown_calls for p in started] == [1, 1, 0, 0]
    assert len(started) == 4
    await pools.close()
    assert all(p.shutdown_calls == 1 for p in started)


async def test_more_requests_per_engine_than_a_shared_pool_runs_are_refused(make_cfg):
    pools, started = pools_of_fakes()
    with pytest.raises(ValueError, match="at most 128 requests per engine"):
        async with pools.engine(make_cfg("engines.max_inflight_per_engine=256")):
            pass
    assert not started


async def test_a_spoiled_engine_s_pool_is_not_handed_on(make_cfg):
    """A module's engine shared by several tests: one of them failed (the fixture says so)."""
    pools, started = pools_of_fakes()
    async with pools.engine(make_cfg()) as engine:
        pools.spoil(engine)
    assert started[0].shutdown_calls == 1
    async with pools.engine(make_cfg()):
        pass
    assert len(started) == 2 and started[1].shutdown_calls == 0
    await pools.close()


async def test_an_engine_killed_by_the_test_restarts_in_the_hand_back_and_the_pool_is_handed_on(make_cfg):
    """A test that kills an engine and ends before the health watch's next look: the hand-back
    looks itself, waits for the restart, and hands the pool on."""
    pools, started = pools_of_fakes()
    cfg = make_cfg("engines.health_interval_s=3600", "engines.restart_backoff_s=0")
    async with pools.engine(cfg) as engine:
        await engine.pool.engines[1].kill()
    assert started[0].restarts == [1] and started[0].shutdown_calls == 0, "restarted, not dropped"
    async with pools.engine(cfg) as engine:
        assert len(started) == 1 and all(not e.dead for e in engine.pool.engines)
    await pools.close()


def test_a_kind_is_named_by_what_its_engines_start_with_beyond_the_default_config():
    assert kind(integration_config()) == "default"
    driver_side = ("engines.health_interval_s=0.5", "engines.max_restarts=0", "weight_sync.mode=keep", "sampling.n=2")
    assert kind(integration_config("engines.count=3", *driver_side)) == "default", "the count is said apart"
    assert kind(integration_config(SMALL_KV)) == (
        "kv_cache_gib=0.003, weight_transfer_config.backend=shm, block_size unset, compiled"
    )
    spec = ("speculative.method=ngram", "speculative.num_speculative_tokens=3")
    assert kind(integration_config(*spec)) == "spec-decode ngram, num_speculative_tokens=3"
    model = ("model.path=/tmp/x/tiny-261", "model.max_model_len=2048")
    assert kind(integration_config(*model)) == "path=tiny-261, max_model_len=2048"
    forced = "engines.vllm={block_size: 32, enforce_eager: true, logits_processors: ['a.b:Forced']}"
    assert kind(integration_config(forced)) == "logits_processors=[Forced]"


def test_the_summary_names_each_start_its_kind_the_test_that_caused_it_and_the_files_that_shared_it():
    t = "tests/integration/"
    records = [
        {"kind": "test", "test": f"{t}test_chaos.py::test_die", "pid": 1},
        {"kind": "label", "label": "default", "pid": 1},
        {"kind": "pool", "engines": 3, "seconds": 70.4, "pid": 1},
        {"kind": "restarting", "pid": 1},
        {"kind": "test", "test": f"{t}test_cli.py::test_run", "pid": 1},
        {"kind": "restart", "engines": 1, "seconds": 41.0, "pid": 1},  # it ends in the next test
        {"kind": "pool", "engines": 1, "seconds": 50.0, "pid": 7},  # a subprocess's: no label
        {"kind": "test", "test": f"{t}test_a.py::test_x", "pid": 1},
        {"kind": "label", "label": "default", "pid": 1},
        {"kind": "pool", "engines": 2, "seconds": 60.0, "pid": 1},
        {"kind": "lease", "label": "default", "count": 2, "test": f"{t}test_a.py::test_x", "pid": 1},
        {"kind": "test", "test": f"{t}test_a.py::test_y", "pid": 1},
        {"kind": "lease", "label": "default", "count": 2, "test": f"{t}test_a.py::test_y", "pid": 1},
        {"kind": "test", "test": f"{t}test_b.py::test_z[1]", "pid": 1},
        {"kind": "lease", "label": "default", "count": 2, "test": f"{t}test_b.py::test_z[1]", "pid": 1},
        {"kind": "dropped", "reason": "the test failed (after tests/integration/test_b.py::test_z[1])", "pid": 1},
    ]
    for r in records:
        r.setdefault("engines", 0)
        r.setdefault("seconds", 0)
    assert summary(records) == [
        "3 engine pools (6 engines) and 1 engine restarts: 4 starts, 221 s of start-up",
        " 1.   70 s  pool of 3 engines, default: started in test_chaos.py::test_die",
        " 2.   41 s  restart of 1 engine: started in test_chaos.py::test_die",  # where it began
        " 3.   50 s  pool of 1 engine, in a subprocess: started in test_cli.py::test_run",
        " 4.   60 s  pool of 2 engines, default: started in test_a.py::test_x; shared by test_a.py, test_b.py",
        "shared pool dropped: the test failed (after tests/integration/test_b.py::test_z[1])",
    ]


async def test_shared_pools_record_each_test_they_serve_and_a_fresh_one_starts_anew(make_cfg, monkeypatch, tmp_path):
    """The record a run's summary reads: a lease per test, by the pool's kind and count."""
    record = tmp_path / "starts.jsonl"
    monkeypatch.setenv(STARTS_ENV, str(record))
    pools, started = pools_of_fakes()
    for test in ["test_a.py::test_x", "test_b.py::test_y"]:
        monkeypatch.setenv("PYTEST_CURRENT_TEST", f"tests/integration/{test} (call)")
        async with pools.engine(make_cfg()):
            pass
    async with pools.engine(make_cfg(), fresh=True):
        pass
    assert len(started) == 2 and started[0].shutdown_calls == 1, "fresh: the idle pool of the kind is stopped"
    leases = [r for r in map(json.loads, record.read_text().splitlines()) if r["kind"] == "lease"]
    assert [(r["test"], r["count"]) for r in leases] == [
        ("tests/integration/test_a.py::test_x", 2),
        ("tests/integration/test_b.py::test_y", 2),
        ("tests/integration/test_b.py::test_y", 2),
    ]
    assert {r["label"] for r in leases} == {kind(make_cfg())}
    await pools.close()
