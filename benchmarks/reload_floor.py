"""The floor under every weight-update path: vLLM's own layerwise reload, fed tensors already in the
model worker's memory, against one plain memcpy of the same bytes, in the same process; for one
engine alone and for N engines loading at once (what an update to N engines waits for).

Each engine in its own process, in-process vLLM (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, eager): the
worker extension below loads the model's safetensors into memory, then times
`reload_weights(weights_iterator=...)` (what a weight-transfer engine feeds, minus any transfer),
`reload_weights(weights_path=...)` from a copy in /dev/shm (what the object-store path ends
with), and one memcpy into touched memory; with N engines every step starts at a barrier across
them and the floor is the slowest engine's. Repeats each `--repeats` times and prints the medians
and ratios; a JSON report too. Then the transport's floor: the shm backend's ring (`policies.shm_transfer`) to two
workers' staging, and the gloo backend's pair groups (`policies.gloo_transfer`) over loopback TCP
to one worker into touched and into fresh buffers (what a staging receive gets), and to two
workers side by side; the workers as threads of this process.

    python benchmarks/reload_floor.py --size 0.5B --engines 1,2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class FloorWorker:
    """Worker extension: times vLLM's reload from memory and from a directory, and a memcpy."""

    def rollout_floor(self, path: str, shm_dir: str, repeats: int, barrier: Any) -> dict[str, Any]:
        import torch
        from safetensors.torch import load_file

        weights = load_file(f"{path}/model.safetensors")
        dst = {n: torch.empty_like(t) for n, t in weights.items()}
        out: dict[str, list[float]] = {"memcpy_s": [], "reload_memory_s": [], "reload_dir_s": []}
        for n, t in weights.items():
            dst[n].copy_(t)
        self.reload_weights(weights_iterator=iter(weights.items()))  # type: ignore[attr-defined]  # warm-up
        for _ in range(repeats):
            barrier.wait()  # every engine's step starts together
            start = time.perf_counter()
            for n, t in weights.items():
                dst[n].copy_(t)
            out["memcpy_s"].append(time.perf_counter() - start)
            barrier.wait()
            start = time.perf_counter()
            self.reload_weights(weights_iterator=iter(weights.items()))  # type: ignore[attr-defined]
            out["reload_memory_s"].append(time.perf_counter() - start)
            barrier.wait()
            start = time.perf_counter()
            self.reload_weights(weights_path=shm_dir)  # type: ignore[attr-defined]
            out["reload_dir_s"].append(time.perf_counter() - start)
        return {**out, "bytes": sum(t.numel() * t.element_size() for t in weights.values())}


def gloo_loopback(nbytes: int, bucket_bytes: int = 64 << 20) -> dict[str, float]:
    """Seconds to broadcast `nbytes` from a trainer to 1 or 2 gloo pair groups (every receive
    posted at once, as `GlooWeightTransferEngine` does), and of one memcpy into fresh pages."""
    import threading

    import torch

    from policies.gloo_transfer import broadcast, pair_group, tcp_store

    n = max(1, nbytes // bucket_bytes)
    src = torch.ones(n * bucket_bytes, dtype=torch.uint8)

    def run(pairs: int, touched: bool) -> float:
        store, session, go = (
            tcp_store("127.0.0.1", 0, 300.0, master=True),
            f"floor-{pairs}-{touched}",
            threading.Event(),
        )

        def worker(r: int) -> None:
            pg = pair_group(tcp_store("127.0.0.1", store.port, 300.0), session, r, 300.0, trainer=False)
            bufs = [
                torch.zeros(bucket_bytes, dtype=torch.uint8)
                if touched
                else torch.empty(bucket_bytes, dtype=torch.uint8)
                for _ in range(n)
            ]
            go.wait()
            for w in [broadcast(pg, b) for b in bufs]:
                w.wait()

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(1, pairs + 1)]
        for t in threads:
            t.start()
        pgs = [pair_group(store, session, r, 300.0, trainer=True) for r in range(1, pairs + 1)]
        go.set()
        start = time.perf_counter()
        sending = [[broadcast(pg, src[k * bucket_bytes : (k + 1) * bucket_bytes]) for pg in pgs] for k in range(n)]
        for works in sending:
            for w in works:
                w.wait()
        for t in threads:
            t.join()
        return time.perf_counter() - start

    start = time.perf_counter()
    torch.empty_like(src).copy_(src)
    fresh = time.perf_counter() - start
    return {"bytes": n * bucket_bytes, "memcpy_fresh_s": fresh, "gloo_1_touched_s": run(1, True),
            "gloo_1_fresh_s": run(1, False), "gloo_2_fresh_s": run(2, False)}  # fmt: skip


