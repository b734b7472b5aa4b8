"""Weight updates over fake engines (`rollout.weights.updates`): the all-or-nothing orchestration of
`RolloutEngine.update_weights` (every engine loads the new epoch or none serves it, dead and hung
engines, cancelled and drained updates) and the driver's packing on its event loop (`pack_on_loop`).
The checks on incoming weights and their wire form: tests/test_weights.py."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import torch

from rollout.engine import RolloutEngine
from rollout.errors import EngineDeadError, InvalidWeightsError, WeightSyncError
from rollout.tensors import pack, read_manifest, save_dir
from rollout.types import Prompt
from rollout.weights.update_checks import pack_on_loop
from tests.support.fakes import FakePool
from tests.support.model import STATE


@pytest.fixture
def cfg(make_cfg):
    """3 engines; an update's engine calls get 0.5 s."""
    return make_cfg("engines.count=3", "weight_sync.timeout_s=0.5")


async def test_pack_on_loop_gives_the_loop_a_turn_per_tensor(tmp_path):
    """The driver's packing (`pack_on_loop`) holds the event loop one tensor at a time: another
    task runs between every two tensors, and the result is `pack`'s, byte for byte. (In a worker
    thread, each of its torch calls would wait for the GIL behind the busy loop.)"""
    sd = {f"layers.{i}.weight": torch.full((8, 8), float(i), dtype=torch.bfloat16) for i in range(50)}
    d = save_dir(sd, tmp_path / "many")
    turns = 0

    async def other_task():
        nonlocal turns
        while True:
            turns += 1
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(other_task)
        await anyio.sleep(0)
        start = turns
        packed = await pack_on_loop(sd, read_manifest(d))
        during = turns - start
        tg.cancel_scope.cancel()
    assert during >= len(sd) - 1, during
    want = pack(sd, read_manifest(d))
    assert packed.specs == want.specs and all(packed.data[n].tobytes() == want.data[n].tobytes() for n in sd)
    assert await pack_on_loop(d, read_manifest(d)) == str(d)


async def test_update_reaches_every_engine_once_and_bumps_the_epoch(cfg):
    pool = FakePool(3)
    with anyio.fail_after(5):
        async with RolloutEngine(cfg, pool=pool) as engine:
            assert await engine.update_weights(STATE) == 1
            assert await engine.update_weights(STATE) == 2
            assert len(pool.shared) == 2  # moved once per update, not once per engine
            assert [e.commits for e in pool.engines] == [[1, 2]] * 3
            u = engine.weight_updates[-1]
            assert (u.epoch, u.bytes, u.bytes_received, u.failed) == (2, 54, 300, [])
            assert set(u.stall_s) == {0, 1, 2}


async def test_a_failed_receive_changes_no_engine(cfg):
    pool = FakePool(3)
    pool.engines[1].fail_stage = True
    with anyio.fail_after(5):
        async with RolloutEngine(cfg, pool=pool) as engine:
            with pytest.raises(WeightSyncError, match="engine 1: RuntimeError: no space left") as e:
                await engine.update_weights(STATE)
            assert e.value.failed == [1] and engine.epoch == 0
            assert all(not eng.commits and not eng.staged for eng in pool.engines)


async def test_an_engine_found_dead_at_an_update_restarts_and_the_others_load_it(cfg):
    """An engine killed a moment ago (no health report due yet): the update finds it dead while
    the weights go out, takes it out of rotation and goes on; its restart loads the new epoch."""
    e = msgspec.structs.replace(cfg.engines, restart_backoff_s=0, health_interval_s=60)
    pool = FakePool(3)
    with anyio.fail_after(5):
        async with RolloutEngine(msgspec.structs.replace(cfg, engines=e), pool=pool) as engine:
            killed = pool.engines[1]
            await killed.kill()
            assert await engine.update_weights(STATE) == 1
            u = engine.weight_updates[-1]
            assert set(u.stall_s) == {0, 2} and not u.failed
            while not engine._scheduler.runner.loads[1].healthy:
                await anyio.sleep(0.01)
            assert pool.restarts == [1] and pool.engines[1] is not killed
            assert [eng.commits for eng in pool.engines] == [[1]] * 3  # the restarted one: at the current epoch
            assert await engine.update_weights(STATE) == 2


