"""vLLM's trainer API on the engine, without vLLM engines or Ray: vLLM's trainer factory builds our
gloo trainer engine, which drives `RolloutEngine.weight_sync_client()` over fake engines whose
model workers run the real gloo worker engine (real process groups over a real TCPStore, in this
process). What each guarantee of `rollout.weights.transfer` means when things go wrong, and what an
update that does not wait (`wait=False`, object store and trainer API) promises."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import torch

from policies.gloo_transfer import GlooTrainerInitInfo, StateDictSource
from rollout.engine import RolloutEngine
from rollout.errors import InvalidWeightsError, WeightSyncError
from tests.support.fakes import FakePool
from tests.support.trainer_api import STATE, changed, trainer, trainer_config

TIMEOUT = 30  # seconds; only reached when a test is about to fail


@pytest.fixture
def cfg(tmp_path):
    return trainer_config(tmp_path, 5)


async def send(t, source, weights) -> None:
    source.update(weights)
    await anyio.to_thread.run_sync(t.send_weights)


def loaded(pool, i: int) -> dict:
    return pool.engines[i].worker.model.loaded


async def test_each_round_loads_every_engine_and_starts_the_next_epoch(cfg):
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            t, client, source = await trainer(engine, STATE, timeout_s=10)
            for k in (1, 2):
                await send(t, source, changed(k))
                assert engine.epoch == k and [e.commits for e in pool.engines] == [list(range(1, k + 1))] * 2
                assert all(torch.equal(loaded(pool, i)[n], v) for i in (0, 1) for n, v in changed(k).items())
            u = engine.weight_updates[-1]
            assert (
                u.epoch == 2
                and u.bytes == sum(v.numel() * v.element_size() for v in STATE.values())
                and u.bytes_received == 2 * u.bytes
            )
            assert await anyio.to_thread.run_sync(client.update_weight_version, "step-2") == 2 and client.versions == {
                "step-2": 2
            }
            t.shutdown()


async def test_calls_out_of_order_change_nothing_and_name_the_call(cfg):
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            client = engine.weight_sync_client()
            run = anyio.to_thread.run_sync
            with pytest.raises(WeightSyncError, match="start_weight_update called before init_weight_transfer_engine"):
                await run(client.start_weight_update)
            with pytest.raises(
                WeightSyncError, match="finish_weight_update called without start_weight_update; the epoch stays 0"
            ):
                await run(client.finish_weight_update)
            with pytest.raises(WeightSyncError, match="update_weights called without start_weight_update"):
                await run(client.update_weights, {"names": [], "dtype_names": [], "shapes": []})
            with pytest.raises(WeightSyncError, match="world_size 5, but the learner's 1 rank"):
                await run(
                    client.init_weight_transfer_engine,
                    {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 5},
                )
            with pytest.raises(RuntimeError, match="call it from a thread"):
                client.start_weight_update()  # on the engine's own loop it would deadlock
            t, client, source = await trainer(engine, STATE, timeout_s=10)
            await run(client.start_weight_update)
            with pytest.raises(WeightSyncError, match="start_weight_update called while a weight update is active"):
                await run(client.start_weight_update)
            assert await run(client.finish_weight_update) == 0  # nothing sent: nothing changed
            assert engine.epoch == 0 and not any(e.commits for e in pool.engines)
            await send(t, source, changed(1))
            assert engine.epoch == 1
            t.shutdown()


@pytest.mark.parametrize(
    "bad, match",
    [
        (
            {**STATE, "norm.weight": torch.ones(3, dtype=torch.bfloat16)},
            r"norm.weight: bfloat16 \[3\], model has bfloat16 \[30\]",
        ),
        ({**STATE, "norm.weight": torch.ones(30)}, r"norm.weight: float32 \[30\], model has bfloat16"),
        ({**STATE, "extra.weight": torch.ones(1)}, "unknown extra.weight"),
    ],
)
async def test_weights_that_do_not_fit_change_no_engine_and_name_the_tensor(cfg, bad, match):
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            t, client, source = await trainer(engine, STATE, timeout_s=10)
            with pytest.raises(InvalidWeightsError, match=match) as e:
                await send(t, source, bad)  # fails at once: no broadcast waits out its timeout
            assert "no engine changed" in str(e.value)
            assert engine.epoch == 0 and not any(e.commits or e.worker.model.pending for e in pool.engines)
            await send(t, source, changed(1))
            assert engine.epoch == 1  # the number was never allocated
            t.shutdown()


async def test_an_unknown_name_after_the_learners_name_map_is_named(cfg):
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            t, client, source = await trainer(engine, STATE, timeout_s=10)
            t.source = StateDictSource(
                {f"module.{n}": v for n, v in STATE.items()},
                name_map=lambda n: n.removeprefix("module.").replace("norm", "nrm"),
            )
            with pytest.raises(InvalidWeightsError, match="unknown nrm.weight"):
                await anyio.to_thread.run_sync(t.send_weights)
            t.source = StateDictSource(
                {f"module.{n}": v for n, v in changed(1).items()}, name_map=lambda n: n.removeprefix("module.")
            )
            await anyio.to_thread.run_sync(t.send_weights)
            assert engine.epoch == 1 and all(torch.equal(loaded(pool, 0)[n], v) for n, v in changed(1).items())
            t.shutdown()


async def test_an_engine_that_cannot_start_changes_no_engine(cfg):
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            t, client, source = await trainer(engine, STATE, timeout_s=10)
            pool.engines[1].fail_stage = True
            with pytest.raises(
                WeightSyncError, match="engine 1: RuntimeError: cannot start the update.*no engine changed"
            ):
                await send(t, source, changed(1))
            assert engine.epoch == 0 and not any(e.commits or e.worker.model.pending for e in pool.engines)
            pool.engines[1].fail_stage = False
            await send(t, source, changed(2))
            assert engine.epoch == 1
            t.shutdown()


async def test_an_engine_failing_to_load_leaves_rotation_and_the_others_serve(cfg):
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            t, client, source = await trainer(engine, STATE, timeout_s=10)
            pool.engines[1].fail_commit = True
            with pytest.raises(
                WeightSyncError,
                match="epoch 1: engine 1: RuntimeError: reload failed; out of rotation, the others serve epoch 1",
            ):
                await send(t, source, changed(1))
            assert engine.epoch == 1 and pool.engines[0].commits == [1] and pool.engines[1].commits == []
            assert engine.weight_updates[-1].failed == [1]
            with anyio.fail_after(TIMEOUT):
                while not pool.restarts:
                    await anyio.sleep(0.01)  # out of rotation: restarted
            with pytest.raises(WeightSyncError, match="restarted or left since init_weight_transfer_engine"):
                await send(t, source, changed(2))  # its new workers are not in the learner's group
            assert engine.epoch == 1
            t.shutdown()


async def test_a_learner_that_stops_calling_mid_round_ends_its_round(cfg):
    """start_weight_update, then nothing: after weight_sync.timeout_s the round ends, no engine
    changed, and the next learner's round goes on."""
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            t, client, source = await trainer(engine, STATE, timeout_s=10)
            await anyio.to_thread.run_sync(client.start_weight_update)
            while engine.weight_transfer().round is not None:
                await anyio.sleep(0.05)
            assert engine.epoch == 0 and not any(e.commits for e in pool.engines)
            await send(t, source, changed(1))
            assert engine.epoch == 1
            t.shutdown()


