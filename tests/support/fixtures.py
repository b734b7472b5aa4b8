"""Pytest fixtures shared by the unit test files. They are registered for the tier by
`pytest_plugins` in tests/conftest.py: a test module asks for them by name and never imports them.

- `model_dir`: a model directory for fake engines (`tests.support.model`).
- `make_cfg`: `make_cfg(*overrides)` builds a config over `model_dir`; a test file whose config
  differs says how in a fixture of its own, built on this one.
- `generation_cfg`: the config `RolloutGeneration` (NeMo RL's interface) is tested with.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from rollout.config import Config, load_config
from tests.support.generation import MAX_TOKENS, WEIGHTS
from tests.support.model import write_model

# 2 engines, groups of 2 samples of 6 tokens each, prompts and outputs within 64 tokens, errors only
BASE = ("sampling.n=2", "sampling.max_tokens=6", "engines.count=2", "model.max_model_len=64", "logging.level=error")


def _over(cfg: Config, model: Path) -> Config:
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=str(model)))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """`tmp_path / "model"`: the tiny model's vocabulary and `tests.support.model.STATE`'s weights."""
    return write_model(tmp_path / "model")


@pytest.fixture
def make_cfg(model_dir: Path) -> Callable[..., Config]:
    """`make_cfg(*overrides)`: `BASE` over `model_dir`, then `overrides` (`a.b=value`, later wins)."""

    def make(*overrides: str) -> Config:
        return _over(load_config(None, [*BASE, *overrides]), model_dir)

    return make


@pytest.fixture
def generation_cfg(tmp_path: Path) -> Config:
    """For `RolloutGeneration` over fake engines: a model with pad id 0 and `WEIGHTS`; 4 samples a
    prompt (the facade must make it one a row), MAX_TOKENS tokens, a configured stop string."""
    model = write_model(tmp_path, WEIGHTS, pad_token_id=0)
    cfg = load_config(
        None,
        [
            "sampling.n=4",  # the facade must override it: one sample per row
            f"sampling.max_tokens={MAX_TOKENS}",
            "sampling.stop=['cfg']",
            "engines.count=2",
            "engines.max_inflight_per_engine=4",
            "model.max_model_len=64",
            "queue.max_groups=4",
            "logging.level=error",
        ],
    )
    return _over(cfg, model)
