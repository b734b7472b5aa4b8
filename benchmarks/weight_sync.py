"""What an in-flight weight update costs, per `weight_sync.mode`, measured in one run.

For each mode: start the engines, warm them up, then alternate rounds of the same workload
without updates and with an update every `--interval` seconds (the model's own weights pushed
back, so every round generates the same distribution of tokens). Reports per mode:
- the stall each engine saw per update (pause -> resume; median and max) and the load alone;
- each update's two phases as the driver saw them: before the first pause (checks, the object
  store, each engine staging), and from the first engine's pause to the last one's resume;
- the learner's update call (until every engine serves the new epoch) while the engines generate,
  against the same call with the engines idle (3 calls before the rounds), median of each, and how
  late the driver's event loop wakes meanwhile (the learner's calls all go through it), and the
  driver's garbage collections (each holds every thread of the driver: one full collection of an
  unfrozen heap took 3.6 s). The driver's heap is frozen once the engines start
  (`rollout.driver_process.freeze_heap`, as `rollout bench` does; a learner's process should do the same);
- generated tokens/s with updates vs without, as the median of the per-round ratios;
- the KV each update makes running requests recompute (`recompute`, `abort_resume`), in seconds at
  the engines' measured prefill rate, and a warning line for a mode whose recompute takes longer
  than the update interval (or whose rounds take twice as long with updates): it would spend its
  time recomputing instead of decoding.

    python benchmarks/weight_sync.py configs/tiny.yaml -o prompts.count=128 --report weight_sync.json
        --plot weight_sync.png

`--transfer` sends every update through vLLM's trainer API (its trainer factory's gloo engine and
`engine.weight_sync_client()`) instead of Ray's object store; `--transfer shm` through the shm engine.
`--no-wait` makes the learner's call
the one that does not wait for the engines to load (`update_weights(wait=False)`, the client's
`wait=False`): the table shows that call, and beside it the time until every engine serves the epoch.
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

from benchmarks.weight_plane import TimedClient  # noqa: E402
from rollout.config import Config, PromptsConfig, load_config  # noqa: E402
from rollout.driver_process import freeze_heap  # noqa: E402
from rollout.engine import RolloutEngine  # noqa: E402
from rollout.inputs.prompts import configured_prompts  # noqa: E402

MODES = ("keep", "recompute", "abort_resume", "drain")
TRANSFERS = ("gloo", "shm")  # vLLM's trainer API over our CPU weight-transfer engines


async def one_round(
    engine: RolloutEngine, prompts: PromptsConfig, weights: Any, interval: float | None, update: Any = None
) -> dict[str, Any]:
    """Run the configured prompts once; with `interval`, push `weights` every `interval` s meanwhile."""
    tokens = 0
    first_update = len(engine.weight_updates)
    start = time.perf_counter()
    engine.feed(configured_prompts(prompts, engine.limits.vocab_size))
    done = asyncio.Event()

    calls: list[float] = []
    loaded: list[float] = []  # until every engine serves the epoch (= the call, when it waits)
    phases: list[dict[str, float]] = []  # through vLLM's trainer API: seconds in each of its calls

    async def updater() -> None:
        while True:
            try:
                await asyncio.wait_for(done.wait(), interval)
                return
            except TimeoutError:
                call, until = await timed(engine, update or engine.update_weights, weights)
                calls.append(call)
                loaded.append(until)
                phases.append(dict(getattr(update, "calls", {})))

    lags: list[
        float
    ] = []  # the driver's event loop: how late a 10 ms sleep wakes (every call of the learner's waits on it)

    async def lag() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - t - 0.01)

    pauses: list[
        float
    ] = []  # the driver's garbage collections (each holds every thread of the driver, the update's too)
    began = [0.0]

    def collected(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - began[0])

    task = asyncio.ensure_future(updater()) if interval else None
    watch = asyncio.ensure_future(lag())
    gc.callbacks.append(collected)
    try:
        async for group in engine.groups():
            tokens += sum(len(t.token_ids) for t in group.trajectories if t.ok)
    finally:
        gc.callbacks.remove(collected)
    elapsed = time.perf_counter() - start
    done.set()
    await watch
    if task:
        await task
    return {"tokens": tokens, "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed,
            "updates": engine.weight_updates[first_update:], "update_s": calls,
            "loaded_s": loaded, "phases": phases, "loop_lag_s": lags, "gc_s": pauses}  # fmt: skip


async def timed(engine: RolloutEngine, update: Any, weights: Any) -> tuple[float, float]:
    """Seconds of one update call (the learner's wait), and until every engine serves the new epoch."""
    start = time.perf_counter()
    await update(weights)
    call = time.perf_counter() - start
    await loaded(engine, update)
    return call, time.perf_counter() - start


async def loaded(engine: RolloutEngine, update: Any) -> None:
    """Until every engine serves the last update's epoch (a handed-off trainer round's bytes first)."""
    import anyio

    if settle := getattr(update, "settle", None):
        await anyio.to_thread.run_sync(settle)
    await engine.weights_loaded()


async def learner_update(
    engine: RolloutEngine, weights: dict[str, Any], transfer: str | None, wait: bool = True
) -> Any:
    """The learner's update call, `update(weights) -> epoch`: `engine.update_weights` (Ray's object
    store), or with `transfer` (`gloo`, `shm`) vLLM's trainer API: its trainer factory builds that
    engine (`policies.gloo_transfer`, `policies.shm_transfer`) over `engine.weight_sync_client()`,
    timed per vLLM call (`update.calls`). `wait=False`: the forms that return before the engines
    load (the client's `finish_weight_update` returns the epoch at once; gloo's trainer also hands
    off its send: `send_weights` returns once every engine receives and the weights are copied)."""
    if not transfer:
        return lambda w: engine.update_weights(w, wait=wait)
    import anyio
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from policies.gloo_transfer import GlooTrainerInitInfo, StateDictSource
    from policies.shm_transfer import ShmTrainerInitInfo

    client, source = TimedClient(engine.weight_sync_client(wait=wait)), StateDictSource(weights)
    if transfer not in TRANSFERS:
        raise ValueError(f"transfer {transfer!r}: one of {', '.join(TRANSFERS)}")
    if transfer == "shm":
        init: Any = ShmTrainerInitInfo(world_size=1 + client.world_size(), rank=0, timeout_s=600)
    else:
        init = GlooTrainerInitInfo(world_size=1 + client.world_size(), rank=0, timeout_s=600, hand_off=not wait)
    trainer = await anyio.to_thread.run_sync(
        lambda: WeightTransferTrainerFactory.trainer_init(init, client=client, source=source)
    )

    async def update(w: dict[str, Any]) -> int:
        source.update(w)
        await anyio.to_thread.run_sync(trainer.send_weights)
        return engine.epoch

    update.calls, update.settle = client.last, getattr(trainer, "settle", None)  # type: ignore[attr-defined]
    return update


async def bench_mode(
    cfg: Config, mode: str, rounds: int, interval: float, transfer: str | None = None, wait: bool = True
) -> dict[str, Any]:
    from safetensors.torch import load_file

    cfg = msgspec.structs.replace(cfg, weight_sync=msgspec.structs.replace(cfg.weight_sync, mode=mode))
    async with RolloutEngine(cfg) as engine:
        weights = {}
        for f in sorted(Path(engine.model_path).glob("*.safetensors")):
            weights.update(load_file(str(f)))
        # as `rollout bench` does once started: else the driver's full collections walk torch's, Ray's and
        # vLLM's heap
        freeze_heap()
        warm = msgspec.structs.replace(cfg.prompts, count=cfg.bench.warmup_prompts or 64)
        await one_round(engine, warm, weights, interval=None)
        update = await learner_update(engine, weights, transfer, wait)
        await update(weights)  # the first update pays one-off costs
        await loaded(engine, update)
        idle = [await timed(engine, update, weights) for _ in range(3)]  # the engines idle: the same call's floor
        prefill = await prefill_rate(engine, cfg)
        plain, updated = [], []
        for _ in range(rounds):
            plain.append(await one_round(engine, cfg.prompts, weights, None))
            updated.append(await one_round(engine, cfg.prompts, weights, interval, update))
    gc.unfreeze()
    stalls = [s for r in updated for u in r["updates"] for s in u.stall_s.values()]
    loads = [s for r in updated for u in r["updates"] for s in u.load_s.values()]
    prepare = [u.prepare_s for r in updated for u in r["updates"]]  # the driver's view: before phase 2, then phase 2
    commit = [u.seconds for r in updated for u in r["updates"]]
    ratios = [u["tokens_per_s"] / p["tokens_per_s"] for p, u in zip(plain, updated)]
    busy = [s for r in updated for s in r["update_s"]]
    busy_loaded = [s for r in updated for s in r["loaded_s"]]
    lag = sorted(s for r in updated for s in r["loop_lag_s"])
    collections = [s for r in updated for s in r["gc_s"]]
    phases = [p for r in updated for p in r["phases"] if p]
    # What one update costs the engines in KV recompute, at the prefill rate measured above: an
    # engine whose recompute takes longer than the update interval never gets back to decoding.
    recomputed = [n for r in updated for u in r["updates"] for n in u.recomputed_tokens.values()]
    recompute_s = _median(recomputed) / (prefill / cfg.engines.count) if recomputed else 0.0
    return {
        "mode": mode,
        "updates": sum(len(r["updates"]) for r in updated),
        "stall_s": {"median": _median(stalls), "max": max(stalls, default=float("nan"))},
        "stalls_s": stalls,
        "load_s": {"median": _median(loads), "max": max(loads, default=float("nan"))},
        "phases_s": {"prepare_median": _median(prepare), "commit_median": _median(commit)},
        "wait": wait,
        "loop_lag_s": {
            "median": _median(lag),
            "p90": lag[int(0.9 * len(lag))] if lag else float("nan"),
            "max": max(lag, default=float("nan")),
        },
        "gc_s": {"count": len(collections), "max": max(collections, default=0.0), "total": sum(collections)},
        "update_s": {
            "idle": [c for c, _ in idle],
            "generating": busy,
            "idle_median": _median([c for c, _ in idle]),
            "generating_median": _median(busy),
            "calls_generating_median": {k: _median([p[k] for p in phases]) for k in (phases[0] if phases else {})},
        },
        "loaded_s": {
            "idle": [t for _, t in idle],
            "generating": busy_loaded,
            "idle_median": _median([t for _, t in idle]),
            "generating_median": _median(busy_loaded),
        },  # fmt: skip
        "tokens_per_s_plain": [r["tokens_per_s"] for r in plain],
        "tokens_per_s_updating": [r["tokens_per_s"] for r in updated],
        "ratio": _median(ratios),
        "ratios": ratios,
        "bytes_per_update": updated[0]["updates"][0].bytes if updated and updated[0]["updates"] else 0,
        "prefill_tokens_per_s": prefill,
        "recomputed_tokens_per_update": _median(recomputed) if recomputed else 0,
        "recompute_s_per_update": recompute_s,
        "collapses": recompute_s > interval or any(u["elapsed_s"] > 2 * p["elapsed_s"] for p, u in zip(plain, updated)),
    }


async def prefill_rate(engine: RolloutEngine, cfg: Config) -> float:
    """Prompt tokens/s of the engines on the configured prompts with one generated token each."""
    prompts = msgspec.structs.replace(cfg.prompts, count=min(cfg.prompts.count, 128))
    feed = [msgspec.structs.replace(p, sampling={"max_tokens": 1, "min_tokens": 0, "n": 1})
            for p in configured_prompts(prompts, engine.limits.vocab_size)]  # fmt: skip
    start = time.perf_counter()
    engine.feed(feed)
    tokens = sum([len(g.prompt.token_ids or ()) async for g in engine.groups()])
    return tokens / (time.perf_counter() - start)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(results: list[dict[str, Any]], interval: float) -> str:
    lines = [
        f"update every {interval:g} s | stall per engine and update (pause -> resume) | "
        "update call (median) generating vs idle | tokens/s updating / not",
        f"{'mode':<13} {'updates':>7} {'stall med':>10} {'stall max':>10} {'load med':>9} {'recompute':>10} "
        f"{'upd gen':>9} {'upd idle':>9} {'gen/idle':>8} {'ratio':>7}  per round",
    ]
    for r in results:
        u = r["update_s"]
        lines.append(
            f"{r['mode']:<13} {r['updates']:>7} {r['stall_s']['median'] * 1e3:>8.1f}ms "
            f"{r['stall_s']['max'] * 1e3:>8.1f}ms {r['load_s']['median'] * 1e3:>7.1f}ms "
            f"{r['recompute_s_per_update'] * 1e3:>8.1f}ms {u['generating_median'] * 1e3:>7.1f}ms "
            f"{u['idle_median'] * 1e3:>7.1f}ms {u['generating_median'] / u['idle_median']:>8.2f} {r['ratio']:>7.3f}  "
            + " ".join(f"{x:.3f}" for x in r["ratios"])
        )
    for r in results:
        lines.append(f"{r['mode']}: the driver's event loop while generating, how late a 10 ms sleep wakes: median "
                     f"{r['loop_lag_s']['median'] * 1e3:.1f}ms, p90 {r['loop_lag_s']['p90'] * 1e3:.1f}ms, "
                     f"max {r['loop_lag_s']['max'] * 1e3:.1f}ms; "
                     f"its garbage collections: {r['gc_s']['count']}, longest {r['gc_s']['max'] * 1e3:.1f}ms, "
                     f"{r['gc_s']['total'] * 1e3:.1f}ms in all")  # fmt: skip
        if not r["wait"]:
            u = r["loaded_s"]
            lines.append(f"{r['mode']}: the call does not wait; until every engine serves the epoch (median): "
                         f"generating {u['generating_median'] * 1e3:.1f}ms, "
                         f"idle {u['idle_median'] * 1e3:.1f}ms")  # fmt: skip
    for r in results:
        lines.append(
            f"{r['mode']}: each update while generating (median), the driver's view: checks, object store and staging "
            f"{r['phases_s']['prepare_median'] * 1e3:.1f}ms, then every engine's pause..resume "
            f"{r['phases_s']['commit_median'] * 1e3:.1f}ms"
        )
    for r in results:
        if calls := r["update_s"]["calls_generating_median"]:
            lines.append(
                f"{r['mode']}: vLLM's calls while generating (median): "
                + ", ".join(f"{k} {v * 1e3:.1f}ms" for k, v in calls.items())
            )
    for r in results:
        if r["collapses"]:
            lines.append(
                f"! {r['mode']}: each update makes the engines recompute ~{r['recomputed_tokens_per_update']:.0f} "
                f"KV positions (~{r['recompute_s_per_update']:.2f} s at {r['prefill_tokens_per_s']:.0f} prefill "
                f"tokens/s), against an update every {interval:g} s: updates this frequent keep it recomputing "
                "instead of decoding (use keep, or update less often)"
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
    ap.add_argument(
        "--transfer",
        nargs="?",
        const="gloo",
        choices=TRANSFERS,
        help="updates through vLLM's trainer API (gloo; or shm)",
    )
    ap.add_argument(
        "--no-wait", action="store_true", help="the learner's call returns before the engines load (wait=False)"
    )
    ap.add_argument("--plot", metavar="FILE.png", help="also draw the ratios and stalls per mode (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.plot:
        from rollout.bench.plots import require_matplotlib

        require_matplotlib()  # now, not after the run
    cfg = load_config(args.config, ["logging.level=warning", *args.override])
    results = []
    for mode in args.modes.split(","):
        results.append(asyncio.run(bench_mode(cfg, mode, args.rounds, args.interval, args.transfer, not args.no_wait)))
        print(table(results[-1:], args.interval).splitlines()[-1], flush=True)
    print(table(results, args.interval))
    report = {
        "interval_s": args.interval,
        "config": args.config,
        "overrides": args.override,
        "transfer": args.transfer,
        "wait": not args.no_wait,
        "results": results,
    }
    Path(args.report).write_text(msgspec.json.encode(report).decode())
    print(f"report: {args.report}")
    if args.plot:
        from rollout.bench.plots import weight_sync_figure

        weight_sync_figure(msgspec.to_builtins(report), args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
