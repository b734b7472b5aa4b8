"""The long-tailed prompt set for `rollout bench` (benchmarks/long_tail_prompts.py)."""

from __future__ import annotations

import pytest

from benchmarks.long_tail_prompts import long_tail, main
from rollout.config import load_config
from rollout.inputs.prompts import ModelLimits, check_prompt, effective_sampling, jsonl_prompts


def test_a_tenth_of_the_prompts_generate_512_tokens_the_rest_32():
    prompts = long_tail(200, seed=3)
    lengths = [effective_sampling(load_config(None).sampling, p).max_tokens for p in prompts]
    assert lengths.count(512) == 20 and lengths.count(32) == 180
    assert all(
        p.sampling["min_tokens"] == p.sampling["max_tokens"] for p in prompts
    )  # an early EOS cannot cut the tail
    assert long_tail(200, seed=3) == prompts and long_tail(200, seed=4) != prompts


async def test_the_file_runs_through_the_prompt_checks(tmp_path):
    out = tmp_path / "p.jsonl"
    assert main(["--count", "20", "--out", str(out)]) == 0
    cfg = load_config(None, ["prompts.source=jsonl", f"prompts.path={out}"])
    limits = ModelLimits(vocab_size=260, max_model_len=2048, max_n=cfg.engines.max_inflight_per_engine)
    prompts = [p async for p in jsonl_prompts(out)]
    for p in prompts:
        check_prompt(p, effective_sampling(cfg.sampling, p), limits)
    assert len(prompts) == 20


def test_a_fraction_outside_0_1_is_refused():
    with pytest.raises(ValueError, match="long_fraction"):
        long_tail(10, long_fraction=1.5)
