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
from rollout import Prompt, RolloutEngine
from rollout.errors import InvalidWeightsError, WeightSyncError

from .conftest import integration_config
from .test_weights import random_weights

PROMPTS = [
    Prompt(token_ids=[5 + i, 17, 80 + 3 * i, 9], id=f"wt{i}", sampling={"temperature": 0.0, "max_tokens": 12, "n": 1})
    for i in range(6)
]


async def greedy(engine) -> list[tuple[list[int], list[float], int]]:
    out = []
    for group in await engine.submit(PROMPTS, train=False).result():
        t = group.trajectories[0]
        assert t.ok, t.error
        out.append((t.token_ids, t.logprobs, t.token_epochs()[0]))
    return out


def trainer(client, weights, **info):
    """vLLM's trainer factory builds ours from its init info (`backend` = "gloo")."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    source = StateDictSource(weights)
    init = GlooTrainerInitInfo(world_size=1 + client.world_size(), rank=0, **info)
    return WeightTransferTrainerFactory.trainer_init(init, client=client, source=source), source


async def send(t, source, weights) -> None:
    source.update(weights)
    await anyio.to_thread.run_sync(t.send_weights)


async def test_vllm_trainer_loads_exactly_what_the_object_store_loads():
    """2 engines; new weights through vLLM's trainer API, then the same through the object store:
    identical greedy tokens and logprobs. Bad input: nothing changes, the error names it."""
    async with RolloutEngine(integration_config("engines.count=2", "weight_sync.timeout_s=60")) as engine:
        base = load_file(f"{engine.model_path}/model.safetensors")
        before = await greedy(engine)
        client = engine.weight_sync_client()
        weights = random_weights(base, seed=7)
        t, source = await anyio.to_thread.run_sync(
            lambda: trainer(client, weights, bucket_bytes=48 << 10, timeout_s=60)
        )
        await send(t, source, weights)
        epoch = engine.epoch
        assert (
            epoch == 1 and engine.weight_updates[-1].failed == [] and [s.epoch for s in await engine.stats()] == [1, 1]
        )
        via_transfer = await greedy(engine)
        assert await engine.update_weights(weights) == 2
        via_store = await greedy(engine)
        assert [(i, lp) for i, lp, _ in via_transfer] == [(i, lp) for i, lp, _ in via_store]  # the same bytes
        assert [e for *_, e in via_transfer] == [1] * len(via_transfer)
        assert [i for i, *_ in via_transfer] != [i for i, *_ in before]

        # bad input: no engine changes, the epoch stays 2, the error names the tensor or the call
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
            WeightSyncError, match="finish_weight_update called without start_weight_update; the epoch stays 2"
        ):
            await anyio.to_thread.run_sync(client.finish_weight_update)
        with pytest.raises(WeightSyncError, match="update_weights called without start_weight_update"):
            await anyio.to_thread.run_sync(client.update_weights, {"names": [], "dtype_names": [], "shapes": []})
        assert engine.epoch == 2 and [s.epoch for s in await engine.stats()] == [2, 2]
        assert [(i, lp) for i, lp, _ in await greedy(engine)] == [
            (i, lp) for i, lp, _ in via_store
        ]  # the old weights, intact

        # a round called off after the engines started vLLM's update (another engine could not):
        # vLLM's finish with nothing loaded puts the old tensors back; the epoch stays
        for e in engine.pool.engines:
            await e.call("start_transfer", 99)
            await e.call("finish_transfer", 99, False)
        assert [s.epoch for s in await engine.stats()] == [2, 2]
        assert [(i, lp) for i, lp, _ in await greedy(engine)] == [(i, lp) for i, lp, _ in via_store]

        # and the transfer still works after all that
        await send(t, source, random_weights(base, seed=8))
        assert engine.epoch == 3 and [s.epoch for s in await engine.stats()] == [3, 3]
        await anyio.to_thread.run_sync(t.shutdown)
