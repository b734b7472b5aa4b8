"""The worst event-loop stall `rollout serve` causes while it reads huge request bodies.

What it measures: a probe task on the engine's event loop (the loop the server, the scheduler and
every other client share) sleeps 10 ms in a loop and records the largest overshoot; meanwhile
`--big` chat requests of `--mib` MiB each (under `serve.max_body_bytes`, one user message of
'x's: far over the context) are sent at once from client threads, and one small chat request
right after them. Reported: the worst stall, when each big request was answered (400, over the
context) and how long the small one took. Bodies tokenized on the loop
(10.8 s for 7 MiB on this VM); now they are prepared in worker threads and refused by a character
bound before tokenizing.

    python benchmarks/serve_stall.py [CONFIG] [--mib 7] [--big 1 4] [-o key=value ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import anyio
import httpx
import msgspec

from rollout import RolloutEngine
from rollout.config import load_config

ROOT = Path(__file__).resolve().parent.parent


async def probe(stop: anyio.Event, worst: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await anyio.sleep(0.01)
        worst[0] = max(worst[0], time.perf_counter() - t - 0.01)


def post(url: str, body: bytes, out: list, started: float) -> None:
    r = httpx.post(
        f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=600
    )
    out.append((r.status_code, time.perf_counter() - started))


async def round_(url: str, big: int, body: bytes, small: bytes) -> dict:
    worst, stop, answers, small_answer = [0.0], anyio.Event(), [], []
    async with anyio.create_task_group() as tg:
        tg.start_soon(probe, stop, worst)
        await anyio.sleep(0.2)
        started = time.perf_counter()
        threads = [threading.Thread(target=post, args=(url, body, answers, started)) for _ in range(big)]
        threads.append(threading.Thread(target=post, args=(url, small, small_answer, started)))
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            await anyio.sleep(0.05)
        stop.set()
    return {"big": big, "worst_stall_s": round(worst[0], 3),
            "big_answered_s": [round(s, 2) for _, s in sorted(answers, key=lambda a: a[1])],
            "big_status": sorted({c for c, _ in answers}), "small_s": round(small_answer[0][1], 3),
            "small_status": small_answer[0][0]}  # fmt: skip


async def main(args: argparse.Namespace) -> list[dict]:
    cfg = load_config(args.config, ["engines.count=1", "logging.level=warning", *args.override])
    body = msgspec.json.encode(
        {"messages": [{"role": "user", "content": "x" * int(args.mib * 2**20)}], "max_tokens": 4}
    )
    small = msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    async with RolloutEngine(cfg) as engine:
        server = await engine.serve(port=0)
        await round_(server.url, 0, body, small)  # warm: the first request's imports and compilation
        return [await round_(server.url, big, body, small) for big in args.big]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", default=str(ROOT / "configs" / "tiny.yaml"))
    parser.add_argument("--mib", type=float, default=7.0)
    parser.add_argument("--big", type=int, nargs="+", default=[1, 4])
    parser.add_argument("-o", "--override", action="append", default=[])
    parser.add_argument("--json", default="serve_stall.json")
    args = parser.parse_args()
    rows = anyio.run(main, args)
    print(
        f"{'big bodies':>10} {'worst loop stall s':>19} {'big answered at s':>24} {'status':>7} {'small request s':>16}"
    )
    for r in rows:
        print(
            f"{r['big']:>10} {r['worst_stall_s']:>19} {str(r['big_answered_s']):>24} {str(r['big_status']):>7} "
            f"{r['small_s']:>16}"
        )
    Path(args.json).write_text(json.dumps({"mib": args.mib, "rows": rows}, indent=1))
