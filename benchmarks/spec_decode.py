"""Generated tokens/s with ngram speculative decoding vs without, on a repetitive workload, in one run.

Workload: `--prompts` prompts, each a random 3-7 token pattern repeated to 40-80 tokens, `sampling.n`
samples each, `--temperature` (default 0: greedy, where a small model soon repeats itself and
ngram drafts get accepted), `sampling.max_tokens` tokens (min_tokens = max_tokens: every sample
has the same length). The same prompts run on two engine pools, one after the other: speculation
off, then on (the `speculative:` block of the config, or ngram with 3 draft tokens and n-grams of
2-4 tokens if it has none). Each pool is warmed up, then runs the workload `--rounds` times;
speculative decoding figures are read from the engines' own counters over the timed rounds only
(`rollout.metrics.specdecode`). Reports tokens/s per round, the ratio of medians (on / off), and the
acceptance figures per engine and summed over engines.

`--medium` swaps the tiny model for a random 8-layer, 768-wide Llama (~60M parameters, built
once like the tiny one): decoding a few requests at a time is then memory-bound, the regime
where speculation pays; the tiny model's steps cost mostly fixed per-step work.

    python benchmarks/spec_decode.py configs/tiny.yaml --report spec_decode.json
    python benchmarks/spec_decode.py --medium -o engines.count=1 -o sampling.n=1 -o sampling.max_tokens=256 --prompts 2
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout.bench.table import spec_decode_rows  # noqa: E402
from rollout.config import Config, SpeculativeConfig, load_config  # noqa: E402
from rollout.engine import RolloutEngine  # noqa: E402
from rollout.metrics.specdecode import SpecDecodeMeter, window  # noqa: E402
from rollout.types import Prompt  # noqa: E402

MEDIUM = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=12,
    num_key_value_heads=4,
    init_std=0.02,
)
DEFAULT_SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)


def repetitive_prompts(count: int, cfg: Config, temperature: float, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    m = cfg.sampling.max_tokens
    out = []
    for i in range(count):
        pattern = [rng.randrange(4, 260) for _ in range(rng.randrange(3, 8))]
        ids = (pattern * 30)[: rng.randrange(40, 80)]
        out.append(Prompt(token_ids=ids, id=f"p{seed}-{i}", sampling={"temperature": temperature, "min_tokens": m}))
    return out


async def run_pool(cfg: Config, prompts: list[Prompt], warmup: list[Prompt], rounds: int) -> dict[str, Any]:
    """Start the engines, warm up, time `rounds` runs of `prompts`; figures over the timed runs."""
    async with RolloutEngine(cfg) as engine:
        engine.feed(warmup)
        async for _ in engine.groups():
            pass
        meter = await SpecDecodeMeter.open(engine)
        before = await meter.snapshot()
        per_round = []
        for _ in range(rounds):
            start, tokens = time.perf_counter(), 0
            engine.feed(prompts)
            async for group in engine.groups():
                assert group.ok, group.error or [t.error for t in group.trajectories]
                tokens += sum(len(t.token_ids) for t in group.trajectories)
            elapsed = time.perf_counter() - start
            per_round.append({"tokens": tokens, "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed})
        spec = window(before, await meter.snapshot())
    return {
        "speculative": msgspec.to_builtins(cfg.speculative),
        "rounds": per_round,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in per_round),
        "spec_decode": msgspec.to_builtins(spec),
    }


def table(report: dict[str, Any]) -> str:
    off, on = report["off"], report["on"]

    def rounds(r: dict[str, Any]) -> str:
        return " ".join(f"{x['tokens_per_s']:.0f}" for x in r["rounds"])

    lines = [
        f"ngram speculation on a repetitive workload: {report['prompts']} prompts x n={report['n']}, "
        f"{report['max_tokens']} tokens, temperature {report['temperature']:g}, {report['engines']} engine(s), "
        f"model {Path(report['model']).name}",
        f"{'':<28}{'off':>14}{'on':>14}{'on/off':>9}",
        f"{'generated tokens/s (median)':<28}{off['tokens_per_s']:>14.1f}{on['tokens_per_s']:>14.1f}"
        f"{report['ratio_tokens_per_s']:>9.3f}",
        f"{'  per round':<28}{rounds(off):>14}{rounds(on):>14}",
    ]
    return "\n".join(lines + spec_decode_rows(on["speculative"], on["spec_decode"], None))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default=str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"))
    ap.add_argument(
        "-o", "--override", action="append", default=[], help="dotted override, e.g. sampling.max_tokens=256"
    )
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--medium", action="store_true", help="a ~60M-parameter random Llama instead of the tiny model")
    ap.add_argument("--report", default="spec_decode_report.json")
    args = ap.parse_args(argv)
    overrides = ["logging.level=warning", *args.override]
    if args.medium:
        from rollout.tiny import TinySpec, build_tiny

        overrides.append(f"model.path={build_tiny(TinySpec(**MEDIUM))}")
    cfg = load_config(args.config, overrides)
    spec = cfg.speculative if cfg.speculative.enabled else DEFAULT_SPEC
    prompts = repetitive_prompts(args.prompts, cfg, args.temperature, seed=0)
    warmup = repetitive_prompts(max(8, args.prompts // 4), cfg, args.temperature, seed=1)
    report: dict[str, Any] = {
        "config": args.config, "overrides": overrides, "model": cfg.model.path, "prompts": args.prompts,
        "n": cfg.sampling.n,
        "max_tokens": cfg.sampling.max_tokens, "temperature": args.temperature, "engines": cfg.engines.count,
    }  # fmt: skip
    for name, s in (("off", SpeculativeConfig()), ("on", spec)):
        report[name] = asyncio.run(run_pool(msgspec.structs.replace(cfg, speculative=s), prompts, warmup, args.rounds))
        print(f"{name}: {report[name]['tokens_per_s']:.1f} tokens/s", flush=True)
    report["ratio_tokens_per_s"] = report["on"]["tokens_per_s"] / report["off"]["tokens_per_s"]
    print(table(report))
    Path(args.report).write_text(msgspec.json.encode(report).decode())
    print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
