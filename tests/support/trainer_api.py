"""vLLM's trainer API over fake engines whose model workers run the real gloo worker engine: the
model's state, a config for it, and a learner (vLLM's trainer factory building our gloo trainer
over `RolloutEngine.weight_sync_client()`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import msgspec
import torch
from safetensors.torch import save_file

from rollout.config import Config, load_config
from rollout.weights.trainer import GlooTrainerInitInfo, StateDictSource

STATE = {
    "embed.weight": torch.randn(40, 30),
    "layers.0.weight": torch.randn(30, 30).to(torch.bfloat16),
    "norm.weight": torch.ones(30, dtype=torch.bfloat16),
}


def changed(k: int) -> dict[str, torch.Tensor]:
    return {n: t + k for n, t in STATE.items()}


def trainer_config(tmp_path: Path, timeout_s: float) -> Config:
    """2 engines of a model with `STATE` as its weights, updates bounded by `timeout_s`."""
    (tmp_path / "config.json").write_text('{"vocab_size": 260}')
    save_file(STATE, str(tmp_path / "model.safetensors"))
    cfg = load_config(None, ["engines.count=2", "logging.level=error", f"weight_sync.timeout_s={timeout_s}",
                             "engines.restart_backoff_s=0"])  # fmt: skip
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=str(tmp_path)))


async def trainer(engine: Any, weights: dict[str, torch.Tensor], timeout_s: float = 20) -> tuple[Any, Any, Any]:
    """A learner's trainer (rank 0, small buckets), its client and its source."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    client, source = engine.weight_sync_client(), StateDictSource(weights)
    init = GlooTrainerInitInfo(world_size=1 + client.world_size(), rank=0, bucket_bytes=1000, timeout_s=timeout_s)
    t = await anyio.to_thread.run_sync(
        lambda: WeightTransferTrainerFactory.trainer_init(init, client=client, source=source)
    )
    return t, client, source
