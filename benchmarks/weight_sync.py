"""What an in-flight weight update costs, per `weight_sync.mode`, measured in one run.

For each mode: start the engines, warm them up, then alternate rounds of the same workload
without updates and with an update every `--interval` seconds (the model's own weights pushed
back, so every round generates the same distribution of tokens). Reports per mode:
- the stall each engine saw per update (pause -> resume; median and max) and the load alone;
- generated tokens/s with updates vs without, as the median of the per-round ratios.

    python benchmarks/weight_sync.py configs/tiny.yaml -o prompts.count=128 --report weight_sync.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout.config import Config, PromptsConfig, load_config  # noqa: E402
from rollout.engine import RolloutEngine  # noqa: E402
from rollout.prompts import configured_prompts  # noqa: E402

MODES = ("keep", "recompute", "abort_resume", "drain")


async def one_round(engine: RolloutEngine, prompts: PromptsConfig, weights: Any, interval: float | None) -> dict[str, Any]:
    """Run the configured prompts once; with `interval`, push `weights` every `interval` s meanwhile."""
    tokens = 0
    first_update = len(engine.weight_updates)
    start = time.perf_counter()
    engine.feed(configured_prompts(prompts, engine.limits.vocab_size))
    done = asyncio.Event()

    async def updater() -> None:
        while True:
            try:
                await asyncio.wait_for(done.wait(), interval)
                return
            except asyncio.TimeoutError:
                await engine.update_weights(weights)

    task = asyncio.ensure_future(updater()) if interval else None
    async for group in engine.groups():
        tokens += sum(len(t.token_ids) for t in group.trajectories if t.ok)
    elapsed = time.perf_counter() - start
    done.set()
    if task:
        await task
    return {"tokens": tokens, "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed, "updates": engine.weight_updates[first_update:]}


async def bench_mode(cfg: Config, mode: str, rounds: int, interval: float) -> dict[str, Any]:
    from safetensors.torch import load_file

    cfg = msgspec.structs.replace(cfg, weight_sync=msgspec.structs.replace(cfg.weight_sync, mode=mode))
    async with RolloutEngine(cfg) as engine:
        weights = {}
        for f in sorted(Path(engine.model_path).glob("*.safetensors")):
            weights.update(load_file(str(f)))
        warm = msgspec.structs.replace(cfg.prompts, count=cfg.bench.warmup_prompts or 64)
        await one_round(engine, warm, weights, interval=None)
        await engine.update_weights(weights)  # the first update pays one-off costs
        plain, updated = [], []
        for _ in range(rounds):
            plain.append(await one_round(engine, cfg.prompts, weights, None))
            updated.append(await one_round(engine, cfg.prompts, weights, interval))
    stalls = [s for r in updated for u in r["updates"] for s in u.stall_s.values()]
    loads = [s for r in updated for u in r["updates"] for s in u.load_s.values()]
    ratios = [u["tokens_per_s"] / p["tokens_per_s"] for p, u in zip(plain, updated)]
    return {
        "mode": mode,
        "updates": sum(len(r["updates"]) for r in updated),
        "stall_s": {"median": _median(stalls), "max": max(stalls, default=float("nan"))},
        "load_s": {"median": _median(loads), "max": max(loads, default=float("nan"))},
        "tokens_per_s_plain": [r["tokens_per_s"] for r in plain],
        "tokens_per_s_updating": [r["tokens_per_s"] for r in updated],
        "ratio": _median(ratios),
        "ratios": ratios,
        "bytes_per_update": updated[0]["updates"][0].bytes if updated and updated[0]["updates"] else 0,
    }


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(results: list[dict[str, Any]], interval: float) -> str:
    lines = [
        f"update every {interval:g} s | stall per engine and update (pause -> resume) | tokens/s updating / not",
        f"{'mode':<13} {'updates':>7} {'stall med':>10} {'stall max':>10} {'load med':>9} {'ratio':>7}  per round",
    ]
    for r in results:
        lines.append(
            f"{r['mode']:<13} {r['updates']:>7} {r['stall_s']['median'] * 1e3:>8.1f}ms {r['stall_s']['max'] * 1e3:>8.1f}ms "
            f"{r['load_s']['median'] * 1e3:>7.1f}ms {r['ratio']:>7.3f}  " + " ".join(f"{x:.3f}" for x in r["ratios"])
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default=str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"))
    ap.add_argument("-o", "--override", action="append", default=[], help="dotted override, e.g. prompts.count=128")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between updates")
    ap.add_argument("--report", default="weight_sync_report.json")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, ["logging.level=warning", *args.override])
    results = []
    for mode in args.modes.split(","):
        results.append(asyncio.run(bench_mode(cfg, mode, args.rounds, args.interval)))
        print(table(results[-1:], args.interval).splitlines()[-1], flush=True)
    print(table(results, args.interval))
    Path(args.report).write_text(msgspec.json.encode({"interval_s": args.interval, "config": args.config, "overrides": args.override, "results": results}).decode())
    print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
