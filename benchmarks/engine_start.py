"""What one engine start costs, with vLLM's default (compiled) path and with `enforce_eager`.

Starts a pool of `--engines` tiny-model engines (float32, as the integration tier does) once per
setting, `--repeats` times, alternating, in this process: the seconds from `RolloutEngine`'s entry
to engines ready (each start includes Ray's local cluster, which each exit stops), then one small
round of generation as a check that the engines serve. Prints a table; `--report` writes JSON.

    python benchmarks/engine_start.py --engines 1 --repeats 2 --report engine_start.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from rollout import Prompt, RolloutEngine, load_config
from rollout.config import Config

SETTINGS = {"default": [], "enforce_eager": ["engines.vllm={enforce_eager: true}"]}


def config(engines: int, extra: list[str]) -> Config:
    base = ["model.dtype=float32", "model.max_model_len=1024", "sampling.max_tokens=16", "logging.level=warning"]
    return load_config(None, [*base, f"engines.count={engines}", *extra])


async def start_once(cfg: Config) -> float:
    t0 = time.perf_counter()
    async with RolloutEngine(cfg) as engine:
        seconds = time.perf_counter() - t0
        engine.feed([Prompt(token_ids=[5 + i] * 12, id=f"p{i}") for i in range(8)])
        groups = [g async for g in engine.groups()]
        assert len(groups) == 8 and all(g.ok for g in groups), [g.error for g in groups]
    return seconds


async def main(args: argparse.Namespace) -> dict:
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(args.repeats):
        for name, extra in SETTINGS.items():
            times[name].append(await start_once(config(args.engines, extra)))
    return {name: {"runs_s": [round(t, 1) for t in ts], "median_s": round(statistics.median(ts), 1)}
            for name, ts in times.items()}  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--report", default=None)
    args = parser.parse_args()
    result = asyncio.run(main(args))
    print(f"{'setting':<14} {'median start (s)':>17}  runs")
    for name, r in result.items():
        print(f"{name:<14} {r['median_s']:>17}  {r['runs_s']}")
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"engines": args.engines, "repeats": args.repeats, "starts": result}, f, indent=2)
