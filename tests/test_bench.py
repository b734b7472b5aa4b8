"""`rollout bench` on fake engines: the round structure and the figure it reports."""

from __future__ import annotations

import statistics
from itertools import groupby
from pathlib import Path

from rollout.bench import format_table, median_interval, run_bench
from rollout.config import load_config

from .fakes import FakePool

ROOT = Path(__file__).resolve().parents[1]


def bench_config(*overrides: str):
    return load_config(
        ROOT / "configs" / "tiny.yaml",
        ["prompts.count=6", "sampling.n=2", "sampling.max_tokens=4", "engines.max_inflight_per_engine=8", "logging.level=warning",
         *overrides],
    )  # fmt: skip


async def test_rounds_alternate_which_side_goes_first_and_the_ratio_is_their_median():
    pool = FakePool(2)
    report = await run_bench(bench_config("bench.repeats=4", "bench.warmup_prompts=2"), "tiny", progress=False, pool=pool)

    assert [r["order"] for r in report["rounds"]] == ["engine first", "raw vLLM first"] * 2
    assert report["ratio_tokens_per_s"] == statistics.median(r["ratio"] for r in report["rounds"])
    for engine in pool.engines:
        # Scheduler requests are named r<seq>-<k>, raw ones <prompt id>-<k>: the runs on each engine,
        # warm-up first, follow the alternating order (a raw-first round joins the raw run before it).
        kinds = [k for k, _ in groupby("scheduler" if r.request_id.startswith("r") else "raw" for r in engine.requests)]
        assert kinds == ["scheduler", "raw", "scheduler", "raw", "scheduler"]
        assert sum(not r.request_id.startswith("r") for r in engine.requests) == 4 * 3 * 2  # rounds x prompts x n
        assert engine.prefix_cache_resets == 8  # before every timed run
    assert report["engine"]["trajectories"] == report["raw_vllm"]["trajectories"] == 12
    ratios = sorted(r["ratio"] for r in report["rounds"])
    assert report["ratio_interval"] == {"low": ratios[0], "high": ratios[-1], "coverage": 0.875}  # 4 rounds: min, max
    assert "tokens/s ratio, median" in format_table(report)


def test_median_interval_is_the_sign_test_interval():
    # 12 values: P(Binomial(12, 1/2) <= 2) = 79/4096 <= 2.5% < P(<= 3): the 3rd smallest to the 3rd largest.
    low, high, coverage = median_interval([float(x) for x in (5, 1, 12, 3, 9, 7, 2, 11, 4, 10, 8, 6)])
    assert (low, high) == (3.0, 10.0) and coverage == 1 - 2 * 79 / 4096
    assert median_interval([0.9, 1.1, 1.0, 0.95, 1.05, 0.97]) == (0.9, 1.1, 1 - 2 / 64)  # 6 values: min to max
    assert median_interval([1.0]) == (1.0, 1.0, 0.0)  # one round says nothing about the spread


async def test_warm_up_fills_every_engine_once_by_default():
    pool = FakePool(2)
    await run_bench(bench_config("bench.repeats=2"), progress=False, pool=pool)
    scheduled = sum(r.request_id.startswith("r") for e in pool.engines for r in e.requests)
    assert scheduled // 2 - 2 * 6 == 2 * 8 // 2  # warm-up prompts: engines x max_inflight / n


async def test_without_baseline_one_run_and_no_ratio():
    pool = FakePool(2)
    report = await run_bench(bench_config("bench.baseline=false", "bench.warmup_prompts=0"), progress=False, pool=pool)
    assert "ratio_tokens_per_s" not in report and "raw_vllm" not in report
    assert report["engine"]["trajectories"] == 12
    assert all(r.request_id.startswith("r") for e in pool.engines for r in e.requests)
