"""`RolloutGeneration` (NeMo RL's generation interface, `rollout.nemo_rl`) over fake engines: the
batches NeMo RL hands it and a facade over a bounded engine. The config is the `generation_cfg`
fixture (`tests.support.fixtures`)."""

from __future__ import annotations

from contextlib import asynccontextmanager

import anyio
import torch

from rollout.engine import RolloutEngine
from rollout.nemo_rl import RolloutGeneration

TIMEOUT = 5  # seconds; only reached when a test is about to fail
MAX_TOKENS = 5  # `generation_cfg`'s sampling.max_tokens
WEIGHTS = {"embed.weight": torch.zeros(4, 3)}  # the model of `generation_cfg`


def batch(rows: list[list[int]], pad: int = 0, width: int | None = None, **extra) -> dict:
    """NeMo RL's input: `rows` right-padded with `pad` to `width` (the longest row's length)."""
    width = width or max(len(r) for r in rows)
    return {
        "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
        "input_lengths": torch.tensor([len(r) for r in rows]),
        **extra,
    }


@asynccontextmanager
async def wrapped(cfg, pool, **kwargs):
    """`RolloutGeneration` over a `RolloutEngine` on `pool`, bounded by TIMEOUT."""
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            yield RolloutGeneration(engine=engine, **kwargs)
