"""A learner's mistakes through vLLM's trainer API, without vLLM engines or Ray: fake engines whose
model workers run the real gloo worker engine (real process groups over a real TCPStore, in this
process). Each mistake costs the learner its round, never the engines: a round that leaves a
tensor out or names one twice is refused before any engine changes; an init naming a rendezvous
nobody serves is answered at once and costs the learner its next round, named at its finish,
its wait ending at `weight_sync.timeout_s` whatever the learner asked for;
bytes that never all arrive leave every engine on the previous epoch, in rotation."""

from __future__ import annotations

import anyio
import pytest

from policies.gloo_transfer import StateDictSource
from rollout.engine import RolloutEngine
from rollout.errors import InvalidWeightsError, WeightSyncError
from tests.support.fakes import FakeEngine, FakePool
from tests.support.trainer_api import STATE, changed, trainer, trainer_config

TIMEOUT = 60  # seconds; only reached when a test is about to fail
BOUND = 2  # weight_sync.timeout_s of these tests
NOWHERE = {"master_address": "127.0.0.1", "master_port": 9, "rank_offset": 1, "world_size": 3}


class StagingEngine(FakeEngine):
    """A fake engine whose staging round ends as `policies.weight_loading` ends one: a settle that
    finds bytes missing answers why (vLLM's update ended, the model untouched); a round called off
    drops the staging."""

    async def transfer(self, update_info: dict):
        if not update_info.get("settle"):
            return await super().transfer(update_info)
        try:
            await anyio.to_thread.run_sync(self.worker.update_weights, update_info)
        except RuntimeError as e:
            return f"{type(e).__name__}: {e}"

    async def finish_transfer(self, epoch: int, loaded: bool = True) -> dict[str, float]:
        if not loaded:
            self.worker.update_weights({"discard": True})
        return await super().finish_transfer(epoch, loaded)


@pytest.fixture
def cfg(tmp_path):
    return trainer_config(tmp_path, BOUND)


def untouched(pool) -> bool:
    """No engine restarted, loaded, or started vLLM's update."""
    return not pool.restarts and not any(e.commits or (e.worker is not None and e.worker.staged) for e in pool.engines)


def counting(pool) -> list[str]:
    """Every weight-transfer call the engines got after this, by name."""
    calls: list[str] = []
    for e in pool.engines:
        for name in ("start_transfer", "transfer", "finish_transfer"):
            real = getattr(e, name)

            async def counted(*args, real=real, name=name):
                calls.append(name)
                return await real(*args)

            setattr(e, name, counted)
    return calls


@pytest.mark.parametrize(
    "weights, name_map, match",
    [
        ({n: v for n, v in STATE.items() if n != "norm.weight"}, None, "left out norm.weight"),
        ({**STATE, "model.norm.weight": STATE["norm.weight"]}, lambda n: n.removeprefix("model."),
         "norm.weight twice"),
    ],
)  # fmt: skip
async def test_a_round_that_leaves_a_tensor_out_or_sends_one_twice_is_refused_before_any_engine_changes(
    cfg, weights, name_map, match
):
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            t, client, _ = await trainer(engine, STATE)
            t.source, calls = StateDictSource(weights, name_map=name_map), counting(pool)
            with pytest.raises(InvalidWeightsError, match=f"{match}.*no engine changed"):
                await anyio.to_thread.run_sync(t.send_weights)
            assert calls == [] and untouched(pool) and engine.epoch == 0
            t.source = StateDictSource(changed(1))
            await anyio.to_thread.run_sync(t.send_weights)
            assert engine.epoch == 1 and not pool.restarts
            t.shutdown()


async def test_an_init_naming_a_rendezvous_nobody_serves_costs_the_learner_its_round_not_the_engines(cfg):
    """The learner asks its workers to wait 300 s for a store nobody serves: init answers at once
    (each worker's rendezvous runs in a thread of its own, ending at weight_sync.timeout_s, not
    the learner's 300 s); the learner's round then fails at its finish, naming the address and
    the cap, no engine loading it; no engine leaves rotation, and a correct learner's init and
    round go on."""
    pool = FakePool([StagingEngine(0), StagingEngine(1)])
    run = anyio.to_thread.run_sync
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            client = engine.weight_sync_client()
            await run(client.init_weight_transfer_engine, {**NOWHERE, "timeout_s": 300})
            for e in pool.engines:  # each rendezvous gives up at weight_sync.timeout_s
                await run(e.worker.join.thread.join)
            info = {"names": list(STATE), "dtype_names": [str(v.dtype).removeprefix("torch.") for v in STATE.values()],
                    "shapes": [list(v.shape) for v in STATE.values()], "round": 1}  # fmt: skip
            await run(client.start_weight_update)
            await run(client.update_weights, info)  # the engines take the round: no byte can come
            with pytest.raises(WeightSyncError) as e:
                await run(client.finish_weight_update)
            said = str(e.value)
            assert f"could not join the learner's group at 127.0.0.1:9 within timeout_s={BOUND}" in said, said
            assert f"capped at weight_sync.timeout_s={BOUND}" in said and "no engine loaded epoch 1" in said, said
            assert engine.epoch == 0 and untouched(pool) and all(e.worker.join is None for e in pool.engines)
            assert all(load.healthy for load in engine._scheduler.runner.loads)
            t, client, source = await trainer(engine, STATE)
            source.update(changed(2))
            await run(t.send_weights)
            assert engine.epoch == 2 and not pool.restarts  # epoch 1 was allocated: never used again
            t.shutdown()


async def test_an_engine_whose_init_never_answers_leaves_rotation_and_restarts(cfg):
    pool = FakePool(2)

    async def stuck(info):
        await anyio.sleep_forever()

    pool.engines[1].init_transfer = stuck
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            client = engine.weight_sync_client()
            with pytest.raises(WeightSyncError, match="engine 1: no answer within.*out of rotation"):
                await anyio.to_thread.run_sync(client.init_weight_transfer_engine, {**NOWHERE, "timeout_s": 1})
            while pool.restarts != [1]:
                await anyio.sleep(0.01)  # restarted (the restart is a fresh fake)
            t, client, source = await trainer(engine, STATE)
            source.update(changed(1))
            await anyio.to_thread.run_sync(t.send_weights)
            assert engine.epoch == 1


async def test_bytes_that_never_all_arrive_leave_every_engine_on_the_previous_epoch_in_rotation(cfg):
    """The learner's group goes after update_weights, before its bytes, and the learner still calls
    finish: the engines had staged, not loaded; each drops the staging and keeps serving epoch 0;
    the learner inits again and its next round loads."""
    pool = FakePool([StagingEngine(0), StagingEngine(1)])
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            t, client, source = await trainer(engine, STATE)
            info = {"names": list(STATE), "dtype_names": [str(v.dtype).removeprefix("torch.") for v in STATE.values()],
                    "shapes": [list(v.shape) for v in STATE.values()], "round": 1}  # fmt: skip
            run = anyio.to_thread.run_sync
            await run(client.start_weight_update)
            await run(client.update_weights, info)
            t.shutdown()  # the learner's groups go: no byte comes
            with pytest.raises(WeightSyncError, match="no engine loaded epoch 1; every engine serves epoch 0"):
                await run(client.finish_weight_update)
            assert engine.epoch == 0 and untouched(pool) and not any(e.worker.staged for e in pool.engines)
            assert all(load.healthy for load in engine._scheduler.runner.loads)
            t, client, source = await trainer(engine, STATE)
            source.update(changed(2))
            await run(t.send_weights)
            assert engine.epoch == 2 and not pool.restarts  # epoch 1 was allocated: never used again
            t.shutdown()
