"""The weight plane on real engines: what it loads is exactly what the object store loads, bad input
changes no engine, and per-token epochs under plane updates match the float32 oracle.

The NCCL and CUDA IPC backends need a GPU (`gpu` marker, skipped here): the same rounds with the
engines on GPUs, and one engine on the learner's own GPU for cuda_ipc.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rollout import Prompt, RolloutEngine
from rollout.errors import InvalidWeightsError

from .conftest import integration_config
from .test_weights import random_weights
from .test_weights import test_epochs_match_the_oracle as oracle_test

PROMPTS = [Prompt(token_ids=[5 + i, 17, 80 + 3 * i, 9], id=f"plane{i}", sampling={"temperature": 0.0, "max_tokens": 12, "n": 1}) for i in range(6)]


async def greedy(engine) -> list[tuple[list[int], list[float], int]]:
    out = []
    for group in (await engine.submit(PROMPTS, train=False).result()):
        t = group.trajectories[0]
        assert t.ok, t.error
        out.append((t.token_ids, t.logprobs, t.token_epochs()[0]))
    return out


async def test_the_plane_loads_exactly_what_the_object_store_loads():
    """Engines of its own (the session's stay at epoch 0 for the other tests): for each backend,
    new weights through the plane, then the same weights through the object store: greedy tokens
    and logprobs must be identical; bad input through the plane changes no engine."""
    async with RolloutEngine(integration_config("engines.count=2")) as engine:
        base = load_file(f"{engine.model_path}/model.safetensors")
        before = await greedy(engine)
        for k, backend in enumerate(["gloo", "shm"]):
            weights = random_weights(base, seed=7 + k)
            plane = await engine.weight_plane(backend=backend, bucket_bytes=48 << 10)  # tensors split over buckets
            epoch = await plane.send(weights)
            assert engine.weight_updates[-1].failed == [] and [s.epoch for s in await engine.stats()] == [epoch] * 2
            via_plane = await greedy(engine)
            assert await engine.update_weights(weights) == epoch + 1
            via_store = await greedy(engine)
            assert [(ids, lps) for ids, lps, _ in via_plane] == [(ids, lps) for ids, lps, _ in via_store], backend  # the same bytes
            assert [e for *_, e in via_plane] == [epoch] * len(PROMPTS)
            assert [ids for ids, *_ in via_plane] != [ids for ids, *_ in before]  # and they are new weights

            bad = {**weights, "model.norm.weight": torch.empty_like(weights["model.norm.weight"], device="meta")}
            with pytest.raises(InvalidWeightsError, match="model.norm.weight"):
                await plane.send(bad)
            with pytest.raises(InvalidWeightsError, match="unknown model.extra.weight"):
                await plane.send({**weights, "model.extra.weight": torch.ones(1)})
            assert [s.epoch for s in await engine.stats()] == [epoch + 1] * 2
            await plane.close()


async def test_epochs_match_the_oracle_under_plane_updates():
    """The oracle test of `test_weights` in keep mode, every update through the plane (gloo)."""
    await oracle_test("keep", via_plane=True)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nccl", "cuda_ipc"])
async def test_gpu_backends_load_what_the_object_store_loads(backend):
    """On a GPU machine: engines on GPUs (`configs/gpu.yaml`); for cuda_ipc the engine shares this
    process's GPU. Same check as on CPU: plane and object store load the same bytes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    count = 1 if backend == "cuda_ipc" else 2
    cfg = integration_config(f"engines.count={count}", "engines.gpus_per_engine=1", "engines.vllm={gpu_memory_utilization: 0.3}")
    async with RolloutEngine(cfg) as engine:
        base = load_file(f"{engine.model_path}/model.safetensors")
        weights = {k: v.cuda() for k, v in random_weights(base, seed=3).items()}
        plane = await engine.weight_plane(backend=backend, device=torch.device("cuda", 0))
        epoch = await plane.send(weights)
        via_plane = await greedy(engine)
        assert await engine.update_weights({k: v.cpu() for k, v in weights.items()}) == epoch + 1
        assert [(i, lp) for i, lp, _ in await greedy(engine)] == [(i, lp) for i, lp, _ in via_plane]