async def test_a_learner_gone_mid_transfer_leaves_every_engine_serving_the_previous_epoch(cfg):
    """The learner's process dies after its first bucket (its group goes with it): the engines had
    staged, not loaded, so after weight_sync.timeout_s with no call the round is called off, every
    engine stays in rotation on the epoch before, and its number is never used again; the learner
    inits again and its round loads."""
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            t, client, source = await trainer(engine, STATE, timeout_s=10)

            class Dies(StateDictSource):
                def __iter__(self):
                    for k, pair in enumerate(super().__iter__()):
                        if k == 1:
                            t.shutdown()
                            raise ConnectionError("learner died")
                        yield pair

            t.source = Dies(changed(1))
            with pytest.raises(ConnectionError):
                await anyio.to_thread.run_sync(t.send_weights)
            while engine.weight_transfer().round is not None:
                await anyio.sleep(0.05)  # the round ends on its own
            assert engine.epoch == 0 and not any(e.commits for e in pool.engines) and not pool.restarts
            assert all(load.healthy for load in engine._scheduler.runner.loads)
            assert engine._updates.allocated == 1  # epoch 1 was started: never used again
            t, client, source = await trainer(engine, STATE, timeout_s=10)
            await send(t, source, changed(2))
            assert engine.epoch == 2 and not pool.restarts
            t.shutdown()


