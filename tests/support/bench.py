"""`rollout bench` on fake engines: its config, the repository's configs/tiny.yaml with a small load."""

from __future__ import annotations

from pathlib import Path

from rollout.config import Config, load_config

ROOT = Path(__file__).resolve().parents[2]


def bench_config(*overrides: str) -> Config:
    """configs/tiny.yaml with 6 prompts, groups of 2 samples of 4 tokens, 8 requests per engine,
    warnings logged, then `overrides`."""
    return load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            "prompts.count=6",
            "sampling.n=2",
            "sampling.max_tokens=4",
            "engines.max_inflight_per_engine=8",
            "logging.level=warning",
            *overrides,
        ],
    )