async def test_a_live_engine_that_cannot_receive_still_calls_the_update_off(cfg):
    e = msgspec.structs.replace(cfg.engines, restart_backoff_s=0, health_interval_s=60, max_restarts=0)
    pool = FakePool(3)
    pool.engines[0].dead = True
    pool.engines[2].fail_stage = True
    with anyio.fail_after(5):
        async with RolloutEngine(msgspec.structs.replace(cfg, engines=e), pool=pool) as engine:
            with pytest.raises(WeightSyncError, match="engine 2: RuntimeError: no space left") as err:
                await engine.update_weights(STATE)
            assert err.value.failed == [0, 2] and engine.epoch == 0
            assert all(not eng.commits and not eng.staged for eng in pool.engines)
            assert [load.healthy for load in engine._scheduler.runner.loads] == [
                False,
                True,
                True,
            ]  # the dead one is out
            pool.engines[1].dead = pool.engines[2].dead = True
            with pytest.raises(WeightSyncError, match="engine 1: EngineDeadError"):  # none alive: nothing loads
                await engine.update_weights(STATE)
            assert engine.epoch == 0 and not any(eng.commits for eng in pool.engines)


async def test_a_failed_or_hung_load_takes_the_engine_out_of_rotation(cfg):
    pool = FakePool(3)
    pool.engines[0].fail_commit = True
    pool.engines[2].hang_commit = True
    with anyio.fail_after(5):
        async with RolloutEngine(cfg, pool=pool) as engine:
            with pytest.raises(WeightSyncError) as e:
                await engine.update_weights(STATE)
            msg = str(e.value)
            assert (
                "engine 0: RuntimeError: reload failed" in msg
                and "engine 2: no answer within weight_sync.timeout_s" in msg
            )
            assert e.value.failed == [0, 2] and engine.epoch == 1
            engine.feed([Prompt(token_ids=[5, 6], id="after")])
            group = await engine.next_group()
            assert group.ok and {t.engine_id for t in group.trajectories} == {1}
            pool.engines[1].fail_commit = True
            with pytest.raises(WeightSyncError, match="every engine failed"):
                await engine.update_weights(STATE)
            with pytest.raises(EngineDeadError, match="every engine is dead"):
                await engine.update_weights(STATE)


async def test_bad_weights_never_reach_the_pool(cfg, tmp_path):
    pool = FakePool(3)
    with anyio.fail_after(5):
        async with RolloutEngine(cfg, pool=pool) as engine:
            with pytest.raises(InvalidWeightsError, match="missing norm.weight"):
                await engine.update_weights({"embed.weight": STATE["embed.weight"]})
            nan = save_dir(
                {**STATE, "norm.weight": torch.full((3,), float("nan"), dtype=torch.bfloat16)}, tmp_path / "nan"
            )
            with pytest.raises(InvalidWeightsError, match=r"model.safetensors: weights\['norm.weight'\]: contains NaN"):
                await engine.update_weights(nan)
            assert not pool.shared and engine.epoch == 0


async def test_a_cancelled_update_never_lets_two_weights_share_an_epoch(cfg):
    """Engine 0 has committed epoch 1 and engine 1 is still loading when the caller gives up; the
    next update must not label different weights with epoch 1 again."""
    pool = FakePool(3)
    pool.engines[1].commit_gate = gate = anyio.Event()
    with anyio.fail_after(5):
        async with RolloutEngine(cfg, pool=pool) as engine:
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.update_weights, STATE)
                await pool.engines[0].wait_until(lambda e: e.commits == [1])
                tg.cancel_scope.cancel()  # the caller's timeout, mid-commit
                gate.set()
            second = await engine.update_weights(STATE)
            committed = [e.commits for e in pool.engines]
    assert second == 2 and committed == [[1, 2]] * 3, committed


async def test_a_drain_longer_than_the_timeout_is_not_a_failed_load(cfg):
    """In drain mode the engine waits for running requests before loading; weight_sync.timeout_s
    bounds the load, so a long generation must not make the engine 'fail' and restart."""
    drain = msgspec.structs.replace(
        cfg, weight_sync=msgspec.structs.replace(cfg.weight_sync, mode="drain", timeout_s=0.02)
    )
    pool = FakePool(3)
    for e in pool.engines:
        e.commit_gate = anyio.Event()  # the drain: running requests finishing
    with anyio.fail_after(5):
        async with RolloutEngine(drain, pool=pool) as engine:
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.update_weights, STATE)
                await anyio.sleep(0.1)  # time must pass beyond timeout_s: that is what is tested
                for e in pool.engines:
                    e.commit_gate.set()
            assert engine.epoch == 1 and not engine.weight_updates[-1].failed