def shm_ring(nbytes: int, workers: int = 2, slot_bytes: int = 64 << 20) -> dict[str, float]:
    """Seconds to move `nbytes` through the shm backend's ring (`policies.shm_transfer`: the real
    trainer and worker engines, the workers as threads of this process, no model) to `workers`
    workers' staging, round 1 into fresh staging pages, round 2 into the same (touched) ones."""
    import types
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from benchmarks.weight_plane import ShmPeak
    from policies.gloo_transfer import StateDictSource
    from policies.shm_transfer import ShmTrainerInitInfo, ShmWeightTransferEngine

    n = max(1, nbytes // slot_bytes)
    weights = {f"t{k}": torch.ones(slot_bytes, dtype=torch.uint8) for k in range(n)}
    cfg = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0), model_config=None
    )
    ws = [
        ShmWeightTransferEngine(types.SimpleNamespace(backend="shm"), cfg, torch.device("cpu"), None)
        for _ in range(workers)
    ]
    pool = ThreadPoolExecutor(workers)

    class Client:  # vLLM's four calls over the in-process workers; update_weights only starts their drains
        def init_weight_transfer_engine(self, info: dict) -> None:
            list(
                pool.map(
                    lambda k: ws[k].init_transfer_engine(ws[k].parse_init_info({**info, "rank_offset": 1 + k})),
                    range(workers),
                )
            )

        def start_weight_update(self) -> None: ...

        def update_weights(self, info: dict) -> None:
            for w in ws:
                w.update_weights(info)

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            for w in ws:
                w.pending[0].join()  # staged: the load is not the transport's
                w.pending = None

    peak = ShmPeak()
    init = ShmTrainerInitInfo(world_size=1 + workers, rank=0, slot_bytes=slot_bytes)
    trainer = WeightTransferTrainerFactory.trainer_init(init, client=Client(), source=StateDictSource(weights))
    out: dict[str, float] = {"bytes": n * slot_bytes}
    for what in ("fresh", "touched"):
        start = time.perf_counter()
        trainer.send_weights()
        out[f"shm_{workers}_{what}_s"] = time.perf_counter() - start
    trainer.shutdown()
    out["shm_peak_bytes"], out["shmem_peak_bytes"] = peak.stop()
    for w in ws:
        w.shutdown()
    return out


def engine(path: str, shm_dir: str, repeats: int, barrier: Any, results: Any) -> None:
    """One engine's floor (a process of its own: its vLLM runs in-process)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    llm = LLM(model=path, dtype="bfloat16", enforce_eager=True, max_model_len=512, skip_tokenizer_init=True,
              worker_extension_cls="benchmarks.reload_floor.FloorWorker")  # fmt: skip
    results.put(llm.collective_rpc("rollout_floor", args=(path, shm_dir, repeats, barrier))[0])


def floors(path: Path, count: int, repeats: int) -> dict[str, Any]:
    """`count` engines timing the floor at once: per step the medians over repeats of the slowest
    engine's seconds."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(count), ctx.Queue()
    shm_dir = tempfile.mkdtemp(prefix="rollout-floor-", dir="/dev/shm")
    try:
        shutil.copy(path / "model.safetensors", shm_dir)
        shutil.copy(path / "config.json", shm_dir)
        procs = [ctx.Process(target=engine, args=(str(path), shm_dir, repeats, barrier, results)) for _ in range(count)]
        for p in procs:
            p.start()
        got = [results.get() for _ in procs]
        for p in procs:
            p.join()
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    steps = [k for k, v in got[0].items() if isinstance(v, list)]
    return {"engines": count, "bytes": got[0]["bytes"], "runs": got,
            "median": {k: statistics.median(max(r[k][i] for r in got) for i in range(repeats))
                       for k in steps}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from benchmarks.weight_plane import SIZES, build_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.5B", choices=list(SIZES))
    ap.add_argument(
        "--engines",
        default="1,2",
        help="comma-separated engine counts, each loading at once ('' none: the transports only)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-transport", action="store_true", help="skip the transports' floor (shm ring, gloo loopback)")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "rollout"))
    ap.add_argument("--report", default="reload_floor_report.json")
    args = ap.parse_args(argv)
    path = build_model(args.size, Path(args.cache))
    report: dict[str, Any] = {"size": args.size, "floors": []}
    for count in (int(n) for n in args.engines.split(",") if n):
        f = floors(path, count, args.repeats)
        report["floors"].append(f)
        med = f["median"]
        print(f"{args.size}: {f['bytes'] / 2**30:.2f} GiB, {count} engine(s) at once: memcpy {med['memcpy_s']:.3f} s  "
              f"reload from memory {med['reload_memory_s']:.3f} s ({med['reload_memory_s'] / med['memcpy_s']:.1f}x)  "
              f"reload from /dev/shm {med['reload_dir_s']:.3f} s ({med['reload_dir_s'] / med['memcpy_s']:.1f}x)",
              flush=True)  # fmt: skip
    if not args.no_transport:
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), "pt") as f:
            nbytes = sum(math.prod(f.get_slice(k).get_shape()) * 2 for k in f.keys())  # bf16
        r = report["shm_ring"] = shm_ring(nbytes)
        gb = r["bytes"] / 1e9
        print(f"shm ring, {r['bytes'] / 2**30:.2f} GiB to 2 workers' staging: {r['shm_2_fresh_s']:.3f} s "
              f"into fresh pages ({2 * gb / r['shm_2_fresh_s']:.2f} GB/s in all), {r['shm_2_touched_s']:.3f} s "
              f"into touched ({2 * gb / r['shm_2_touched_s']:.2f} GB/s); peak /dev/shm "
              f"{r['shm_peak_bytes'] / 2**20:.0f} MiB, shmem {r['shmem_peak_bytes'] / 2**20:.0f} MiB "
              "(the ring: 4 x 64 MiB)")  # fmt: skip
        g = report["gloo_loopback"] = gloo_loopback(nbytes)
        gb = g["bytes"] / 1e9
        print(f"gloo loopback, {g['bytes'] / 2**30:.2f} GiB: 1 worker {g['gloo_1_touched_s']:.3f} s "
              f"into touched memory ({gb / g['gloo_1_touched_s']:.2f} GB/s), {g['gloo_1_fresh_s']:.3f} s into fresh "
              f"({gb / g['gloo_1_fresh_s']:.2f} GB/s); "
              f"2 workers side by side {g['gloo_2_fresh_s']:.3f} s ({2 * gb / g['gloo_2_fresh_s']:.2f} GB/s in all); "
              f"memcpy into fresh pages {g['memcpy_fresh_s']:.3f} s")  # fmt: skip
    Path(args.report).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
