"""vLLM's RL routes served over fake engines whose model workers run the real gloo worker engine,
and a learner written for vLLM's server (`http_trainer`): what tests/test_rl_routes.py and
tests/test_rl_auth.py drive."""

from __future__ import annotations

import contextlib
from pathlib import Path

import anyio
import httpx
import msgspec
import torch
from safetensors.torch import save_file

from rollout.config import Config, load_config
from rollout.engine import RolloutEngine
from rollout.weights.trainer import GlooTrainerInitInfo, StateDictSource
from tests.support.fakes import FakePool

TIMEOUT = 30  # seconds; only reached when a test is about to fail
STATE = {"embed.weight": torch.randn(40, 30), "norm.weight": torch.ones(30, dtype=torch.bfloat16)}


def rl_cfg(model_dir: Path) -> Config:
    """2 fake engines over a model of STATE's tensors, written to `model_dir`."""
    (model_dir / "config.json").write_text('{"vocab_size": 260}')
    save_file(STATE, str(model_dir / "model.safetensors"))
    cfg = load_config(
        None,
        [
            "engines.count=2",
            "logging.level=error",
            "weight_sync.timeout_s=10",
            "sampling.max_tokens=4",
            "engines.restart_backoff_s=0",
        ],
    )
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=str(model_dir)))


@contextlib.asynccontextmanager
async def served(cfg, api_key: str | None = None, api_servers: int = 1):
    pool = FakePool(2)
    cfg = msgspec.structs.replace(cfg, serve=msgspec.structs.replace(cfg.serve, api_servers=api_servers))
    with anyio.fail_after(TIMEOUT * 2):
        async with RolloutEngine(cfg, pool=pool) as engine:
            server = await engine.serve(port=0, api_key=api_key)
            async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as http:
                yield engine, server, pool, http


def http_trainer(url: str, weights: dict):
    """A learner written for vLLM's server: vLLM's HTTP client, vLLM's trainer factory (gloo)."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    world = httpx.get(f"{url}/get_world_size").json()["world_size"]
    client, source = HTTPVLLMWeightSyncClient(url, timeout=TIMEOUT), StateDictSource(weights)
    init = GlooTrainerInitInfo(world_size=1 + world, rank=0, bucket_bytes=1000, timeout_s=10)
    return WeightTransferTrainerFactory.trainer_init(init, client=client, source=source), source
