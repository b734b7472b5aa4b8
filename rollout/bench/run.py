"""`rollout bench`: throughput and latency of this engine against raw vLLM, in one run.

How it measures: start the engines once; warm them up (every engine filled to
`max_inflight_per_engine` once, unless `bench.warmup_prompts` says otherwise); then
`bench.rounds` rounds, each of which runs the configured prompts through the scheduler and,
on the same engines with prefix caches reset, the same prompts and sampling straight into each
engine's AsyncLLM (groups dealt round-robin over the engines, all submitted at once, in vLLM's
own non-streaming mode: no scheduler, no Ray call per group, no epochs, no progress reports).
Every round runs the same prompts (a JSONL source is read once, before the first).
Rounds alternate which side goes first, since whichever runs second in a round runs a little
slower on this machine; keep `rounds` even. The median of the per-round ratios (this engine /
raw vLLM) of generated tokens per second is the figure that matters on a shared machine;
absolute numbers are noise. Its interval (`median_interval`, assuming nothing about the noise)
says how far that median can be trusted; more rounds narrow it. Rates are medians over rounds;
latency, time to first token and engine shares are over every trajectory of every round.
Both sides also report the mean running batch per engine (`Engine.batch`: requests inside
vLLM up to its `max_num_seqs`, time-weighted over the run, idle time counting zero) and the
mean waiting in vLLM's queue, so a gap in the ratio shows whether the batch ran empty.

With `speculative:` on, the scheduler runs and the raw-vLLM runs also report speculative
decoding figures, each side's counts summed over its runs (`rollout.metrics.specdecode`): per engine
and summed over engines, in the table and under "spec_decode" in the JSON report.
The table is `rollout.bench.table`'s; `--plot` is `rollout.bench.plots`'.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import anyio
import msgspec

from rollout.bench.progress import Progress
from rollout.bench.table import format_table
from rollout.config import Config, dump_config
from rollout.driver_process import freeze_heap
from rollout.engine import RolloutEngine
from rollout.errors import InvalidPromptError
from rollout.inputs.prompts import BadPrompt, configured_prompts, effective_sampling
from rollout.metrics.specdecode import SpecDecodeMeter, SpecDecodeReport, window
from rollout.scheduling.protocols import EnginePool
from rollout.types import Group, Prompt, Request, SpecCounters, Trajectory

__all__ = ["format_table", "median_interval", "percentiles", "pooled", "run_bench", "summarize"]


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    if not values:
        return {f"p{q}": float("nan") for q in qs}
    if len(values) == 1:
        return {f"p{q}": values[0] for q in qs}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {f"p{q}": cuts[q - 1] for q in qs}


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free interval for the median of `values`: (low, high, its coverage).

    The k-th smallest and k-th largest values, with k the largest rank at which the chance that
    fewer than k values fall below the true median is at most (1 - level) / 2 (sign test).
    Coverage is at least `level` where `values` allow; with few values it is (min, max).
    """
    xs, n = sorted(values), len(values)

    def below(k: int) -> float:  # P(fewer than k of n values fall below the median)
        return sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k < (n + 1) // 2 and below(k + 1) <= (1 - level) / 2:
        k += 1
    return xs[k - 1], xs[n - k], 1 - 2 * below(k)


def summarize(trajectories: list[Trajectory], elapsed: float, engine_count: int) -> dict[str, Any]:
    """One scheduler run: totals and rates, and each trajectory's latency and time to first token."""
    ok = [t for t in trajectories if t.ok]
    tokens = sum(len(t.token_ids) for t in ok)
    per_engine = [sum(len(t.token_ids) for t in ok if t.engine_id == i) for i in range(engine_count)]
    return {
        "elapsed_s": elapsed,
        "trajectories": len(trajectories),
        "failed": len(trajectories) - len(ok),
        "generated_tokens": tokens,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "trajectories_per_s": len(ok) / elapsed if elapsed > 0 else 0.0,
        "latencies_s": [t.finished_at - t.queued_at for t in ok],
        "ttfts_s": [t.first_token_at - t.queued_at for t in ok if t.first_token_at],
        "engine_tokens": per_engine,
    }


