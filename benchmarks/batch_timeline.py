"""Where a `rollout bench` round's time goes: per-process CPU over each side, and engine 0's
running batch every 0.5 s on the engine side, next to what the driver counts on each engine.

Runs the bench's warm-up and 2 rounds (engine side, raw vLLM side, alternating) on configs/tiny.yaml
with the given dotted overrides, and prints per side: wall time, tokens/s, mean running batch and
waiting, and CPU seconds by process (driver, VLLMPolicy = the engine actors' front-ends,
EngineCore, other = vLLM's model workers; `others:` = processes not of this run). On the engine
side each line of the timeline reads: engine 0's clock, its mean running and waiting requests since
the line before, requests the driver counts on engine 0 / engine 1, and the learner's queue
(finished + running groups). A gap between lines is a Ray call into a busy engine actor.

    flock /tmp/rollout-engine.lock .venv/bin/python benchmarks/batch_timeline.py
        prompts.count=1024 logging.level=warning
"""

import asyncio
import collections
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.rounds import alternating
from policies.shm import descendants
from rollout.bench import run as bench
from rollout.bench.progress import Progress
from rollout.config import load_config
from rollout.driver_process import freeze_heap
from rollout.engine import RolloutEngine

TICK = os.sysconf("SC_CLK_TCK")
NAMES = ("EngineCore", "VLLMPolicy", "raylet", "gcs_server", "IDLE", "pytest", "dashboard", "Dashboard", "monitor")


def cpu_times() -> dict[int, tuple[str, float]]:
    """Every process now: pid -> (command line, CPU seconds so far)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:80]
        except OSError:
            continue
        f = stat.rsplit(")", 1)[1].split()
        out[int(pid)] = (cmd, (int(f[11]) + int(f[12])) / TICK)
    return out


def kind(pid: int, cmd: str) -> str:
    if pid == os.getpid():
        return "driver"
    return next((k for k in NAMES if k in cmd), "other")


def cpu_by_kind(before: dict, after: dict, mine: set[int]) -> dict[str, float]:
    acc: collections.Counter = collections.Counter()
    for pid, (cmd, t) in after.items():
        acc[("" if pid in mine else "others:") + kind(pid, cmd)] += t - before.get(pid, (cmd, 0.0))[1]
    return {k: round(v, 2) for k, v in acc.most_common() if v > 0.05}


async def timeline(engine: RolloutEngine) -> None:
    e0, runner, window = engine.pool.engines[0], engine._live_scheduler().runner, engine.metrics_window()
    prev = await e0.batch()
    t0 = prev[2]
    while True:
        await asyncio.sleep(0.5)
        cur, figures = await e0.batch(), await window.read()
        ready, depth = int(figures["rollout/queue_ready"]), int(figures["rollout/queue_depth"])
        dt = max(cur[2] - prev[2], 1e-9)
        print(f"    {cur[2] - t0:5.1f}s run {(cur[0] - prev[0]) / dt:5.0f} wait {(cur[1] - prev[1]) / dt:5.0f} "
              f"driver {runner.loads[0].requests:4d}/{runner.loads[1].requests:4d} queue {ready}+{depth - ready}",
              flush=True)  # fmt: skip
        prev = cur


async def main() -> None:
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml", sys.argv[1:])
    async with RolloutEngine(cfg) as engine:
        prompts = await bench._read_prompts(cfg, engine.limits.vocab_size)
        await bench._warm_up(engine, cfg, Progress("warm-up", enabled=False))
        freeze_heap()
        mine = descendants(os.getpid()) | {os.getpid()}
        same: list = []
        for r, order in alternating(2, ["engine", "raw"]):
            for side in order:
                await bench._reset_prefix_caches(engine)
                b0, before, start = await bench._batch(engine), cpu_times(), time.time()
                if side == "engine":
                    watch = asyncio.ensure_future(timeline(engine))
                    engine.feed(iter(prompts))
                    groups = [g async for g in engine.groups()]
                    watch.cancel()
                    same = same or [g.prompt for g in groups]
                    tokens = sum(len(t.token_ids) for g in groups for t in g.trajectories)
                else:
                    tokens = (await bench._raw_baseline(engine, cfg, same))["generated_tokens"]
                elapsed, after = time.time() - start, cpu_times()
                mb = bench._mean_batch(b0, await bench._batch(engine))
                print(f"round {r + 1} {side}: {elapsed:.2f} s, {tokens / elapsed:.0f} tokens/s, "
                      f"running {mb['mean_running']:.1f}, waiting {mb['mean_waiting']:.1f}, "
                      f"CPU s {cpu_by_kind(before, after, mine)}", flush=True)  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
