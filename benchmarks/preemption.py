"""Long contexts on a small KV cache: vLLM preempting (each preemption recorded) vs the cap that
keeps it from ever preempting, measured in one run.

`engines.preemption: record` (the default) lets vLLM run as many requests as the KV cache holds at
their current length and records every preemption (the request ends evicted and continues as a new
one; `kv_recomputes` gets the recompute). `avoid` caps running requests at what the cache holds at
`max_model_len`, which on a long-context model leaves most of the cache idle. Both settings run the
same prompts (long prompts, `max_model_len` 8192, a cache of `--kv-gib`), in alternating rounds,
each on freshly started engines. Reports generated tokens/s, requests vLLM preempted, and the
ratio record / avoid (median over rounds).

    python benchmarks/preemption.py [CONFIG] [--rounds 2] [--kv-gib 0.05] [-o k=v] [--report FILE]
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

from benchmarks.rounds import alternating  # noqa: E402
from rollout.config import Config, load_config  # noqa: E402
from rollout.engine import RolloutEngine  # noqa: E402
from rollout.inputs.prompts import configured_prompts  # noqa: E402

LONG_CONTEXT = [
    "model.max_model_len=8192",
    "prompts.min_len=1024",
    "prompts.max_len=6144",
    "prompts.count=48",
    "sampling.n=2",
    "sampling.max_tokens=512",
    "sampling.min_tokens=256",
    "engines.max_inflight_per_engine=64",
    "logging.level=warning",
]


async def one_run(cfg: Config, setting: str) -> dict[str, Any]:
    cfg = msgspec.structs.replace(cfg, engines=msgspec.structs.replace(cfg.engines, preemption=setting))
    async with RolloutEngine(cfg) as engine:
        warm = msgspec.structs.replace(cfg.prompts, count=4, seed=cfg.prompts.seed + 1)
        engine.feed(configured_prompts(warm, engine.limits.vocab_size))
        async for _ in engine.groups():
            pass
        before = sum(s.preemptions for s in await engine.stats())
        start, tokens, failed = time.perf_counter(), 0, 0
        engine.feed(configured_prompts(cfg.prompts, engine.limits.vocab_size))
        async for group in engine.groups():
            tokens += sum(len(t.token_ids) for t in group.trajectories if t.ok)
            failed += sum(not t.ok for t in group.trajectories) + bool(group.error)
        elapsed = time.perf_counter() - start
        preempted = sum(s.preemptions for s in await engine.stats()) - before
    return {
        "setting": setting,
        "tokens": tokens,
        "elapsed_s": elapsed,
        "tokens_per_s": tokens / elapsed,
        "preempted": preempted,
        "failed": failed,
    }


def table(runs: list[dict[str, Any]], kv_gib: float) -> str:
    rec = [r["tokens_per_s"] for r in runs if r["setting"] == "record"]
    avo = [r["tokens_per_s"] for r in runs if r["setting"] == "avoid"]
    ratios = [a / b for a, b in zip(rec, avo)]
    lines = [
        f"max_model_len 8192, KV cache {kv_gib:g} GiB per engine | generated tokens/s per run (fresh engines each)"
    ]
    for setting in ("record", "avoid"):
        mine = [r for r in runs if r["setting"] == setting]
        lines.append(
            f"{setting:<7} " + "  ".join(f"{r['tokens_per_s']:8.1f}" for r in mine)
            + f"   preempted: {', '.join(str(r['preempted']) for r in mine)}   failed: {sum(r['failed'] for r in mine)}"
        )  # fmt: skip
    lines.append(
        f"record / avoid, median of {len(ratios)} rounds: {statistics.median(ratios):.3f}  ("
        + " ".join(f"{x:.3f}" for x in ratios)
        + ")"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default=str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"))
    ap.add_argument("-o", "--override", action="append", default=[])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-gib", type=float, default=0.05)
    ap.add_argument("--report", default="preemption_report.json")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, [*LONG_CONTEXT, f"engines.vllm={{kv_cache_gib: {args.kv_gib}}}", *args.override])
    runs = []
    for r, order in alternating(args.rounds, ("record", "avoid")):
        for setting in order:
            runs.append(asyncio.run(one_run(cfg, setting)))
            print(
                f"round {r + 1} {setting}: {runs[-1]['tokens_per_s']:.1f} tokens/s, {runs[-1]['preempted']} preempted",
                flush=True,
            )
    print(table(runs, args.kv_gib))
    Path(args.report).write_text(
        msgspec.json.encode(
            {"config": args.config, "overrides": args.override, "kv_gib": args.kv_gib, "runs": runs}
        ).decode()
    )
    print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
