"""`rollout bench`: throughput and latency of this engine against raw vLLM, in one run.

How it measures: start the engines once; warm them up (every engine filled to
`max_inflight_per_engine` once, unless `bench.warmup_prompts` says otherwise); then
`bench.repeats` rounds, each of which runs the configured prompts through the scheduler and,
on the same engines with prefix caches reset, the same prompts and sampling straight into each
engine's AsyncLLM (groups dealt round-robin over the engines, all submitted at once, in vLLM's
own non-streaming mode: no scheduler, no Ray call per group, no epochs, no progress reports).
Rounds alternate which side goes first, since whichever runs second in a round runs a little
slower on this machine; keep `repeats` even. The median of the per-round ratios (this engine /
raw vLLM) of generated tokens per second is the figure that matters on a shared machine;
absolute numbers are noise. Its interval (`median_interval`, assuming nothing about the noise)
says how far that median can be trusted. Latency, time to first token and engine shares are round 1's.

With `speculative:` on, the first scheduler run and the first raw-vLLM run also report
speculative decoding figures over exactly that run (`rollout.specdecode`): per engine and
summed over engines, in the table and under "spec_decode" in the JSON report.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from typing import Any

import msgspec

from rollout.backend import EnginePool
from rollout.config import Config, dump_config
from rollout.engine import RolloutEngine, freeze_heap
from rollout.prompts import configured_prompts, effective_sampling
from rollout.specdecode import SpecDecodeMeter
from rollout.types import Group, Prompt, Request, Trajectory


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
        "latency_s": percentiles([t.finished_at - t.queued_at for t in ok]),
        "ttft_s": percentiles([t.first_token_at - t.queued_at for t in ok if t.first_token_at]),
        "engine_share": [n / tokens if tokens else 0.0 for n in per_engine],
    }


async def run_bench(
    cfg: Config, config_name: str = "", progress: bool = True, pool: EnginePool | None = None, freeze_gc: bool = False
) -> dict[str, Any]:
    """Run the benchmark described in the module docstring; returns the JSON report.

    `pool` replaces the Ray/vLLM engines (tests pass a fake); `freeze_gc`: this process is the
    `rollout bench` driver, its heap leaves the collector's view once the engines are warm
    (`rollout.engine.freeze_heap`)."""
    trajectories: list[Trajectory] = []
    rounds = cfg.bench.repeats if cfg.bench.baseline else 1
    bar = None

    def on_trajectory(t: Trajectory) -> None:
        trajectories.append(t)
        if bar is not None:
            bar.update(1)

    async with RolloutEngine(cfg, pool=pool, on_trajectory=on_trajectory) as engine:
        prompts = configured_prompts(cfg.prompts, engine.limits.vocab_size)
        await _warm_up(engine, cfg)
        if freeze_gc:
            freeze_heap()
        bar = _progress_bar(cfg, progress, rounds)
        meter = SpecDecodeMeter(engine) if cfg.speculative.enabled else None
        report: dict[str, Any] = {"config": config_name}
        same: list[Prompt] = []  # the prompts whose groups did not fail, for raw vLLM
        table = []
        sides = ["engine", "raw_vllm"] if cfg.bench.baseline else ["engine"]
        for r in range(rounds):
            row: dict[str, Any] = {"order": "engine first" if r % 2 == 0 else "raw vLLM first"}
            for side in sides if r % 2 == 0 else sides[::-1]:
                await _reset_prefix_caches(engine)
                if meter and r == 0:
                    await meter.read()  # the window starts here: warm-up drafts are not counted
                if side == "engine":
                    trajectories.clear()
                    start = time.time()
                    engine.feed(prompts)
                    groups: list[Group] = [g async for g in engine.groups()]
                    result = summarize(trajectories, time.time() - start, cfg.engines.count)
                    result["failed_groups"] = sum(1 for g in groups if g.error)
                    same = same or [g.prompt for g in groups if not g.error]
                else:
                    result = await _raw_baseline(engine, cfg, same)
                if meter and r == 0:
                    result["spec_decode"] = msgspec.to_builtins(await meter.read())
                report.setdefault(side, result)  # the first run of each side has the details
                row[side] = result["tokens_per_s"]
            if cfg.bench.baseline:
                row["ratio"] = row["engine"] / max(row["raw_vllm"], 1e-9)
                table.append(row)
        bar.close()
        if table:
            report["rounds"] = table
            ratios = [r["ratio"] for r in table]
            report["ratio_tokens_per_s"] = statistics.median(ratios)
            low, high, coverage = median_interval(ratios)
            report["ratio_interval"] = {"low": low, "high": high, "coverage": coverage}
        report["engine_stats"] = [msgspec.to_builtins(s) for s in await engine.stats()]
    report["resolved_config"] = msgspec.to_builtins(cfg)
    report["resolved_config_yaml"] = dump_config(cfg)
    return report


async def _warm_up(engine: RolloutEngine, cfg: Config) -> None:
    """Every engine at full concurrency once, so that no new batch shape compiles mid-run."""
    count = cfg.bench.warmup_prompts
    if count is None:
        count = -(-cfg.engines.count * cfg.engines.max_inflight_per_engine // cfg.sampling.n)
    if count:
        warm = msgspec.structs.replace(cfg.prompts, source="synthetic", count=count, seed=cfg.prompts.seed + 1)
        engine.feed(configured_prompts(warm, engine.limits.vocab_size))
        async for _ in engine.groups():
            pass


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


def format_table(report: dict[str, Any]) -> str:
    ours, raw = report["engine"], report.get("raw_vllm")
    cfg = report["resolved_config"]
    lines = [
        f"rollout bench {report['config']}: {cfg['engines']['count']} engine(s), "
        f"{ours['trajectories'] // max(cfg['sampling']['n'], 1)} prompts x n={cfg['sampling']['n']}, "
        f"max_tokens={cfg['sampling']['max_tokens']}, model={cfg['model']['path']}",
        f"{'metric':<28}{'this engine':>14}{'raw vLLM':>14}{'ratio':>9}",
    ]

    def row(name: str, a: float, b: float | None, fmt: str = "{:.1f}") -> None:
        ratio = f"{a / b:.3f}" if b else "-"
        lines.append(f"{name:<28}{fmt.format(a):>14}{(fmt.format(b) if b is not None else '-'):>14}{ratio:>9}")

    row("generated tokens/s", ours["tokens_per_s"], raw["tokens_per_s"] if raw else None)
    row("trajectories/s", ours["trajectories_per_s"], raw["trajectories_per_s"] if raw else None, "{:.2f}")
    row("generated tokens", ours["generated_tokens"], raw["generated_tokens"] if raw else None, "{:.0f}")
    row("wall time (s)", ours["elapsed_s"], raw["elapsed_s"] if raw else None, "{:.2f}")
    for key, label in (("latency_s", "latency"), ("ttft_s", "time to first token")):
        p = ours[key]
        lines.append(f"{label + ' p50/p90/p99 (s)':<36}{p['p50']:.2f} / {p['p90']:.2f} / {p['p99']:.2f}")
    lines.append(f"{'per-engine token share':<28}" + "  ".join(f"e{i} {s:.1%}" for i, s in enumerate(ours["engine_share"])))
    if "rounds" in report:
        ratios = [r["ratio"] for r in report["rounds"]]
        ci = report["ratio_interval"]
        lines.append(f"{'tokens/s ratio, median':<28}{report['ratio_tokens_per_s']:.3f} of {len(ratios)} rounds, order alternating; "
                     f"{ci['coverage']:.0%} interval {ci['low']:.3f}-{ci['high']:.3f}")  # fmt: skip
        lines.append(f"{'  per round':<28}" + " ".join(f"{x:.3f}" for x in ratios))
    if ours["failed"] or ours.get("failed_groups"):
        lines.append(f"{'failed':<28}{ours['failed']} trajectories, {ours.get('failed_groups', 0)} groups")
    if "spec_decode" in ours:
        lines.extend(spec_decode_rows(cfg["speculative"], ours["spec_decode"], raw.get("spec_decode") if raw else None))
    return "\n".join(lines)


def spec_decode_rows(spec_cfg: dict[str, Any], ours: dict[str, Any], raw: dict[str, Any] | None) -> list[str]:
    """Table rows of speculative decoding figures (`SpecDecodeReport`s as builtins): summed over
    engines (this engine, and raw vLLM when given), then each engine of this engine's run."""
    lines = [f"speculative decoding: {spec_cfg['method']}, {ours['num_speculative_tokens']} draft tokens per step"]

    def cell(x: float | None, fmt: str) -> str:
        return fmt.format(x) if x is not None else "-"

    for name, key, fmt in (
        ("mean acceptance length", "mean_acceptance_length", "{:.3f}"),
        ("acceptance rate", "acceptance_rate", "{:.1%}"),
        ("drafts", "drafts", "{:d}"),
        ("draft tokens", "draft_tokens", "{:d}"),
        ("accepted tokens", "accepted_tokens", "{:d}"),
    ):
        other = f"{cell(raw['total'][key], fmt):>14}" if raw else ""
        lines.append(f"{'  ' + name:<28}{cell(ours['total'][key], fmt):>14}{other}")
    lines.append(f"{'  per-position rate':<28}{_positions(ours['total'])}" + (f"   (raw vLLM {_positions(raw['total'])})" if raw else ""))
    for m in ours["engines"]:
        label = f"  e{m['engine_id']} length/rate/pos"
        lines.append(
            f"{label:<28}{cell(m['mean_acceptance_length'], '{:.3f}')} / {cell(m['acceptance_rate'], '{:.1%}')} / "
            f"{_positions(m)}  ({m['drafts']} drafts)"
        )
    return lines


def _positions(m: dict[str, Any]) -> str:
    rates = m["per_position_rate"]
    return " ".join(f"{r:.3f}" for r in rates) if rates else "-"


def _progress_bar(cfg: Config, enabled: bool, runs: int) -> Any:
    """Trajectories of this engine's timed runs."""
    from tqdm import tqdm

    total = runs * cfg.prompts.count * cfg.sampling.n if cfg.prompts.source == "synthetic" else None
    return tqdm(total=total, unit="traj", file=sys.stderr, disable=not enabled, dynamic_ncols=True, leave=False)
