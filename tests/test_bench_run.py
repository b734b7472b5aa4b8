"""`rollout bench` (`rollout.bench.run`) on fake engines: the round structure and the figure it reports."""

from __future__ import annotations

import statistics
from collections import Counter
from itertools import groupby
from pathlib import Path

import anyio
import pytest

from rollout.bench.run import format_table, median_interval, run_bench
from rollout.config import load_config
from rollout.errors import InvalidConfigError
from tests.support.bench import bench_config
from tests.support.fakes import FakePool

ROOT = Path(__file__).resolve().parents[1]


async def test_rounds_alternate_which_side_goes_first_and_the_ratio_is_their_median():
    pool = FakePool(2)
    report = await run_bench(
        bench_config("bench.repeats=4", "bench.warmup_prompts=2"), "tiny", progress=False, pool=pool
    )

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
    assert report["ratio_interval"] == {
        "low": ratios[0],
        "high": ratios[-1],
        "coverage": 0.875,
        "width": ratios[-1] - ratios[0],
    }


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


async def test_every_round_runs_the_same_jsonl_prompts():
    """The JSONL reader was made once and used up by round 1, so from round 2 on this
    engine ran nothing (0 tokens/s) and the median ratio was 0."""
    pool = FakePool(2)
    path = ROOT / "configs" / "example_prompts.jsonl"
    cfg = bench_config("prompts.source=jsonl", f"prompts.path={path}", "bench.repeats=2", "bench.warmup_prompts=2")
    report = await run_bench(cfg, "jsonl", progress=False, pool=pool)

    assert [r["engine"] > 0 and r["raw_vllm"] > 0 for r in report["rounds"]] == [True, True]
    assert report["ratio_tokens_per_s"] > 0
    ids = [r.prompt_id for e in pool.engines for r in e.requests if r.request_id.startswith("r")]  # scheduler requests
    runs = Counter(i for i in ids if not i.startswith("syn-"))  # not the warm-up's synthetic prompts
    assert runs == {"greeting": 4, "math": 4, "tokens": 4, "meta": 4}  # 2 rounds x n=2 each
    assert report["engine"]["trajectories"] == 4 * 2  # per run


def test_rounds_default_to_4_and_the_old_repeats_key_still_counts():
    assert bench_config().bench.rounds == 4
    assert bench_config("bench.repeats=6").bench.rounds == 6  # configs written before the rename
    assert (
        bench_config("bench.repeats=6", "bench.rounds=12", "bench.repeats=null").bench.rounds == 12
    )  # what --rounds 12 sends
    with pytest.raises(InvalidConfigError, match="bench.repeats: the old name of rounds"):
        bench_config("bench.repeats=6", "bench.rounds=12")


async def test_the_table_leads_with_the_median_ratio_and_pools_latency_over_rounds():
    report = await run_bench(
        bench_config("bench.rounds=4", "bench.warmup_prompts=2"), "tiny", progress=False, pool=FakePool(2)
    )
    lines = format_table(report).splitlines()
    median, ci = report["ratio_tokens_per_s"], report["ratio_interval"]
    assert lines[1].startswith(f"this engine / raw vLLM, generated tokens/s: {median:.3f}, median of 4 rounds")
    assert lines[2].strip().startswith(f"87.5% interval {ci['low']:.3f}-{ci['high']:.3f}, width {ci['width']:.3f}")
    rows = [line.split() for line in lines if line.split() and line.split()[0] in "1234"]
    assert [r[0] for r in rows] == ["1", "2", "3", "4"] and [float(r[-2]) for r in rows] == [
        round(r["ratio"], 3) for r in report["rounds"]
    ]
    assert [r[-1] for r in rows] == [f"{r['engine_batch']:.1f}/{r['raw_vllm_batch']:.1f}" for r in report["rounds"]]
    assert (
        lines.index(next(line for line in lines if line.lstrip().startswith("1 "))) > 2
    )  # rounds come after the median
    assert len(report["engine"]["samples"]["latency_s"]) == 4 * 12  # every trajectory of every round, not round 1's
    assert report["engine"]["runs"] == report["raw_vllm"]["runs"] == report["rounds_used"] == 4


