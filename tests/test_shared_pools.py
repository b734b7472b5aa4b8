"""The integration tier's shared engine pools (`tests/support/engines.py`), over fake pools: one
start per kind, a pool handed back as a fresh one (the model's weights, same engines), a failed
test's pool dropped so that the next test starts a new one, at most `max_engines` engines alive."""

from __future__ import annotations

import pytest

from rollout.log import STARTS_ENV
from tests.support.engines import SharedPools
from tests.support.fakes import FakePool
from tests.support.model import STATE


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
