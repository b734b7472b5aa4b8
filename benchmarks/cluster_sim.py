"""The driver against a simulated cluster: how much CPU one driver process spends per generated token
and per trajectory, the latency it adds, its memory per in-flight trajectory, and where it saturates.

The driver is the real one: `RolloutEngine` with its scheduler, runner, staleness checks, hand-out,
metrics, in-flight weight updates (`update_weights` every `--update-every` s) and, with `--durable`,
the durable log; its engines are `actors.handle.RayEngine` handles, unchanged. Behind them, instead of
vLLM, `benchmarks.sim_engine.SimEngine`s (hosted by `benchmarks.sim_pool`): simulated GPU engines
(throughput, time to first token, output lengths with long tails, continuous batching, per-token epochs
across updates, preemptions) run by `--hosts` Ray actors of many engines each, so every group crosses
the real Ray hop.

A learner takes batches of `--batch` groups as fast as they come. After `--warmup` s a window of
`--duration` s is measured: tokens and trajectories handed out, the driver's process CPU time
(`time.process_time`: all its threads, Ray's included; not wall time), the sim hosts' CPU, the
engines' occupancy (running / capacity: below ~0.9 the driver is not keeping them fed), latency
from an engine's finish to `batches()` (the batch's last group), RSS per in-flight trajectory, the
driver's garbage collections (`--freeze` / `--gc-threshold` try the cheap measures against them). Then
feeding stops and everything in flight drains: every fed prompt must come out once (`lost`).
`--kill E@S` / `--stall E@S`: engine E dies / stops answering S s into the run (the health watch
kills it); its samples move on and it restarts, as a real engine's do.

This machine's cores are shared by the driver, the sim hosts and Ray: the offered load (engines x
`--tokens-per-s`) is scaled down from a GPU cluster's (~20k tokens/s per H100 engine on a 1-8B policy);
what carries over is the driver's CPU per token and per trajectory, and where it saturates.

    flock /tmp/rollout-engine.lock .venv/bin/python benchmarks/cluster_sim.py
        --engines 8,32,128,256 --report cluster_sim.json
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import itertools
import math
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sim_engine import LengthDist, SimSpec  # noqa: E402
from benchmarks.sim_measure import Collections, rss_bytes, thread_cpu  # noqa: E402
from benchmarks.sim_pool import SimPool  # noqa: E402
from rollout.config import Config, load_config  # noqa: E402
from rollout.driver_process import freeze_heap  # noqa: E402
from rollout.engine import RolloutEngine  # noqa: E402
from rollout.types import Prompt  # noqa: E402


class Options(msgspec.Struct, frozen=True):
    engines: list[int] = msgspec.field(default_factory=lambda: [8, 32, 128, 256])
    spec: SimSpec = SimSpec()
    max_tokens: int = 2048
    prompt_len: int = 128
    n: int = 8
    batch: int = 8
    queued: int = 16  # engines.queued_per_engine: a group holds its slots until its last sample ends
    hosts: int = 4
    warmup: float = 5.0
    duration: float = 20.0
    update_every: float = 5.0  # 0: no updates
    update_with: str = "store"  # "store": a state dict (Ray's object store); "dir": a directory (every call a frame)
    kill: tuple[int, float] | None = None
    stall: tuple[int, float] | None = None
    durable: str | None = None
    profile: bool = False
    freeze: bool = False  # freeze the driver's start-up heap (`rollout.driver_process.freeze_heap`)
    gc_threshold: tuple[int, ...] = ()  # gc.set_threshold for the run; (): Python's
    local: bool = False  # engines in this process (tests): no Ray, and the driver's CPU is not its own


def _event(text: str, flag: str) -> tuple[int, float]:
    engine, at, sec = text.partition("@")
    try:
        e, s = int(engine), float(sec)
    except ValueError:
        raise ValueError(f"{flag}: expected ENGINE@SECONDS, e.g. 3@10, got {text!r}") from None
    if not at or e < 0 or s < 0:
        raise ValueError(f"{flag}: expected ENGINE@SECONDS with both >= 0, got {text!r}")
    return e, s


def check(o: Options) -> None:
    """Raises ValueError naming the flag of the first bad input."""
    s = o.spec
    if not o.engines or any(n < 1 for n in o.engines):
        raise ValueError(f"--engines: every engine count must be >= 1, got {o.engines}")
    for flag, value in (("--tokens-per-s", s.tokens_per_s), ("--ttft", s.ttft_s), ("--load-s", s.load_s),
                        ("--warmup", o.warmup), ("--update-every", o.update_every)):  # fmt: skip
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{flag}: expected a finite number >= 0, got {value}")
    if s.tokens_per_s == 0:
        raise ValueError("--tokens-per-s: expected > 0, got 0")
    if not math.isfinite(o.duration) or o.duration <= 0:
        raise ValueError(f"--duration: expected > 0, got {o.duration}")
    for flag, value in (("--capacity", s.capacity), ("--max-tokens", o.max_tokens), ("--prompt-len", o.prompt_len),
                        ("--n", o.n), ("--batch", o.batch), ("--hosts", o.hosts)):  # fmt: skip
        if value < 1:
            raise ValueError(f"{flag}: expected >= 1, got {value}")
    if o.queued < 0:
        raise ValueError(f"--queued: expected >= 0, got {o.queued}")
    if o.n > s.capacity:
        raise ValueError(f"--n: {o.n} samples cannot run on one engine of --capacity {s.capacity}")
    if not 0 <= s.preempt <= 1:
        raise ValueError(f"--preempt: expected a fraction in [0, 1], got {s.preempt}")
    try:
        LengthDist(s.length)
    except ValueError as e:
        raise ValueError(f"--length: {e}") from None
    for flag, event in (("--kill", o.kill), ("--stall", o.stall)):
        if event is not None and event[0] >= min(o.engines):
            raise ValueError(f"{flag}: engine {event[0]} does not exist with --engines {min(o.engines)}")


class Tally:
    """How many times each prompt came out. An endless run's ids ("q0", "q1", ...) are counted in a
    bytearray by number, not a dict of strings: at ~600 groups/s the dict and the list of ids fed
    grew the benchmark's own heap by ~6 MiB a minute, which read as the driver's RSS growing."""

    def __init__(self) -> None:
        self.numbered = bytearray()  # times "q<i>" came out (up to 255)
        self.named: dict[str, int] = {}  # any other id

    def add(self, prompt_id: str) -> None:
        if prompt_id[:1] == "q" and prompt_id[1:].isdigit():
            i = int(prompt_id[1:])
            if i >= len(self.numbered):
                self.numbered.extend(bytes(max(i + 1 - len(self.numbered), len(self.numbered))))
            self.numbered[i] = min(255, self.numbered[i] + 1)
        else:
            self.named[prompt_id] = self.named.get(prompt_id, 0) + 1

    def count(self, prompt_id: str) -> int:
        if prompt_id[:1] == "q" and prompt_id[1:].isdigit():
            i = int(prompt_id[1:])
            return self.numbered[i] if i < len(self.numbered) else 0
        return self.named.get(prompt_id, 0)

    def missing(self, fed: Any) -> int:
        return sum(self.count(p) == 0 for p in fed)

    def duplicated(self) -> int:
        return sum(c > 1 for c in self.numbered) + sum(c > 1 for c in self.named.values())

    def __len__(self) -> int:
        return sum(c > 0 for c in self.numbered) + len(self.named)


def config(o: Options, engines: int, model_dir: str) -> Config:
    inflight = engines * (o.spec.capacity + o.queued) // o.n + engines  # groups running, with room to refill
    return load_config(None, [
        f"model.path={model_dir}", f"model.max_model_len={o.prompt_len + o.max_tokens + 1}",
        f"engines.count={engines}", f"engines.max_inflight_per_engine={o.spec.capacity}",
        f"engines.queued_per_engine={o.queued}",
        "engines.health_interval_s=2", "engines.health_timeout_s=4", "engines.restart_backoff_s=0",
        f"sampling.n={o.n}", f"sampling.max_tokens={o.max_tokens}", f"queue.max_groups={2 * inflight + o.batch}",
        "logging.level=error", "metrics.port=null", *([f"queue.durable_dir={o.durable}"] if o.durable else []),
    ])  # fmt: skip


def model_dir(root: str, vocab: int) -> str:
    """A model directory with the config and one small tensor: what the driver reads of a model."""
    from safetensors.torch import save_file

    (Path(root) / "config.json").write_text(f'{{"vocab_size": {vocab}}}')
    save_file(WEIGHTS, str(Path(root) / "model.safetensors"))
    return root


def _weights() -> dict[str, Any]:
    import torch

    return {"embed.weight": torch.zeros(16, 8)}


WEIGHTS = _weights()


async def run_one(o: Options, engines: int, prompts: list[Prompt] | None = None) -> dict[str, Any]:
    """One simulated cluster of `engines` engines; `prompts`: feed these (and drain), else an endless
    stream for `--warmup` + `--duration` s, then drain."""
    with tempfile.TemporaryDirectory() as root:
        cfg = config(o, engines, model_dir(root, o.spec.vocab))
        pool = SimPool.start(o.spec, engines, o.hosts, local=o.local)
        await pool.ready()
        async with RolloutEngine(cfg, pool=pool) as engine:
            return await _drive(o, engine, pool, prompts)


async def _drive(o: Options, engine: RolloutEngine, pool: SimPool, prompts: list[Prompt] | None) -> dict[str, Any]:
    ids = list(range(4, 4 + o.prompt_len))
    feeding = asyncio.Event()
    feeding.set()
    fed: list[str] = []  # the ids fed (a finite set), or below, the count of an endless stream's
    endless_fed = 0

    def endless():
        nonlocal endless_fed
        for i in itertools.count():
            if not feeding.is_set():
                return
            endless_fed = i + 1
            yield Prompt(token_ids=ids, id=f"q{i}")

    def finite():
        for p in prompts or []:
            fed.append(p.id)
            yield p

    engine.feed(finite() if prompts is not None else endless())
    out = Tally()
    window = {"tokens": 0, "trajectories": 0, "latency": [], "errors": 0}
    measuring = False
    spans = {"epochs": [], "moved": 0}

    async def learner() -> None:
        async for batch in engine.batches(groups=o.batch):
            now = time.time()
            done = [max(t.finished_at for t in g.trajectories) for g in batch.groups if g.trajectories]
            for g in batch.groups:
                out.add(g.prompt_id)
                for t in g.trajectories:
                    window["errors"] += not t.ok
                    if measuring:
                        window["tokens"] += len(t.token_ids)
                        window["trajectories"] += 1
                    if prompts is not None:
                        spans["epochs"].append((t.policy_epochs, len(t.token_ids)))
            if measuring and done:
                window["latency"].append(now - max(done))

    async def updater() -> None:
        while o.update_every:
            await asyncio.sleep(o.update_every)
            await engine.update_weights(WEIGHTS if o.update_with == "store" else engine.cfg.model.path)

    async def faults() -> None:
        for event, act in sorted(((o.kill, pool.kill), (o.stall, pool.stall)), key=lambda x: x[0][1] if x[0] else 0):
            if event is not None:
                await asyncio.sleep(max(0.0, event[1] - (time.monotonic() - t_start)))
                await act(event[0])

    if o.freeze:
        freeze_heap()
    t_start = time.monotonic()
    rss0 = rss_bytes()
    tasks = [asyncio.ensure_future(f()) for f in (learner, updater, faults)]
    result: dict[str, Any] = {"engines": len(pool.engines)}
    if prompts is None:
        await asyncio.sleep(o.warmup)
        before, cpu0, wall0, threads0 = await pool.counts(), time.process_time(), time.perf_counter(), thread_cpu()
        profiler = cProfile.Profile() if o.profile else None
        collections = Collections()
        measuring = True
        if profiler:
            profiler.enable()
        rss_timeline = []  # the driver's RSS at each tenth of the window, MiB: bounded, or growing?
        for k in range(10):
            await asyncio.sleep(o.duration / 10)
            rss_timeline.append(rss_bytes() / 2**20)
            if k == 4:
                inflight = sum(load.requests for load in engine._scheduler.runner.loads)
        measuring = False
        collections.stop()
        if profiler:
            profiler.disable()
        cpu, wall, after = time.process_time() - cpu0, time.perf_counter() - wall0, await pool.counts()
        rss = rss_bytes()
        threads = thread_cpu()
        result["threads_cpu"] = {k: (v - threads0.get(k, 0.0)) / wall
                                 for k, v in sorted(threads.items(), key=lambda kv: -kv[1])
                                 if v - threads0.get(k, 0.0) > 0.005 * wall}  # fmt: skip
        feeding.clear()
        result.update(_figures(o, len(pool.engines), window, cpu, wall, before, after, inflight, rss - rss0))
        result.update(collections.figures(wall))
        result["rss_timeline_mib"] = rss_timeline
        result["rss_growth_mib"] = (
            sum(rss_timeline[-3:]) / 3 - sum(rss_timeline[:3]) / 3
        )  # the window's last tenths less its first
        if profiler:
            result["profile"] = _top(profiler)
            result["profile_file"] = str(Path(tempfile.gettempdir()) / f"cluster_sim-{len(pool.engines)}.prof")
            profiler.dump_stats(result["profile_file"])  # all of it, for `python -m pstats`
    await asyncio.wait_for(tasks[0], timeout=o.max_tokens / (o.spec.tokens_per_s / o.spec.capacity) + 60)  # the drain
    for t in tasks[1:]:
        if t.done() and t.exception() is not None:  # an update or a fault that failed: the run says so
            raise t.exception()
        t.cancel()
    fed_ids = fed if prompts is not None else (f"q{i}" for i in range(endless_fed))
    result.update(fed=len(fed) if prompts is not None else endless_fed, out=len(out), lost=out.missing(fed_ids),
                  duplicated=out.duplicated(), failed_trajectories=window["errors"], restarts=len(pool.restarts),
                  epoch=engine.epoch)  # fmt: skip
    moved = (await pool.counts()).get("resumed", 0)
    result["resumed_samples"] = int(moved)
    if prompts is not None:
        result["epochs"] = spans["epochs"]
    return result


def _figures(
    o: Options, n: int, w: dict, cpu: float, wall: float, before: dict, after: dict, inflight: int, rss: int
) -> dict[str, Any]:
    lat = sorted(w["latency"]) or [float("nan")]
    toks, trajs = w["tokens"], w["trajectories"]
    return {
        "offered_tok_s": n * o.spec.tokens_per_s,
        "offered_traj_s": n * o.spec.tokens_per_s / LengthDist(o.spec.length).mean(o.max_tokens),
        "tok_s": toks / wall, "traj_s": trajs / wall,
        "engine_tok_s": (after["tokens"] - before["tokens"]) / wall,
        "occupancy": (after["busy"] - before["busy"]) / (n * o.spec.capacity * wall),
        "driver_cpu": cpu / wall, "sim_cpu": (after["cpu_s"] - before["cpu_s"]) / wall,
        "us_per_token": 1e6 * cpu / max(toks, 1), "us_per_traj": 1e6 * cpu / max(trajs, 1),
        "lat_p50_ms": 1e3 * lat[len(lat) // 2], "lat_p99_ms": 1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        "ray_calls_per_group": {k[6:]: o.n * (after[k] - before.get(k, 0)) / max(trajs, 1)
                                for k in after if k.startswith("calls.")},
        "inflight": inflight, "rss_mib": rss / 2**20, "kib_per_inflight": rss / 1024 / max(inflight, 1),
    }  # fmt: skip


def _top(profiler: cProfile.Profile, k: int = 15) -> list[dict[str, Any]]:
    stats = pstats.Stats(profiler, stream=io.StringIO())
    total = sum(v[2] for v in stats.stats.values()) or 1
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:k]
    return [
        {"function": f"{Path(f).name}:{line}({name})", "self_s": v[2], "share": v[2] / total, "calls": v[1]}
        for (f, line, name), v in rows
    ]


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'N':>4} {'offered tok/s':>13} {'tok/s':>9} {'traj/s':>7} {'occup':>5} {'drv cpu':>7} {'sim cpu':>7} "
        f"{'us/tok':>7} {'us/traj':>8} {'p50 ms':>7} {'p99 ms':>7} {'KiB/inflt':>9} {'lost':>4}"
    )
    lines = [head]
    for r in rows:
        lines.append(f"{r['engines']:>4} {r['offered_tok_s']:>13,.0f} {r['tok_s']:>9,.0f} {r['traj_s']:>7,.0f} "
                     f"{r['occupancy']:>5.2f} {r['driver_cpu']:>7.2f} {r['sim_cpu']:>7.2f} {r['us_per_token']:>7.2f} "
                     f"{r['us_per_traj']:>8.0f} {r['lat_p50_ms']:>7.1f} {r['lat_p99_ms']:>7.1f} "
                     f"{r['kib_per_inflight']:>9.1f} {r['lost']:>4}")  # fmt: skip
    return "\n".join(lines)


def parse(argv: list[str] | None) -> tuple[Options, str | None]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--engines", default="8,32,128,256", help="engine counts to sweep, comma-separated")
    p.add_argument("--tokens-per-s", type=float, default=2000.0, help="per engine, when full")
    p.add_argument("--ttft", type=float, default=0.05, help="time to first token, s")
    p.add_argument("--capacity", type=int, default=16, help="sequences one engine decodes at once")
    p.add_argument(
        "--length",
        default="lognormal:150:0.8",
        help="output lengths: fixed:N, uniform:A:B, lognormal:MEDIAN:SIGMA, pareto:MIN:ALPHA",
    )
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--preempt", type=float, default=0.02, help="fraction of samples preempted once")
    p.add_argument("--load-s", type=float, default=0.05, help="each engine's pause per weight update")
    p.add_argument("--update-every", type=float, default=5.0, help="s between weight updates (0: none)")
    p.add_argument("--update-with", choices=("store", "dir"), default="store",
                   help="store: a state dict through Ray's object store (its ObjectRef takes a Ray call per engine); "
                        "dir: a model directory (every call of the update a frame on the data path, "
                        "as the trainer API's)")  # fmt: skip
    p.add_argument("--queued", type=int, default=None, help="engines.queued_per_engine (default: --capacity)")
    p.add_argument("--batch", type=int, default=8, help="groups per learner batch")
    p.add_argument("--hosts", type=int, default=4, help="Ray actors simulating the engines")
    p.add_argument("--warmup", type=float, default=8.0)
    p.add_argument("--duration", type=float, default=20.0, help="measured window, s")
    p.add_argument("--kill", help="ENGINE@SECONDS: that engine dies then")
    p.add_argument("--stall", help="ENGINE@SECONDS: that engine stops answering then")
    p.add_argument("--durable", help="queue.durable_dir for the run")
    p.add_argument("--profile", action="store_true", help="cProfile the driver during the window (slows it)")
    p.add_argument("--freeze", action="store_true", help="gc.freeze() the driver's heap once its engines started")
    p.add_argument("--gc-threshold", default="", help="gc.set_threshold(A[,B[,C]]) for the run")
    p.add_argument("--report", help="write the JSON report here")
    a = p.parse_args(argv)
    try:
        engines = [int(x) for x in a.engines.split(",")]
    except ValueError:
        raise ValueError(f"--engines: expected comma-separated integers, got {a.engines!r}") from None
    try:
        threshold = tuple(int(x) for x in a.gc_threshold.split(",")) if a.gc_threshold else ()
    except ValueError:
        raise ValueError(f"--gc-threshold: expected up to 3 comma-separated integers, got {a.gc_threshold!r}") from None
    if len(threshold) > 3 or any(x < 0 for x in threshold):
        raise ValueError(f"--gc-threshold: expected up to 3 integers >= 0, got {a.gc_threshold!r}")
    spec = SimSpec(
        tokens_per_s=a.tokens_per_s,
        ttft_s=a.ttft,
        capacity=a.capacity,
        length=a.length,
        preempt=a.preempt,
        load_s=a.load_s,
    )
    o = Options(engines=engines, spec=spec, max_tokens=a.max_tokens, prompt_len=a.prompt_len, n=a.n, batch=a.batch,
                queued=a.capacity if a.queued is None else a.queued, hosts=a.hosts, warmup=a.warmup,
                duration=a.duration, update_every=a.update_every, update_with=a.update_with, durable=a.durable,
                profile=a.profile, freeze=a.freeze, gc_threshold=threshold,
                kill=_event(a.kill, "--kill") if a.kill else None,
                stall=_event(a.stall, "--stall") if a.stall else None)  # fmt: skip
    check(o)
    return o, a.report


def main(argv: list[str] | None = None) -> int:
    try:
        o, report = parse(argv)
    except ValueError as e:
        print(f"cluster_sim: {e}", file=sys.stderr)
        return 2
    import ray

    from actors.cluster import connect

    connect(config(o, max(o.engines), "."))
    if o.gc_threshold:
        gc.set_threshold(*o.gc_threshold)
    rows: list[dict[str, Any]] = []

    async def sweep() -> None:
        for n in o.engines:
            rows.append(await run_one(o, n))
            print(table(rows[-1:]).splitlines()[-1], flush=True)

    try:
        asyncio.run(sweep())
    finally:
        ray.shutdown()
    print(table(rows))
    for r in rows:
        print(
            f"  N={r['engines']}: Ray calls per group: "
            + ", ".join(f"{k} {v:.2f}" for k, v in r.get("ray_calls_per_group", {}).items())
        )
        print(
            f"  N={r['engines']}: driver threads, cores: "
            + ", ".join(f"{k} {v:.2f}" for k, v in r.get("threads_cpu", {}).items())
        )
        if "rss_timeline_mib" in r:
            print(
                f"  N={r['engines']}: driver RSS over the window, MiB: "
                + " ".join(f"{v:.0f}" for v in r["rss_timeline_mib"])
                + f" (last tenths less first: {r['rss_growth_mib']:+.1f})"
            )
        if "gc_collections" in r:
            print(
                f"  N={r['engines']}: garbage collections (gen 0/1/2): {'/'.join(map(str, r['gc_collections']))}, "
                f"{r['gc_share']:.1%} of the wall time, longest full {r['gc_full_max_ms']:.0f} ms"
            )
        for p in r.get("profile", []):
            print(f"  N={r['engines']}: {p['share']:6.1%} {p['self_s']:7.3f}s {p['calls']:>9} {p['function']}")
        if "profile_file" in r:
            print(f"  N={r['engines']}: the whole profile: python -m pstats {r['profile_file']}")
    if report:
        Path(report).write_text(msgspec.json.encode({"options": o, "runs": rows}).decode())
    return 0 if all(r["lost"] == 0 and r["duplicated"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