async def test_speculative_figures_are_summed_over_every_run_of_each_side():
    pool = FakePool(2)
    for e in pool.engines:
        e.spec.num_speculative_tokens = 3
        e.spec_per_request = (1, 3, 2, [1, 1, 0])  # per finished request: 1 draft of 3 tokens, 2 accepted
    cfg = bench_config(
        "bench.rounds=2", "bench.warmup_prompts=2", "speculative.method=ngram", "speculative.num_speculative_tokens=3"
    )
    report = await run_bench(cfg, "tiny", progress=False, pool=pool)
    for side in ("engine", "raw_vllm"):
        total = report[side]["spec_decode"]["total"]
        assert (total["drafts"], total["accepted_tokens"]) == (
            2 * 12,
            2 * 12 * 2,
        )  # rounds x trajectories: not warm-up, not the other side
        assert total["acceptance_rate"] == 2 / 3 and total["accepted_per_pos"] == [24, 24, 0]
    assert "speculative decoding: ngram, 3 draft tokens per step" in format_table(report)


async def test_multiturn_bench_plays_the_same_episodes_against_a_careful_raw_vllm_loop():
    """The raw vLLM side keeps each conversation on one engine (prefix caching keeps its
    history) and sends each engine's turns in one call, as a careful user would: a call per turn
    into a busy engine actor would measure its own round trips."""
    from rollout.bench.multiturn import format_table as multiturn_table

    pool = FakePool(2)
    calls: list[tuple[int, list[str]]] = []
    for e in pool.engines:

        def recording(requests, outputs=False, e=e, run=e.run_raw):
            calls.append((e.engine_id, [r.request_id for r in requests]))
            return run(requests, outputs)

        e.run_raw = recording
    cfg = load_config("configs/multiturn.yaml", ["prompts.count=4", "bench.rounds=2", "logging.level=error"])
    with anyio.fail_after(30):
        report = await run_bench(cfg, "multiturn", progress=False, pool=pool)
    m = report["multiturn"]
    assert len(m["rounds"]) == 2 and m["episodes"] == 4
    for row in m["rounds"]:
        assert {s: row[s]["generated_tokens"] for s in row} == {s: 4 * 4 * 64 for s in ("engine", "raw")}
        assert all(row[s]["failed"] == 0 for s in row)
    # warm-up and 2 rounds, 4 turns each, on each of 2 engines: one call per engine per turn,
    # carrying that turn of every episode on the engine (episodes 0 and 2 on engine 0, 1 and 3 on 1)
    assert len(calls) == 3 * 4 * 2
    for engine, ids in calls:
        assert sorted(i.split(".")[0] for i in ids) == [f"raw{k}" for k in (engine, engine + 2)]
        assert len({i.split(".")[1] for i in ids}) == 1  # the same turn of each
    assert "this engine / raw vLLM" in multiturn_table(m)
    assert all(
        0 <= row["engine"]["kv_reused_fraction"] <= 1 for row in m["rounds"]
    ) and "reused the KV" in multiturn_table(m)


async def test_both_sides_report_their_mean_running_batch():
    """The running batch sampled over each run, per side, so a gap in the ratio shows
    whether an engine's batch ran empty. Fake engines run every request in flight at once."""
    report = await run_bench(
        bench_config("bench.rounds=2", "bench.warmup_prompts=2"), "tiny", progress=False, pool=FakePool(2)
    )
    for side in ("engine", "raw_vllm"):
        runs = report[side]["per_run"]
        assert all(r["mean_running"] > 0 and r["mean_waiting"] == 0 for r in runs)
        assert report[side]["mean_running"] == statistics.median(r["mean_running"] for r in runs)
    assert [r["engine_batch"] for r in report["rounds"]] == [r["mean_running"] for r in report["engine"]["per_run"]]
    table = format_table(report)
    assert "mean running batch per engine" in table and "mean waiting in vLLM per engine" in table