async def run_bench(
    cfg: Config,
    config_name: str = "",
    progress: bool | Progress = True,
    pool: EnginePool | None = None,
    freeze_gc: bool = False,
) -> dict[str, Any]:
    """Run the benchmark described in the module docstring; returns the JSON report.

    `progress`: show it on stderr (a `Progress` to say where and how); `pool` replaces the
    Ray/vLLM engines (tests pass a fake); `freeze_gc`: this process is the `rollout bench`
    driver, its heap leaves the collector's view once the engines are warm
    (`rollout.driver_process.freeze_heap`)."""
    trajectories: list[Trajectory] = []
    rounds = cfg.bench.rounds if cfg.bench.baseline else 1
    bar = progress if isinstance(progress, Progress) else Progress("bench", enabled=progress)

    def on_trajectory(t: Trajectory) -> None:
        trajectories.append(t)
        bar.update(1)

    if cfg.env is not None:  # episodes: against a careful agent loop on raw vLLM (rollout.bench.multiturn)
        from rollout.bench import multiturn as bench_multiturn

        async with RolloutEngine(cfg, pool=pool) as engine:
            if freeze_gc:
                freeze_heap()
            report = await bench_multiturn.run(engine, cfg, rounds)
        return {"config": config_name, "multiturn": report, "resolved_config": msgspec.to_builtins(cfg)}
    async with RolloutEngine(cfg, pool=pool, on_trajectory=on_trajectory) as engine:
        prompts = await _read_prompts(cfg, engine.limits.vocab_size)  # read once: every round runs these
        await _warm_up(engine, cfg, bar)
        if freeze_gc:
            freeze_heap()
        meter = SpecDecodeMeter(engine) if cfg.speculative.enabled else None
        sides = ["engine", "raw_vllm"] if cfg.bench.baseline else ["engine"]
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
        spec: dict[str, dict[int, SpecCounters]] = {side: {} for side in sides}
        same: list[Prompt] = []  # the prompts whose groups did not fail, for raw vLLM
        table = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_tick, bar)
            for r in range(rounds):
                row: dict[str, Any] = {"round": r + 1, "order": "engine first" if r % 2 == 0 else "raw vLLM first"}
                for side in sides if r % 2 == 0 else sides[::-1]:
                    await _reset_prefix_caches(engine)
                    if meter:
                        await meter.read()  # the window starts here: warm-up and the other side are not counted
                    batch_at = await _batch(engine)
                    if side == "engine":
                        bar.start(f"round {r + 1}/{rounds}, engine side", _trajectory_count(cfg, prompts))
                        trajectories.clear()
                        start = time.time()
                        engine.feed(iter(prompts))  # an iterator: a bad JSONL line fails its group, the rest run
                        groups: list[Group] = [g async for g in engine.groups()]
                        result = summarize(trajectories, time.time() - start, cfg.engines.count)
                        result["failed_groups"] = sum(1 for g in groups if g.error)
                        same = same or [g.prompt for g in groups if not g.error]
                    else:
                        bar.start(f"round {r + 1}/{rounds}, raw vLLM side")
                        result = await _raw_baseline(engine, cfg, same)
                    result.update(_mean_batch(batch_at, await _batch(engine)))
                    if meter:
                        _add_spec(spec[side], await meter.read())
                    runs[side].append(result)
                    row[side] = result["tokens_per_s"]
                    row[f"{side}_batch"] = result["mean_running"]
                if cfg.bench.baseline:
                    row["ratio"] = row["engine"] / max(row["raw_vllm"], 1e-9)
                    table.append(row)
            tg.cancel_scope.cancel()
        bar.close()
        report: dict[str, Any] = {"config": config_name, "prompts": len(prompts), "rounds_used": rounds}
        for side in sides:
            report[side] = pooled(runs[side])
            if meter:
                report[side]["spec_decode"] = msgspec.to_builtins(window([], list(spec[side].values())))
        if table:
            report["rounds"] = table
            ratios = [r["ratio"] for r in table]
            report["ratio_tokens_per_s"] = statistics.median(ratios)
            low, high, coverage = median_interval(ratios)
            report["ratio_interval"] = {"low": low, "high": high, "coverage": coverage, "width": high - low}
        report["engine_stats"] = [msgspec.to_builtins(s) for s in await engine.stats()]
    report["resolved_config"] = msgspec.to_builtins(cfg)
    report["resolved_config_yaml"] = dump_config(cfg)
    return report


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's figures over every round: medians of the per-run rates, and latency, time to
    first token and engine shares over every trajectory of every run (not round 1's alone)."""
    out: dict[str, Any] = {
        "runs": len(runs),
        "trajectories": runs[0]["trajectories"],  # per run: every run has the same prompts
        "failed": sum(r.get("failed", 0) for r in runs),
        "failed_groups": sum(r.get("failed_groups", 0) for r in runs),
        "generated_tokens": statistics.median(r["generated_tokens"] for r in runs),
        "elapsed_s": statistics.median(r["elapsed_s"] for r in runs),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "trajectories_per_s": statistics.median(r["trajectories_per_s"] for r in runs),
        "mean_running": statistics.median(r["mean_running"] for r in runs),
        "mean_waiting": statistics.median(r["mean_waiting"] for r in runs),
        "per_run": [{k: r[k] for k in ("elapsed_s", "generated_tokens", "tokens_per_s", "trajectories_per_s",
                                       "mean_running", "mean_waiting")} for r in runs],
    }  # fmt: skip
    if "latencies_s" in runs[0]:
        latencies = [x for r in runs for x in r["latencies_s"]]
        ttfts = [x for r in runs for x in r["ttfts_s"]]
        tokens = [sum(n) for n in zip(*(r["engine_tokens"] for r in runs))]
        out["latency_s"], out["ttft_s"] = percentiles(latencies), percentiles(ttfts)
        out["engine_share"] = [n / sum(tokens) if sum(tokens) else 0.0 for n in tokens]
        # the distributions themselves, for plots (`rollout bench --plot`), to the millisecond
        out["samples"] = {"latency_s": [round(x, 3) for x in latencies], "ttft_s": [round(x, 3) for x in ttfts]}
    return out


async def _read_prompts(cfg: Config, vocab_size: int) -> list[Prompt | BadPrompt]:
    """The configured prompts as a list: a JSONL source is read to the end once, here."""
    source = configured_prompts(cfg.prompts, vocab_size)
    if isinstance(source, list):
        return list(source)
    return [p async for p in source]


def _trajectory_count(cfg: Config, prompts: list[Prompt | BadPrompt]) -> int:
    """Trajectories one scheduler run of `prompts` gives (a prompt that will fail gives none)."""
    total = 0
    for p in prompts:
        if isinstance(p, Prompt):
            try:
                total += effective_sampling(cfg.sampling, p).n
            except InvalidPromptError:
                pass
    return total


def _add_spec(acc: dict[int, SpecCounters], report: SpecDecodeReport) -> None:
    """Add one run's per-engine speculative decoding counts to `acc` (pooled over rounds)."""
    for m in report.engines:
        assert m.engine_id is not None
        c = acc.setdefault(
            m.engine_id, SpecCounters(engine_id=m.engine_id, num_speculative_tokens=report.num_speculative_tokens)
        )
        c.add(m.drafts, m.draft_tokens, m.accepted_tokens, m.accepted_per_pos)


async def _tick(bar: Progress) -> None:
    """Progress goes on while nothing is counted (the raw vLLM side reports nothing until it ends)."""
    while True:
        await anyio.sleep(1.0)
        bar.poll()


async def _warm_up(engine: RolloutEngine, cfg: Config, bar: Progress) -> None:
    """Every engine at full concurrency once, so that no new batch shape compiles mid-run."""
    count = cfg.bench.warmup_prompts
    if count is None:
        count = -(-cfg.engines.count * cfg.engines.max_inflight_per_engine // cfg.sampling.n)
    if count:
        bar.start("warm-up", count * cfg.sampling.n)
        warm = msgspec.structs.replace(cfg.prompts, source="synthetic", count=count, seed=cfg.prompts.seed + 1)
        engine.feed(configured_prompts(warm, engine.limits.vocab_size))
        async for _ in engine.groups():
            pass


async def _batch(engine: RolloutEngine) -> list[tuple[float, float, float]]:
    """Each engine's running-batch reading (`Engine.batch`) now."""
    assert engine.pool is not None
    return [await e.batch() for e in engine.pool.engines]


def _mean_batch(before: list[tuple[float, float, float]], after: list[tuple[float, float, float]]) -> dict[str, float]:
    """The mean running batch per engine over a run, and the mean waiting in the engine's queue:
    each engine's request-seconds over its clock's seconds between two readings, averaged over
    engines. Time-weighted, so an engine idle between waves counts zero while it idles."""
    running = [(a[0] - b[0]) / max(a[2] - b[2], 1e-9) for b, a in zip(before, after)]
    waiting = [(a[1] - b[1]) / max(a[2] - b[2], 1e-9) for b, a in zip(before, after)]
    return {"mean_running": statistics.fmean(running), "mean_waiting": statistics.fmean(waiting)}


async def _reset_prefix_caches(engine: RolloutEngine) -> None:
    assert engine.pool is not None
    for e in engine.pool.engines:
        await e.reset_prefix_cache()


async def _raw_baseline(engine: RolloutEngine, cfg: Config, prompts: list[Prompt]) -> dict[str, Any]:
    """The same prompts and sampling, dealt round-robin by group, straight into each AsyncLLM at once."""
    import anyio

    assert engine.pool is not None
    engines = engine.pool.engines
    per_engine: list[list[Request]] = [[] for _ in engines]
    for i, prompt in enumerate(prompts):
        sampling = effective_sampling(cfg.sampling, prompt)
        per_engine[i % len(engines)].extend(
            Request(f"{prompt.id}-{k}", prompt.id, k, sampling, token_ids=prompt.token_ids, text=prompt.text)
            for k in range(sampling.n)
        )
    results: list[dict[str, Any]] = [{} for _ in engines]

    async def run(i: int) -> None:
        results[i] = await engines[i].run_raw(per_engine[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(engines)):
            if per_engine[i]:
                tg.start_soon(run, i)
    done = [r for r in results if r]
    elapsed = max(r["end"] for r in done) - min(r["start"] for r in done)
    tokens = sum(r["tokens"] for r in done)
    return {
        "elapsed_s": elapsed,
        "trajectories": sum(r["trajectories"] for r in done),
        "generated_tokens": tokens,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "trajectories_per_s": sum(r["trajectories"] for r in done) / elapsed if elapsed > 0 else 0.0,
    }