def gated_pool() -> FakePool:
    """Two fake engines whose loads wait until the test sets each one's `commit_gate`."""
    pool = FakePool(2)
    for e in pool.engines:
        e.commit_gate = anyio.Event()
    return pool


async def test_an_update_that_does_not_wait_returns_its_epoch_before_any_engine_loads(cfg):
    """Object store, `wait=False`: the epoch comes back while every load is held; `epoch` moves only
    once every engine serves it; `weights_loaded` waits for that."""
    pool = gated_pool()
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            assert await engine.update_weights(changed(1), wait=False) == 1
            assert engine.epoch == 0 and not any(e.commits for e in pool.engines)
            for e in pool.engines:
                e.commit_gate.set()
            assert await engine.weights_loaded() == 1
            assert engine.epoch == 1 and [e.commits for e in pool.engines] == [[1], [1]]
            assert await engine.update_weights(changed(2), wait=False) == 2 and await engine.weights_loaded() == 2


async def test_a_failure_after_an_update_that_did_not_wait_is_raised_once_and_its_epoch_never_reused(cfg):
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            with pytest.raises(
                InvalidWeightsError, match="unknown extra.weight"
            ):  # before the hand-off: raised at once
                await engine.update_weights({**STATE, "extra.weight": torch.ones(1)}, wait=False)
            for e in pool.engines:
                e.fail_commit = True
            assert await engine.update_weights(changed(1), wait=False) == 1
            with pytest.raises(
                WeightSyncError, match="not waited for failed: epoch 1: every engine failed to load it"
            ) as e:
                await engine.weights_loaded()
            assert sorted(e.value.failed) == [0, 1] and engine.epoch == 0
            assert await engine.weights_loaded() == 0  # raised once
            while len(pool.restarts) < 2:
                await anyio.sleep(0.01)  # out of rotation: restarted (fresh fakes load fine)
            assert await engine.update_weights(changed(2)) == 2  # epoch 1 may be torn somewhere: never used again


async def test_the_next_update_raises_the_failure_of_one_that_did_not_wait_and_changes_nothing(cfg):
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            pool.engines[1].fail_stage = True
            assert await engine.update_weights(changed(1), wait=False) == 1
            with pytest.raises(
                WeightSyncError,
                match="not waited for failed: epoch 1: weights did not reach engine 1.*no engine changed",
            ):
                await engine.update_weights(changed(2))
            assert engine.epoch == 0 and not any(e.commits for e in pool.engines)
            pool.engines[1].fail_stage = False
            assert await engine.update_weights(changed(3)) == 2


def gated(engine, gate: anyio.Event) -> None:
    """`engine`'s vLLM finish_weight_update waits for `gate`."""
    finish = engine.finish_transfer

    async def held(*args):
        await gate.wait()
        return await finish(*args)

    engine.finish_transfer = held


