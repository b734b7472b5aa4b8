"""Async vs synchronous RL, with a simulated learner: samples/s, learner idle time, lag, in one run.

The learner stands in for a GPU trainer elsewhere: each step takes a batch of `--groups` groups,
sleeps `--step-time` seconds ("training"), and pushes weights into the engines (the model's own
weights, so every step generates the same distribution of tokens). Two runs of the same loop:
- sync: `staleness.max_lag=0` and `weight_sync.mode=drain`: the engines generate one batch, then
  wait while the learner trains on it;
- async: `staleness.max_lag=--max-lag` and `weight_sync.mode=keep`: the engines generate the next
  batches while the learner trains.
`--step-time auto` (default) sets the step time to the batch generation time, measured as the
median wait for a batch in the sync run's warm-up steps but the first (the learner sleeps 0
there; with a known step time, warm-up steps train as timed ones do, so an async run's timed
steps start with the lead over the learner it keeps, not from an empty pipeline; the default 4
warm-up steps give a median of 3, which one slow step does not move: with 3, a 10 s wait after
the first update once made the "median" of 2 the step time: 5.4 s). Then the
ideal speed-up is 2x: the sync loop pays generation + training per step, the async one the larger
of the two. Each run starts its own engines; engine start and `--warmup` steps are not timed. The
learner's heap is frozen once the engines start (`rollout.driver_process.freeze_heap`, as `rollout
bench` does): unfrozen, a full collection walked torch's, Ray's and vLLM's objects for seconds,
holding the learner and every update it made.
The async learner's push does not wait for the engines to load (`update_weights(wait=False)`, the
weight-sync client's `wait=False`): it returns once its weights are handed off and the epoch is
allocated, the engines load while it trains, and its next push waits for that (`--wait`: the
push waits until every engine serves the new epoch, as the sync run's does).

    python benchmarks/simulated_learner.py configs/tiny.yaml --steps 8 --groups 16 --report simulated_learner.json
    python benchmarks/simulated_learner.py configs/tiny.yaml --transfer    # pushes through vLLM's trainer API (gloo)
    python benchmarks/simulated_learner.py configs/tiny.yaml --transfer shm
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.weight_sync import TRANSFERS  # noqa: E402
from rollout.config import Config, load_config  # noqa: E402
from rollout.driver_process import freeze_heap  # noqa: E402
from rollout.engine import RolloutEngine  # noqa: E402
from rollout.inputs.prompts import configured_prompts  # noqa: E402


def configured(cfg: Config, max_lag: int, mode: str, groups: int) -> Config:
    return msgspec.structs.replace(
        cfg,
        staleness=msgspec.structs.replace(cfg.staleness, max_lag=max_lag, batch_groups=groups),
        weight_sync=msgspec.structs.replace(cfg.weight_sync, mode=mode),
    )


async def learner_loop(cfg: Config, groups: int, warmup: int, steps: int, step_time: float | None, transfer: str | None,
                       wait: bool = True) -> dict[str, Any]:  # fmt: skip
    """Run `warmup + steps` learner steps; `step_time` None: 0 in warm-up, then the median warm-up wait.
    `transfer`: push through vLLM's trainer API (`gloo`, `shm`), else `engine.update_weights` (Ray's object store);
    `wait=False`: the push returns before the engines load."""
    from safetensors.torch import load_file

    from benchmarks.weight_sync import learner_update, loaded

    measuring = step_time is None  # the warm-up measures the step time: no training there
    async with RolloutEngine(cfg) as engine:
        weights: dict[str, Any] = {}
        for f in sorted(Path(engine.model_path).glob("*.safetensors")):
            weights.update(load_file(str(f)))
        # twice what the steps take: groups handed out too stale are dropped and their prompts are
        # gone (an async run on the object store ran out with 2 batches to spare)
        count = 2 * (warmup + steps + (cfg.staleness.max_lag or 0) + 2) * groups
        push = await learner_update(engine, weights, transfer, wait)
        # as `rollout bench` does once started: else the driver's full collections (seconds) hold the learner
        freeze_heap()
        engine.feed(configured_prompts(msgspec.structs.replace(cfg.prompts, count=count), engine.limits.vocab_size))
        rows: list[dict[str, float]] = []
        lag_before: dict[int, int] = {}
        for step in range(warmup + steps):
            if step == warmup:
                if step_time is None:  # the first warm-up step also pays one-off compiles
                    step_time = statistics.median(r["wait_s"] for r in rows[1:] or rows)
                lag_before = dict(engine.staleness.lag_tokens)
            t0 = time.perf_counter()
            batch = await engine.batches(groups=groups)
            assert batch is not None and len(batch.groups) == groups, "ran out of prompts"
            t1 = time.perf_counter()
            await asyncio.sleep(0.0 if measuring and step < warmup else step_time)  # the trainer's step
            t2 = time.perf_counter()
            await push(weights)
            t3 = time.perf_counter()
            ok = [t for t in batch.trajectories if t.ok]
            rows.append({"wait_s": t1 - t0, "train_s": t2 - t1, "push_s": t3 - t2, "samples": len(ok),
                         "tokens": sum(len(t.token_ids) for t in ok)})  # fmt: skip
        await loaded(engine, push)  # the last push's loads (not timed: the run is over)
        stalls = [s for u in engine.weight_updates[warmup:] for s in u.stall_s.values()]
        reruns = sum(s.reruns for s in await engine.stats())
        lags = {k: v - lag_before.get(k, 0) for k, v in engine.staleness.lag_tokens.items() if v - lag_before.get(k, 0)}
    gc.unfreeze()
    measured = rows[warmup:]
    wall = sum(r["wait_s"] + r["train_s"] + r["push_s"] for r in measured)
    return {
        "max_lag": cfg.staleness.max_lag,
        "path": f"vLLM's trainer API ({transfer})" if transfer else "Ray's object store",
        "weight_sync_mode": cfg.weight_sync.mode,
        "push_waits": wait,
        "step_time_s": step_time,
        "steps": len(measured),
        "samples": sum(r["samples"] for r in measured),
        "wall_s": wall,
        "samples_per_s": sum(r["samples"] for r in measured) / wall,
        "tokens_per_s": sum(r["tokens"] for r in measured) / wall,
        "learner_idle_fraction": sum(r["wait_s"] for r in measured) / wall,
        "push_fraction": sum(r["push_s"] for r in measured) / wall,
        "wait_s_median": statistics.median(r["wait_s"] for r in measured),
        "warmup_wait_s": [r["wait_s"] for r in rows[:warmup]],
        "stall_s_median": statistics.median(stalls) if stalls else float("nan"),
        "lag_tokens": dict(sorted(lags.items())),
        "reruns": reruns,  # requests restarted because an update overtook their prompt (whole run)
        "rows": measured,
    }


def table(sync: dict[str, Any], async_: dict[str, Any]) -> str:
    def lag(r: dict[str, Any]) -> str:
        total = sum(r["lag_tokens"].values()) or 1
        return " ".join(f"{k}:{v / total:.0%}" for k, v in r["lag_tokens"].items())

    lines = [
        f"learner step {sync['step_time_s']:.2f} s (= batch generation time), {sync['steps']} steps per run, "
        f"weights through {sync['path']}; learner idle: waiting for a batch, blocked: in the update call "
        "(shares of its wall time)",
        f"{'run':<6} {'max_lag':>7} {'mode':<6} {'push':<9} {'samples/s':>10} {'learner idle':>12} {'blocked':>8} "
        f"{'stall med':>10}  lag (share of tokens)",
    ]
    for name, r in (("sync", sync), ("async", async_)):
        lines.append(
            f"{name:<6} {r['max_lag']:>7} {r['weight_sync_mode']:<6} {'waits' if r['push_waits'] else 'no wait':<9} "
            f"{r['samples_per_s']:>10.2f} {r['learner_idle_fraction']:>12.1%} {r['push_fraction']:>8.1%} "
            f"{r['stall_s_median'] * 1e3:>8.1f}ms  {lag(r)}"
        )
    lines.append(f"async / sync samples/s: {async_['samples_per_s'] / sync['samples_per_s']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default=str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"))
    ap.add_argument("-o", "--override", action="append", default=[], help="dotted override, e.g. sampling.n=8")
    ap.add_argument("--groups", type=int, default=16, help="groups per learner step")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run")
    ap.add_argument(
        "--warmup",
        type=int,
        default=4,
        help="untimed steps per run (auto's step time: the median wait of all but the first)",
    )
    ap.add_argument("--step-time", default="auto", help="seconds per learner step, or auto (= batch generation time)")
    ap.add_argument("--max-lag", type=int, default=1, help="staleness.max_lag of the async run")
    ap.add_argument(
        "--transfer",
        nargs="?",
        const="gloo",
        choices=TRANSFERS,
        help="push through vLLM's trainer API (gloo; or shm), not Ray's object store",
    )
    ap.add_argument(
        "--wait", action="store_true", help="the async learner's push waits until every engine serves the new epoch"
    )
    ap.add_argument("--report", default="simulated_learner.json")
    args = ap.parse_args(argv)
    if args.warmup < 1 and args.step_time == "auto":
        ap.error("--step-time auto needs --warmup >= 1")
    cfg = load_config(args.config, ["logging.level=warning", *args.override])
    step_time = None if args.step_time == "auto" else float(args.step_time)
    sync = asyncio.run(
        learner_loop(
            configured(cfg, 0, "drain", args.groups), args.groups, args.warmup, args.steps, step_time, args.transfer
        )
    )
    print(f"sync: {sync['samples_per_s']:.2f} samples/s, step {sync['step_time_s']:.2f} s", flush=True)
    async_ = asyncio.run(learner_loop(configured(cfg, args.max_lag, "keep", args.groups), args.groups, args.warmup,
                                      args.steps, sync["step_time_s"], args.transfer, args.wait))  # fmt: skip
    print(table(sync, async_))
    report = {"config": args.config, "overrides": args.override, "groups": args.groups, "sync": sync, "async": async_,
              "speedup": async_["samples_per_s"] / sync["samples_per_s"]}  # fmt: skip
    Path(args.report).write_text(msgspec.json.encode(report).decode())
    print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
