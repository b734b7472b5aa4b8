"""What one weight update costs on a real model, by source: Ray's object store vs vLLM's trainer API
(through our `gloo` or `shm` backend), against vLLM's reload floor for the same engines, same run.

For each model size: build (once, cached) a random Llama of about that many parameters in bf16
with transformers' config and safetensors (byte-level tokenizer of the tiny model), start
`engines.count` engines (eager, small KV cache, idle), then per method and repeat push the
model's own weights back and time:
- update: the learner's call (`engine.update_weights(state_dict)` for the object store; for
  `gloo` and `shm`, vLLM's trainer factory's engine of that backend, `send_weights()` through
  `engine.weight_sync_client()`, the engines started with that backend) until every engine serves
  the new epoch;
- stall: pause -> resume of the slowest engine (`UpdateStats.stall_s`);
- memcpy: one plain copy of the same bytes into a preallocated, already touched buffer, in this
  process, in the same run (the physical floor of moving the bytes once on this machine);
- prepare / load phase: the update's split at the first pause (`UpdateStats.prepare_s`, `.seconds`);
- /dev/shm: the peak of `/dev/shm` usage above its level before the update, and shmem: of the
  machine's shared memory (`Shmem` in /proc/meminfo: /dev/shm and anonymous shared files, such as
  the shm backend's ring), sampled every 5 ms;
- send (gloo, shm): the learner's call less vLLM's start / update / finish calls: its send of
  the bytes, while the engines stage them.
Then, after the engines are gone, vLLM's reload floor (`benchmarks/reload_floor.py`) for one engine
alone and for `--engines` engines loading at once, and update / floor and stall / floor against the
latter. Reports medians over the repeats, one table, and a JSON report.

    python benchmarks/weight_plane.py --sizes 0.5B --methods shm,gloo,store --repeats 3
    python benchmarks/weight_plane.py --sizes 250M,1B --methods shm --repeats 3 --no-floor
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout.config import load_config  # noqa: E402
from rollout.engine import RolloutEngine  # noqa: E402

# hidden, intermediate, layers, heads, kv heads: Llama shapes of about the named size (vocab 260)
SIZES = {
    "60M": (768, 2048, 10, 12, 4),
    "250M": (1024, 3072, 20, 8, 4),
    "0.5B": (1536, 4096, 20, 12, 4),
    "1B": (2048, 5632, 23, 16, 4),
}


def build_model(size: str, root: Path) -> Path:
    """A random bf16 Llama of `size` (cached in `root`)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from rollout.tiny import TinySpec, build_tiny

    out = root / f"bench-llama-{size}"
    if (out / "DONE").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    hidden, inter, layers, heads, kv = SIZES[size]
    tiny = build_tiny(TinySpec())
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / f, out / f)
    cfg = LlamaConfig(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=260, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, torch_dtype="bfloat16",
    )  # fmt: skip
    cfg.save_pretrained(out)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in LlamaForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    weights = {
        n: torch.ones(s, dtype=torch.bfloat16)
        if n.endswith("norm.weight")
        else (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16)
        for n, s in shapes.items()
    }
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "DONE").write_text("")
    return out