async def test_a_trainer_round_that_does_not_wait_returns_once_sent_and_the_next_waits_for_its_loads(cfg):
    pool = FakePool(2)
    gate = anyio.Event()
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

            client, source = engine.weight_sync_client(wait=False), StateDictSource(STATE)
            init = GlooTrainerInitInfo(world_size=1 + client.world_size(), rank=0, bucket_bytes=1000, timeout_s=10)
            t = await anyio.to_thread.run_sync(
                lambda: WeightTransferTrainerFactory.trainer_init(init, client=client, source=source)
            )
            gated(pool.engines[0], gate)
            await send(t, source, changed(1))  # returns with engine 0's load held
            assert engine.epoch == 0 and pool.engines[0].commits == []
            with pytest.raises(WeightSyncError, match="update_weights called without start_weight_update"):
                await anyio.to_thread.run_sync(client.update_weights, {"names": [], "dtype_names": [], "shapes": []})
            gate.set()
            assert await engine.weights_loaded() == 1 and [e.commits for e in pool.engines] == [[1], [1]]
            assert all(torch.equal(loaded(pool, i)[n], v) for i in (0, 1) for n, v in changed(1).items())
            pool.engines[1].fail_commit = True
            await send(t, source, changed(2))  # the failure comes after the learner's call returned
            with pytest.raises(
                WeightSyncError, match="not waited for failed: epoch 2: engine 1: RuntimeError: reload failed"
            ):
                await send(t, source, changed(3))  # the next round raises it, once, and changes nothing
            assert engine.epoch == 2 and pool.engines[0].commits == [1, 2]
            t.shutdown()


async def test_lag_counts_from_the_epoch_the_learner_holds_while_the_engines_still_load(cfg):
    """After `update_weights(wait=False)` returned epoch 1, the learner trains with epoch 1: a token
    of epoch 0 handed out meanwhile lags 1, though no engine serves epoch 1 yet."""
    from rollout import Prompt

    pool = gated_pool()
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            assert await engine.update_weights(changed(1), wait=False) == 1
            engine.feed([Prompt(token_ids=[5, 6, 7], id="p", sampling={"max_tokens": 4, "n": 1})])
            group = await engine.next_group()
            assert engine.epoch == 0 and group.trajectories[0].token_epochs() == [0] * 4
            assert engine.staleness.lag_tokens == {1: 4}
            for e in pool.engines:
                e.commit_gate.set()
            assert await engine.weights_loaded() == 1


async def test_admission_waits_for_the_engines_to_serve_the_epoch_an_update_handed_over(cfg):
    """After `update_weights(wait=False)` returned epoch 1, a group that admission lets in for
    epoch 1 must generate with epoch 1: started before the engines load it, its tokens would be
    epoch 0's and lag one more than admission allowed for (max_lag 0 here: every one dropped at
    hand-out, its prompt lost). Measured with max_lag 1: a fifth of each batch was dropped, and the
    learner waited a whole generation for replacements every step."""
    from rollout import Prompt

    cfg = msgspec.structs.replace(cfg, staleness=msgspec.structs.replace(cfg.staleness, max_lag=0, batch_groups=1))
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            engine.feed([Prompt(token_ids=[5, 6, 7], id=f"p{i}", sampling={"max_tokens": 4, "n": 1}) for i in range(2)])
            first = await engine.next_group()
            assert first.trajectories[0].token_epochs() == [0] * 4
            for e in pool.engines:
                e.commit_gate = anyio.Event()
            assert await engine.update_weights(changed(1), wait=False) == 1
            for _ in range(20):  # let admission, and a group it let in, run as far as they can
                await anyio.sleep(0)
            assert sum(len(e.requests) for e in pool.engines) == 1, "a group started before any engine served epoch 1"
            for e in pool.engines:
                e.commit_gate.set()
            second = await engine.next_group()
            assert second.prompt_id == "p1" and second.trajectories[0].token_epochs() == [1] * 4
            assert engine.staleness.dropped_groups == 0
