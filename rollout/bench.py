"""`rollout bench`: throughput and latency of this engine against raw vLLM, in one run.

How it measures: start the engines once; warm them up; run the configured prompts through the
scheduler (timed from the first feed to the last group); reset the prefix caches; then drive the
same prompts and sampling straight into each engine's AsyncLLM at once (groups dealt round-robin
over the same engines, no scheduler, no per-request Ray call) and time that. That is round 1 of
`bench.repeats`; later rounds run the same prompts again, alternating which side goes first. The
median of the per-round ratios (this engine / raw vLLM) of generated tokens per second is the
figure that matters on a shared machine; absolute numbers are noise. Other rows are round 1's.

With `speculative:` on, the first scheduler run and the first raw-vLLM run also report
speculative decoding figures over exactly that run (`rollout.specdecode`): per engine and
summed over engines, in the table and under "spec_decode" in the JSON report.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import msgspec

from rollout.config import Config, dump_config
from rollout.engine import RolloutEngine
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


async def run_bench(cfg: Config, config_name: str = "", progress: bool = True) -> dict[str, Any]:
    """Run the benchmark described in the module docstring; returns the JSON report."""
    trajectories: list[Trajectory] = []
    bar = _progress_bar(cfg, progress)

    def on_trajectory(t: Trajectory) -> None:
        trajectories.append(t)
        bar.update(1)

    async with RolloutEngine(cfg, on_trajectory=on_trajectory) as engine:
        prompts = configured_prompts(cfg.prompts, engine.limits.vocab_size)
        if cfg.bench.warmup_prompts:
            warm = msgspec.structs.replace(cfg.prompts, source="synthetic", count=cfg.bench.warmup_prompts, seed=cfg.prompts.seed + 1)
            engine.feed(configured_prompts(warm, engine.limits.vocab_size))
            async for _ in engine.groups():
                pass
            trajectories.clear()
            bar.reset()
        await _reset_prefix_caches(engine)
        meter = SpecDecodeMeter(engine) if cfg.speculative.enabled else None
        if meter:
            await meter.read()  # the window starts here: warm-up drafts are not counted
        start = time.time()
        engine.feed(prompts)
        groups: list[Group] = [g async for g in engine.groups()]
        ours = summarize(trajectories, time.time() - start, cfg.engines.count)
        bar.close()
        ours["failed_groups"] = sum(1 for g in groups if g.error)
        if meter:
            ours["spec_decode"] = msgspec.to_builtins(await meter.read())
        report: dict[str, Any] = {"config": config_name, "engine": ours}
        if cfg.bench.baseline:
            same = [g.prompt for g in groups if not g.error]
            await _reset_prefix_caches(engine)
            if meter:
                await meter.read()
            report["raw_vllm"] = await _raw_baseline(engine, cfg, same)
            if meter:
                report["raw_vllm"]["spec_decode"] = msgspec.to_builtins(await meter.read())
            rounds = [{"order": "engine first", "engine": ours["tokens_per_s"], "raw_vllm": report["raw_vllm"]["tokens_per_s"]}]
            for r in range(1, cfg.bench.repeats):  # more rounds, alternating which side goes first
                sides = ["raw_vllm", "engine"] if r % 2 else ["engine", "raw_vllm"]
                result = {"order": f"{sides[0].replace('_', ' ')} first"}
                for side in sides:
                    await _reset_prefix_caches(engine)
                    if side == "raw_vllm":
                        result[side] = (await _raw_baseline(engine, cfg, same))["tokens_per_s"]
                    else:
                        result[side] = await _scheduled_tokens_per_s(engine, same)
                rounds.append(result)
            for r in rounds:
                r["ratio"] = r["engine"] / max(r["raw_vllm"], 1e-9)
            report["rounds"] = rounds
            report["ratio_tokens_per_s"] = statistics.median(r["ratio"] for r in rounds)
        report["engine_stats"] = [msgspec.to_builtins(s) for s in await engine.stats()]
    report["resolved_config"] = msgspec.to_builtins(cfg)
    report["resolved_config_yaml"] = dump_config(cfg)
    return report


async def _scheduled_tokens_per_s(engine: RolloutEngine, prompts: list[Prompt]) -> float:
    start = time.time()
    engine.feed(prompts)
    tokens = 0
    async for g in engine.groups():
        tokens += sum(len(t.token_ids) for t in g.trajectories if t.ok)
    return tokens / (time.time() - start)


async def _reset_prefix_caches(engine: RolloutEngine) -> None:
    assert engine.pool is not None
    for e in engine.pool.engines:
        await e.reset_prefix_cache()


async def _raw_baseline(engine: RolloutEngine, cfg: Config, prompts: list[Prompt]) -> dict[str, Any]:
    """The same prompts and sampling, dealt round-robin by group, straight into each AsyncLLM."""
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
        lines.append(f"{label + ' p50/p90/p99 (s)':<28}{p['p50']:.2f} / {p['p90']:.2f} / {p['p99']:.2f}")
    lines.append(f"{'per-engine token share':<28}" + "  ".join(f"e{i} {s:.1%}" for i, s in enumerate(ours["engine_share"])))
    if "rounds" in report:
        lines.append(
            f"{'tokens/s ratio, median':<28}{report['ratio_tokens_per_s']:.3f} of {len(report['rounds'])} rounds ("
            + ", ".join(f"{r['ratio']:.3f}" for r in report["rounds"]) + "; order alternates)"
        )
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


def _progress_bar(cfg: Config, enabled: bool) -> Any:
    from tqdm import tqdm

    total = cfg.prompts.count * cfg.sampling.n if cfg.prompts.source == "synthetic" else None
    return tqdm(total=total, unit="traj", file=sys.stderr, disable=not enabled, dynamic_ncols=True, leave=False)
