"""vLLM's trainer API against real engines: its `TrainerWeightTransferEngine` (our gloo one, built
by vLLM's own `WeightTransferTrainerFactory`) drives `RolloutEngine.weight_sync_client()` exactly as
it would drive vLLM. What it loads is what the object store loads; bad input changes no engine and
names the tensor, engine or call. (Per-token epochs under it match the float32 oracle in every
`weight_sync.mode`: test_weights.py's oracle test sends updates through it.)
"""

from __future__ import annotations

import anyio
import pytest
import torch
from safetensors.torch import load_file

from policies.gloo_transfer import GlooTrainerInitInfo, StateDictSource
from rollout.errors import InvalidWeightsError, WeightSyncError
from tests.support.oracle_runs import greedy, random_weights


def trainer(client, weights, **info):
    """vLLM's trainer factory builds ours from its init info (`backend` = "gloo")."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    source = StateDictSource(weights)
    init = GlooTrainerInitInfo(world_size=1 + client.world_size(), rank=0, **info)
    return WeightTransferTrainerFactory.trainer_init(init, client=client, source=source), source


async def send(t, source, weights) -> None:
    source.update(weights)
    await anyio.to_thread.run_sync(t.send_weights)


async def test_vllm_trainer_loads_exactly_what_the_object_store_loads(engine):
    """2 engines; new weights through vLLM's trainer API, then the same through the object store:
    identical greedy tokens and logprobs. Bad input: nothing changes, the error names it."""
    start = engine.epoch  # the shared engines' epoch: this test's updates are start + 1, + 2, + 3
    base = load_file(f"{engine.model_path}/model.safetensors")
    before = await greedy(engine)
    client = engine.weight_sync_client()
    weights = random_weights(base, seed=7)
    t, source = await anyio.to_thread.run_sync(lambda: trainer(client, weights, bucket_bytes=48 << 10, timeout_s=60))
    await send(t, source, weights)
    epoch = engine.epoch
    assert (
        epoch == start + 1
        and engine.weight_updates[-1].failed == []
        and [s.epoch for s in await engine.stats()] == [start + 1] * 2
    )
    via_transfer = await greedy(engine)
    assert await engine.update_weights(weights) == start + 2
    via_store = await greedy(engine)
    assert [(i, lp) for i, lp, _ in via_transfer] == [(i, lp) for i, lp, _ in via_store]  # the same bytes
    assert [e for *_, e in via_transfer] == [start + 1] * len(via_transfer)
    assert [i for i, *_ in via_transfer] != [i for i, *_ in before]

    # bad input: no engine changes, the epoch stays start + 2, the error names the tensor or the call
    name = "model.norm.weight"
    for bad, match in [
        ({**weights, name: torch.ones(3)}, rf"{name}: float32 \[3\], model has float32"),
        ({**weights, name: weights[name].to(torch.bfloat16)}, rf"{name}: bfloat16"),
        ({**weights, "model.extra.weight": torch.ones(1)}, "unknown model.extra.weight"),
    ]:
        with pytest.raises(InvalidWeightsError, match=match):
            await send(t, source, bad)
    renamed = StateDictSource(weights, name_map=lambda n: n.replace("model.norm", "net.norm"))
    t.source = renamed
    with pytest.raises(InvalidWeightsError, match="unknown net.norm.weight"):
        await anyio.to_thread.run_sync(t.send_weights)
    t.source = source
    with pytest.raises(
        WeightSyncError,
        match=f"finish_weight_update called without start_weight_update; the epoch stays {start + 2}",
    ):
        await anyio.to_thread.run_sync(client.finish_weight_update)
    with pytest.raises(WeightSyncError, match="update_weights called without start_weight_update"):
        await anyio.to_thread.run_sync(client.update_weights, {"names": [], "dtype_names": [], "shapes": []})
    assert engine.epoch == start + 2 and [s.epoch for s in await engine.stats()] == [start + 2] * 2
    assert [(i, lp) for i, lp, _ in await greedy(engine)] == [
        (i, lp) for i, lp, _ in via_store
    ]  # the old weights, intact

    # a round called off after the engines started vLLM's update (another engine could not):
    # vLLM's finish with nothing loaded puts the old tensors back; the epoch stays
    for e in engine.pool.engines:
        await e.call("start_transfer", start + 99)
        await e.call("finish_transfer", start + 99, False)
    assert [s.epoch for s in await engine.stats()] == [start + 2] * 2
    assert [(i, lp) for i, lp, _ in await greedy(engine)] == [(i, lp) for i, lp, _ in via_store]

    # and the transfer still works after all that
    await send(t, source, random_weights(base, seed=8))
    assert engine.epoch == start + 3 and [s.epoch for s in await engine.stats()] == [start + 3] * 2
    await anyio.to_thread.run_sync(t.shutdown)
