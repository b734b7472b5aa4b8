"""The floor under every weight-update path: vLLM's own layerwise reload, fed tensors already in the
model worker's memory, against one plain memcpy of the same bytes, in the same process.

One engine in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, eager): the worker extension below
loads the model's safetensors into memory, then times `reload_weights(weights_iterator=...)`
(what a weight-transfer engine feeds, minus any transfer) and `reload_weights(weights_path=...)` from a
copy in /dev/shm (what the object-store path ends with), and one memcpy into touched memory.
Repeats each `--repeats` times and prints the medians and ratios; a JSON report too. Then the
transport's floor: the gloo backend's pair groups (`policies.gloo_transfer`, the workers as
threads of this process) moving the same bytes over loopback TCP to one worker into touched and
into fresh buffers (what a staging receive gets), and to two workers side by side.

    python benchmarks/reload_floor.py --size 0.5B
"""

from __future__ import annotations

import argparse
import json
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

    def rollout_floor(self, path: str, shm_dir: str, repeats: int) -> dict[str, Any]:
        import torch
        from safetensors.torch import load_file

        weights = load_file(f"{path}/model.safetensors")
        dst = {n: torch.empty_like(t) for n, t in weights.items()}
        out: dict[str, list[float]] = {"memcpy_s": [], "reload_memory_s": [], "reload_dir_s": []}
        for n, t in weights.items():
            dst[n].copy_(t)
        self.reload_weights(weights_iterator=iter(weights.items()))  # type: ignore[attr-defined]  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            for n, t in weights.items():
                dst[n].copy_(t)
            out["memcpy_s"].append(time.perf_counter() - start)
            start = time.perf_counter()
            self.reload_weights(weights_iterator=iter(weights.items()))  # type: ignore[attr-defined]
            out["reload_memory_s"].append(time.perf_counter() - start)
            start = time.perf_counter()
            self.reload_weights(weights_path=shm_dir)  # type: ignore[attr-defined]
            out["reload_dir_s"].append(time.perf_counter() - start)
        return {**out, "bytes": sum(t.numel() * t.element_size() for t in weights.values())}


def gloo_loopback(nbytes: int, bucket_bytes: int = 64 << 20) -> dict[str, float]:
    """Seconds to broadcast `nbytes` from a trainer to 1 or 2 gloo pair groups (every receive
    posted at once, as `GlooWeightTransferEngine` does), and of one memcpy into fresh pages."""
    import threading

    import torch

    from policies.gloo_transfer import _broadcast, _pair, _store

    n = max(1, nbytes // bucket_bytes)
    src = torch.ones(n * bucket_bytes, dtype=torch.uint8)

    def run(pairs: int, touched: bool) -> float:
        store, session, go = _store("127.0.0.1", 0, 300.0, master=True), f"floor-{pairs}-{touched}", threading.Event()

        def worker(r: int) -> None:
            pg = _pair(_store("127.0.0.1", store.port, 300.0), session, r, 300.0, trainer=False)
            bufs = [torch.zeros(bucket_bytes, dtype=torch.uint8) if touched else torch.empty(bucket_bytes, dtype=torch.uint8) for _ in range(n)]
            go.wait()
            for w in [_broadcast(pg, b) for b in bufs]:
                w.wait()

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(1, pairs + 1)]
        for t in threads:
            t.start()
        pgs = [_pair(store, session, r, 300.0, trainer=True) for r in range(1, pairs + 1)]
        go.set()
        start = time.perf_counter()
        sending = [[_broadcast(pg, src[k * bucket_bytes : (k + 1) * bucket_bytes]) for pg in pgs] for k in range(n)]
        for works in sending:
            for w in works:
                w.wait()
        for t in threads:
            t.join()
        return time.perf_counter() - start

    start = time.perf_counter()
    torch.empty_like(src).copy_(src)
    fresh = time.perf_counter() - start
    return {"bytes": n * bucket_bytes, "memcpy_fresh_s": fresh, "gloo_1_touched_s": run(1, True), "gloo_1_fresh_s": run(1, False),
            "gloo_2_fresh_s": run(2, False)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from benchmarks.weight_plane import SIZES, build_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.5B", choices=list(SIZES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "rollout"))
    ap.add_argument("--report", default="reload_floor_report.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    path = build_model(args.size, Path(args.cache))
    shm_dir = tempfile.mkdtemp(prefix="rollout-floor-", dir="/dev/shm")
    try:
        shutil.copy(path / "model.safetensors", shm_dir)
        shutil.copy(path / "config.json", shm_dir)
        llm = LLM(model=str(path), dtype="bfloat16", enforce_eager=True, max_model_len=512, skip_tokenizer_init=True,
                  worker_extension_cls="benchmarks.reload_floor.FloorWorker")  # fmt: skip
        r = llm.collective_rpc("rollout_floor", args=(str(path), shm_dir, args.repeats))[0]
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in r.items() if isinstance(v, list)}
    print(f"{args.size}: {r['bytes'] / 2**30:.2f} GiB  memcpy {med['memcpy_s']:.3f} s  "
          f"reload from memory {med['reload_memory_s']:.3f} s ({med['reload_memory_s'] / med['memcpy_s']:.1f}x)  "
          f"reload from /dev/shm {med['reload_dir_s']:.3f} s ({med['reload_dir_s'] / med['memcpy_s']:.1f}x)")  # fmt: skip
    g = gloo_loopback(r["bytes"])
    gb = g["bytes"] / 1e9
    print(f"gloo loopback, {g['bytes'] / 2**30:.2f} GiB: 1 worker {g['gloo_1_touched_s']:.3f} s into touched memory "
          f"({gb / g['gloo_1_touched_s']:.2f} GB/s), {g['gloo_1_fresh_s']:.3f} s into fresh ({gb / g['gloo_1_fresh_s']:.2f} GB/s); "
          f"2 workers side by side {g['gloo_2_fresh_s']:.3f} s ({2 * gb / g['gloo_2_fresh_s']:.2f} GB/s in all); "
          f"memcpy into fresh pages {g['memcpy_fresh_s']:.3f} s")  # fmt: skip
    Path(args.report).write_text(json.dumps({"size": args.size, **r, "median": med, "gloo_loopback": g}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
