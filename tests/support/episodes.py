"""Multi-turn episodes on fake engines: their config, an environment that answers every turn, and a
run of prompts through the episode loop."""

from __future__ import annotations

import anyio

from rollout.config import Config, load_config
from rollout.engine import RolloutEngine
from rollout.episodes.env import Step
from rollout.types import Prompt
from tests.support.fakes import FakePool

TIMEOUT = 30  # a hang guard; the first episode pays the tokenizer import (seconds on a busy machine)


def episode_cfg(*overrides: str) -> Config:
    """The tiny model (its real tokenizer and chat template), 2 engines, groups of 2 episodes of 5
    tokens a turn, fast health checks and restarts, then `overrides`."""
    return load_config(None, ["model.path=tiny", "sampling.n=2", "sampling.max_tokens=5", "engines.count=2",
                              "model.max_model_len=128", "logging.level=error", "engines.health_interval_s=0.01",
                              "engines.restart_backoff_s=0", *overrides])  # fmt: skip


class Echo:
    """Three turns; each observation is a user message naming the turn; reward 1 per turn."""

    def __init__(self, turns: int = 3):
        self.turns = turns

    async def reset(self, prompt: Prompt):
        return None

    async def step(self, action):
        done = action.turn + 1 >= self.turns
        return Step(None if done else f"turn {action.turn}", 1.0, done)


async def episodes(config, env, prompts, pool=None):
    """Every group of `prompts` run as episodes in `env` on `pool` (2 fake engines by default),
    within TIMEOUT: (groups, engine, pool)."""
    pool = pool or FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(config, pool=pool, env=env) as engine:
            engine.feed(prompts)
            return [g async for g in engine.groups()], engine, pool