def shmem() -> int:
    """The machine's shared memory in bytes (`Shmem`: /dev/shm, memfd files, shared anonymous maps)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("Shmem:"))


class ShmPeak:
    """Peak /dev/shm usage and shmem above their levels at start, sampled every 5 ms in a thread."""

    def __init__(self) -> None:
        self.base, self.base_shmem = shutil.disk_usage("/dev/shm").used, shmem()
        self.peak = self.peak_shmem = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):  # a measurement's sampling period, not a synchronisation
            self.peak = max(self.peak, shutil.disk_usage("/dev/shm").used - self.base)
            self.peak_shmem = max(self.peak_shmem, shmem() - self.base_shmem)

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peak, self.peak_shmem


async def transfer_update(
    engine: RolloutEngine, weights: dict[str, Any], method: str, bucket_bytes: int = 64 << 20
) -> Any:
    """An update function sending through vLLM's trainer API: its trainer factory builds our `gloo`
    (`policies.gloo_transfer`) or `shm` (`policies.shm_transfer`) engine over
    `engine.weight_sync_client()`; returns the new epoch."""
    import anyio
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from policies.gloo_transfer import GlooTrainerInitInfo, StateDictSource
    from policies.shm_transfer import ShmTrainerInitInfo

    client, source = TimedClient(engine.weight_sync_client()), StateDictSource(weights)
    world = 1 + client.world_size()
    init = (GlooTrainerInitInfo(world_size=world, rank=0, bucket_bytes=bucket_bytes, timeout_s=600) if method == "gloo"
            else ShmTrainerInitInfo(world_size=world, rank=0, slot_bytes=bucket_bytes, timeout_s=600))  # fmt: skip
    trainer = await anyio.to_thread.run_sync(
        lambda: WeightTransferTrainerFactory.trainer_init(init, client=client, source=source)
    )

    async def update(w: dict[str, Any]) -> int:
        source.update(w)
        await anyio.to_thread.run_sync(trainer.send_weights)
        return engine.epoch

    update.calls = client.last  # type: ignore[attr-defined]
    return update


class TimedClient:
    """The weight-sync client, timing vLLM's start / update / finish calls (`last`: seconds each,
    last round), so the learner's send (the rest of its call) shows apart."""

    TIMED = ("start_weight_update", "update_weights", "finish_weight_update")

    def __init__(self, client: Any):
        self.client, self.last = client, {}

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.client, name)
        if name not in self.TIMED:
            return fn

        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.last[name] = time.perf_counter() - start

        return timed


def memcpy_s(weights: dict[str, Any]) -> float:
    """One copy of every byte into a preallocated, already touched buffer."""
    import torch

    dst = {n: torch.empty_like(t) for n, t in weights.items()}
    for n, t in weights.items():
        dst[n].copy_(t)  # touch the pages first: the floor is the copy, not the page faults
    start = time.perf_counter()
    for n, t in weights.items():
        dst[n].copy_(t)
    return time.perf_counter() - start


