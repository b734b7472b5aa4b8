"""A model directory for engines that never load it (fake engines, the fake vLLM): the tiny model's
vocabulary in `config.json`, and weights for `update_weights` to check a state dict against."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

STATE = {
    "embed.weight": torch.arange(12, dtype=torch.float32).reshape(4, 3),
    "norm.weight": torch.ones(3, dtype=torch.bfloat16),
}


def write_model(directory: Path, state: dict[str, torch.Tensor] | None = STATE, **config: Any) -> Path:
    """`directory` (made if missing) holding `config.json` (vocabulary 260, then `config`'s fields)
    and, unless `state` is None, `model.safetensors` with `state`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"vocab_size": 260, **config}))
    if state is not None:
        save_file(state, str(directory / "model.safetensors"))
    return directory
