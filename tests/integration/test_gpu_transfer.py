"""vLLM's own GPU weight-transfer backends through this engine (`gpu` marker; skipped without CUDA):
vLLM's `nccl` (2 engines, one GPU each) and `ipc` (1 engine on this process's GPU) trainer engines,
built by vLLM's trainer factory, drive `engine.weight_sync_client()`; what they load must be what
the object store loads (greedy tokens and logprobs identical), under the epoch the update returned.
Not run here (no GPU on this machine): written to vLLM's documented trainer API, to be run on one.
"""

from __future__ import annotations

import socket

import anyio
import pytest
import torch
from safetensors.torch import load_file

from policies.gloo_transfer import StateDictSource
from rollout import RolloutEngine
from tests.support.engines import integration_config
from tests.support.oracle_runs import greedy, random_weights

pytestmark = pytest.mark.gpu


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
async def test_vllm_gpu_backends_load_what_the_object_store_loads(backend):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    count = 1 if backend == "ipc" else 2
    engines = f"engines.vllm={{gpu_memory_utilization: 0.3, weight_transfer_config: {{backend: {backend}}}}}"
    async with RolloutEngine(
        integration_config(f"engines.count={count}", "engines.gpus_per_engine=1", engines)
    ) as engine:
        base = load_file(f"{engine.model_path}/model.safetensors")
        weights = {k: v.cuda() for k, v in random_weights(base, seed=3).items()}
        client = engine.weight_sync_client()
        if backend == "nccl":
            init = NCCLTrainerInitInfo(
                master_address="127.0.0.1", master_port=free_port(), world_size=1 + client.world_size(), rank=0
            )
        else:
            init = IPCTrainerInitInfo(rank=0)
        source = StateDictSource(weights)
        trainer = await anyio.to_thread.run_sync(
            lambda: WeightTransferTrainerFactory.trainer_init(init, client=client, source=source)
        )
        await anyio.to_thread.run_sync(trainer.send_weights)
        assert engine.epoch == 1
        via_transfer = await greedy(engine)
        assert await engine.update_weights({k: v.cpu() for k, v in weights.items()}) == 2
        assert [(i, lp) for i, lp, _ in await greedy(engine)] == [(i, lp) for i, lp, _ in via_transfer]
        trainer.shutdown()