async def bench_size(size: str, methods: list[str], repeats: int, args: argparse.Namespace) -> dict[str, Any]:
    from safetensors.torch import load_file

    path = build_model(size, Path(args.cache))
    weights = load_file(str(path / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    out: dict[str, Any] = {
        "size": size,
        "params": sum(t.numel() for t in weights.values()),
        "bytes": nbytes,
        "methods": {},
    }
    # engines start with one weight-transfer backend: one start per backend, the object store on the first
    backends = [m for m in methods if m != "store"] or ["shm"]
    for backend in backends:
        overrides = [
            f"model.path={path}", "model.dtype=bfloat16", "model.max_model_len=512", f"engines.count={args.engines}",
            f"engines.vllm={{kv_cache_gib: 0.25, enforce_eager: true, weight_transfer_config: {{backend: {backend}}}}}",
            "logging.level=warning", "weight_sync.timeout_s=600",
        ]  # fmt: skip
        here = [m for m in methods if m == backend or (m == "store" and backend == backends[0])]
        async with RolloutEngine(load_config(args.config, overrides)) as engine:
            for method in here:
                update = (
                    engine.update_weights
                    if method == "store"
                    else await transfer_update(engine, weights, method, args.bucket_mb << 20)
                )
                await update(weights)  # warm-up: first-use costs (groups, ring, staging) are not the figure
                runs = []
                for _ in range(repeats):
                    copy = memcpy_s(weights)
                    shm = ShmPeak()
                    start = time.perf_counter()
                    await update(weights)
                    seconds = time.perf_counter() - start
                    u = engine.weight_updates[-1]
                    peak, peak_shmem = shm.stop()
                    runs.append({
                        "update_s": seconds, "prepare_s": u.prepare_s, "load_phase_s": u.seconds,
                        "stall_s": max(u.stall_s.values()),
                        "memcpy_s": copy, "shm_peak_bytes": peak, "shmem_peak_bytes": peak_shmem,
                        "send_s": seconds - sum(update.calls.values()) if hasattr(update, "calls") else float("nan"),
                    })  # fmt: skip
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                out["methods"][method] = {"median": med, "runs": runs}
                print(row(size, nbytes, method, med), flush=True)
    return out


def floor(size: str, args: argparse.Namespace) -> dict[str, float]:
    """vLLM's reload floor (`benchmarks/reload_floor.py`, its own processes, after the engines are
    gone): seconds of one engine alone and of `args.engines` loading at once."""
    report = Path(args.report).with_suffix(f".floor-{size}.json")
    subprocess.run([sys.executable, str(Path(__file__).with_name("reload_floor.py")), "--size", size,
                    "--engines", f"1,{args.engines}", "--repeats", str(args.repeats), "--no-transport",
                    "--cache", args.cache, "--report", str(report)], check=True)  # fmt: skip
    got = msgspec.json.decode(report.read_bytes())["floors"]
    return {"alone_s": got[0]["median"]["reload_memory_s"], "together_s": got[-1]["median"]["reload_memory_s"]}


def row(size: str, nbytes: int, method: str, m: dict[str, float], fl: dict[str, float] | None = None) -> str:
    ratios = (
        f"{m['update_s'] / fl['together_s']:>8.2f} {m['stall_s'] / fl['together_s']:>8.2f}"
        if fl
        else f"{'':>8} {'':>8}"
    )
    return (
        f"{size:>5} {nbytes / 2**30:>6.2f} {method:>6} {m['update_s']:>8.3f} {m['prepare_s']:>8.3f} "
        f"{m['load_phase_s']:>8.3f} {m['stall_s']:>8.3f} {m['memcpy_s']:>8.3f} {ratios} "
        f"{m['shm_peak_bytes'] / 2**20:>9.0f} {m['shmem_peak_bytes'] / 2**20:>10.0f} {m['send_s']:>7.3f}"
    )


HEADER = (
    f"{'size':>5} {'GiB':>6} {'method':>6} {'update s':>8} {'prepare':>8} {'phase 2':>8} {'stall s':>8} "
    f"{'memcpy s':>8} {'upd/flr':>8} {'stl/flr':>8} {'shm MiB':>9} {'shmem MiB':>10} {'send s':>7}"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default=str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"))
    ap.add_argument("--sizes", default="0.5B", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument(
        "--methods",
        default="shm,gloo,store",
        help="shm, gloo (vLLM's trainer API through that backend), store (Ray's object store)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--bucket-mb", type=int, default=64, help="gloo's bucket, shm's slot (4 slots)")
    ap.add_argument("--no-floor", action="store_true", help="skip vLLM's reload floor")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "rollout"))
    ap.add_argument("--report", default="weight_plane_report.json")
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    if unknown := set(methods) - {"shm", "gloo", "store"}:
        ap.error(f"unknown methods {sorted(unknown)}: shm, gloo, store")
    print(HEADER, flush=True)
    results = [asyncio.run(bench_size(size, methods, args.repeats, args)) for size in args.sizes.split(",")]
    for r in results:
        r["floor"] = None if args.no_floor else floor(r["size"], args)
    print(HEADER)
    for r in results:
        for method, m in r["methods"].items():
            print(row(r["size"], r["bytes"], method, m["median"], r["floor"]))
        if r["floor"]:
            print(f"{r['size']:>5} vLLM's reload floor: {r['floor']['together_s']:.3f} s for {args.engines} engines "
                  "loading at once "
                  f"(upd/flr, stl/flr against it), {r['floor']['alone_s']:.3f} s for one alone")  # fmt: skip
    Path(args.report).write_text(msgspec.json.encode({"args": vars(args), "results": results}).decode())
    print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
