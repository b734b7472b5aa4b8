"""The weight plane's `cuda_ipc` backend on one GPU, against a plain device-to-device copy.

What runs (no vLLM, no Ray: the plane's own classes, in two processes on one GPU):
- learner process (this one): a random Llama-shaped state dict in bf16 on the GPU; the plane's
  learner rank, `rollout.plane_sender.PlaneSender(backend="cuda_ipc")`, in a thread, writes its
  buckets into its CUDA slots exactly as it does for a real engine (the bucket plan of
  `policies.transfer.make_plan`, `pack_bucket`, `policies.transports.Slots`, the store's
  headers and acks, `slots` slots reused once acked); the main thread plays the driver's part of
  a round with `rollout.plane.WeightPlane`'s own methods (collect, ticket, joined, go, finish),
  as `rollout.updates.WeightUpdates.plane_round` does, with one engine of one model worker;
- receiver process (`torch.multiprocessing` spawn): `policies.plane_worker.PlaneReceiver` on the
  same GPU opens the slots from their IPC handles (`transports.from_ipc_handle`), and its
  `stream(round)` (the worker's own receive loop and `transfer.Assembler`) yields whole tensors,
  which are loaded into a torch `nn.Module` with Llama's parameter names (`param.copy_(tensor)`,
  what vLLM's default weight loader does inside `reload_weights`).

Measured, per model size and bucket size:
- IPC+load: from the driver's `go` (the learner starts streaming) to the receiver having every
  parameter loaded, its GPU work synchronized (`time.perf_counter`, CLOCK_MONOTONIC, shared by
  both processes). Joining (the first opening of the slots' IPC handles) happens before `go`, as
  in the plane (phase 1): it is in `round_s` (the learner's whole `send`), not in IPC+load.
  The first `--warmup` rounds (caching-allocator growth, first launches) are left out; best and
  median of `--repeats` rounds.
- D2D: one `dst.copy_(src)` of a flat uint8 buffer of the same byte count on the same GPU,
  synchronized, best of `--d2d-repeats` after two warm-ups (wall clock; CUDA-event time in the
  JSON report).
- GB/s: model bytes (each byte counted once, 1 GB = 1e9 bytes) / seconds; ratio: IPC+load GB/s
  (best) / D2D GB/s (best). The plane copies every byte three times on the GPU (into a slot,
  out of it into the whole tensor, into the parameter), so ~0.33 is its floor-bound ceiling.
- Verified after every round: the receiver's parameters (zeroed before each round) are read
  back in the learner through their own IPC handles and compared byte for byte with the source
  (`exact`), and a position-weighted 64-bit checksum of every byte is taken in both processes.

`--busy-ms X` is a hazard check, not a figure: before each round both processes queue a GPU
sleep of about X ms on their streams (the learner's sender then with `check_finite=False`, which
would otherwise wait for it), as a learner straight out of `optimizer.step()` or a worker with
work in flight would. A copy into or out of a slot that is only queued when the store's header
(learner) or ack (receiver) goes out then shows up as wrong bytes (`exact` False).

Run (on a machine with a CUDA GPU):

    python benchmarks/gpu_ipc.py                                   # 1B, 64 MiB buckets
    python benchmarks/gpu_ipc.py --sizes 0.25B,1B,4B --bucket-mb 16,64,256 --repeats 5 --out gpu_ipc.json

The test `tests/integration/test_gpu_ipc.py` runs `run_size` on a tiny shape (gpu marker).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import queue
import statistics
import sys
import threading
import time
import traceback
import types
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# hidden, intermediate, layers, attention heads, kv heads, vocab: Llama shapes of about the named size
SHAPES = {
    "tiny": (256, 688, 2, 4, 2, 1024),  # ~1.9M params: the test's
    "0.25B": (1024, 2816, 16, 16, 4, 32000),
    "1B": (2048, 5632, 22, 32, 4, 32000),  # TinyLlama-1.1B's
    "4B": (3072, 8192, 36, 24, 8, 32000),
}
CHECKSUM_CHUNK = 1 << 26  # bytes per step of `checksum` (int64 temporaries: 8x that)


def plane() -> types.SimpleNamespace:
    """The weight plane's modules. `rollout/__init__` imports the engine (Ray, vLLM); when `rollout`
    is not imported yet, it is registered as a bare package over its folder, so that only the
    plane's own modules (`rollout.errors`, `rollout.plane_sender`, `rollout.plane`) load."""
    if "rollout" not in sys.modules:
        pkg = importlib.util.module_from_spec(importlib.machinery.ModuleSpec("rollout", None, is_package=True))
        pkg.__path__ = [str(ROOT / "rollout")]
        sys.modules["rollout"] = pkg
    from policies import plane_worker, transfer, transports, weights
    from rollout import plane as driver
    from rollout import plane_sender

    return types.SimpleNamespace(
        PlaneSender=plane_sender.PlaneSender, WeightPlane=driver.WeightPlane, PlaneReceiver=plane_worker.PlaneReceiver,
        make_plan=transfer.make_plan, Outcome=transfer.Outcome, PlaneStage=transfer.PlaneStage, TensorSpec=weights.TensorSpec,
        ipc_handle=transports.ipc_handle, from_ipc_handle=transports.from_ipc_handle,
    )  # fmt: skip


def llama(shape: tuple[int, ...], device: Any, dtype: Any = None) -> Any:
    """A torch module with a Llama's parameters (HF names, shapes; untied head), uninitialized on
    `device` (`meta`: shapes only). No forward: only its parameters are loaded here."""
    import torch
    from torch import nn

    hidden, inter, layers, heads, kv_heads, vocab = shape
    kv = kv_heads * (hidden // heads)

    def linears(**shapes: tuple[int, int]) -> nn.Module:
        m = nn.Module()
        for name, (out, into) in shapes.items():
            setattr(m, name, nn.Linear(into, out, bias=False))
        return m

    def layer() -> nn.Module:
        m = nn.Module()
        m.self_attn = linears(
            q_proj=(hidden, hidden), k_proj=(kv, hidden), v_proj=(kv, hidden), o_proj=(hidden, hidden)
        )
        m.mlp = linears(gate_proj=(inter, hidden), up_proj=(inter, hidden), down_proj=(hidden, inter))
        m.input_layernorm, m.post_attention_layernorm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        return m

    with torch.device("meta"):
        model = nn.Module()
        model.model = nn.Module()
        model.model.embed_tokens = nn.Embedding(vocab, hidden)
        model.model.layers = nn.ModuleList(layer() for _ in range(layers))
        model.model.norm = nn.RMSNorm(hidden)
        model.lm_head = nn.Linear(hidden, vocab, bias=False)
    model = model.to(dtype or torch.bfloat16)
    return model if str(device) == "meta" else model.to_empty(device=device)


def checksum(tensors: Mapping[str, Any]) -> int:
    """A position-weighted sum of every byte of `tensors` (by sorted name), in wrapping int64."""
    import torch

    total: Any = 0
    for k, name in enumerate(sorted(tensors)):
        flat = tensors[name].detach().reshape(-1).view(torch.uint8)
        for at in range(0, flat.numel(), CHECKSUM_CHUNK):
            x = flat[at : at + CHECKSUM_CHUNK].to(torch.int64)
            w = torch.arange(at + 1, at + 1 + x.numel(), device=x.device, dtype=torch.int64) * 1_000_003 + (k << 32)
            total = total + (x * w).sum()
    return int(total)


def busy_cycles(ms: float) -> int:
    """GPU clock cycles of about `ms` milliseconds (at ~2 GHz; `torch.cuda._sleep` spins that long)."""
    return int(ms * 2e6)


def d2d(nbytes: int, device: Any, repeats: int) -> dict[str, float]:
    """Best of `repeats` synchronized `dst.copy_(src)` of `nbytes` (after two warm-ups)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.zeros_like(src)
    for _ in range(2):
        dst.copy_(src)
    wall, event = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize(device)
        wall.append(time.perf_counter() - t)
        event.append(start.elapsed_time(end) / 1e3)
    assert torch.equal(dst, src)
    del src, dst
    torch.cuda.empty_cache()
    return {"d2d_s": min(wall), "d2d_event_s": min(event), "d2d_median_s": statistics.median(wall)}


# -- the receiver process -------------------------------------------------------------------------


def receiver_main(shape: tuple[int, ...], device_index: int, commands: Any, results: Any) -> None:
    """The engine's model worker: a `PlaneReceiver` loading into a Llama-shaped module."""
    try:
        import msgspec
        import torch

        torch.cuda.set_device(device_index)
        device = torch.device("cuda", device_index)
        p = plane()
        model = llama(shape, device)
        params = dict(model.named_parameters())
        receiver = p.PlaneReceiver(0, 1, device)
        # The learner reads the parameters back through IPC handles of their own (the check).
        results.put(("ready", {n: p.ipc_handle(t.detach().reshape(-1).view(torch.uint8)) for n, t in params.items()}))
        while True:
            command, arg = commands.get()
            if command == "reset":
                with torch.no_grad():
                    for t in params.values():
                        t.zero_()
                torch.cuda.synchronize(device)
                results.put(("reset", None))
            elif command == "stage":  # phase 1: join in the receiver's thread; the driver waits on `joined`
                receiver.stage(msgspec.msgpack.decode(arg, type=p.PlaneStage))
            elif command == "load":  # phase 2: stream, loading each tensor as its last byte arrives
                n, busy_ms = arg
                start, nbytes, count = time.perf_counter(), 0, 0
                if busy_ms:
                    torch.cuda._sleep(busy_cycles(busy_ms))
                with torch.no_grad():
                    for name, tensor in receiver.stream(n):
                        params[name].copy_(tensor)
                        nbytes, count = nbytes + tensor.numel() * tensor.element_size(), count + 1
                torch.cuda.synchronize(device)
                results.put(("loaded", {"start": start, "end": time.perf_counter(), "bytes": nbytes, "tensors": count}))
            elif command == "checksum":
                results.put(("checksum", checksum(params)))
            elif command == "close":
                receiver.close()
                results.put(("closed", None))
                return
    except BaseException:
        results.put(("error", traceback.format_exc()))


class Receiver:
    """The receiver process, seen from the learner."""

    def __init__(self, shape: tuple[int, ...], device_index: int, timeout_s: float):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.timeout_s = timeout_s
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=receiver_main, args=(tuple(shape), device_index, self.commands, self.results), daemon=True
        )
        self.proc.start()

    def send(self, command: str, arg: Any = None) -> None:
        self.commands.put((command, arg))

    def expect(self, what: str, timeout_s: float | None = None) -> Any:
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            try:
                kind, value = self.results.get(timeout=1.0)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"the receiver process exited ({self.proc.exitcode}) before {what!r}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {what!r} from the receiver process") from None
                continue
            if kind == "error":
                raise RuntimeError(f"the receiver process failed:\n{value}")
            if kind != what:
                raise RuntimeError(f"the receiver process answered {kind!r}, expected {what!r}")
            return value

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.send("close")
                self.expect("closed", 30)
            except Exception:
                pass
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


# -- the learner and the driver (this process) ----------------------------------------------------


class Learner:
    """One plane (one bucket size): the learner rank (`PlaneSender`, cuda_ipc) and the driver's
    side of its rounds (`WeightPlane`'s methods), one engine (0) of one model worker."""

    def __init__(
        self, p: types.SimpleNamespace, bucket_bytes: int, slots: int, device: Any, timeout_s: float, busy_ms: float = 0
    ):
        session = f"gpu-ipc-{uuid.uuid4().hex[:8]}"
        self.p, self.timeout_s, self.busy_ms = p, timeout_s, busy_ms
        self.sender = p.PlaneSender(
            "127.0.0.1", 0, session=session, backend="cuda_ipc", bucket_bytes=bucket_bytes, slots=slots,
            timeout_s=timeout_s, device=device, check_finite=not busy_ms,
        )  # fmt: skip
        self.driver = p.WeightPlane(
            None,
            backend="cuda_ipc",
            host="127.0.0.1",
            port=self.sender.port,
            local=False,
            session=session,
            timeout_s=timeout_s,
        )

    def round(self, weights: Mapping[str, Any], manifest: Mapping[str, Any], receiver: Receiver) -> dict[str, Any]:
        """One round as `WeightUpdates.plane_round` runs it; the times of its phases."""
        import msgspec
        import torch

        sent: dict[str, Any] = {}
        if self.busy_ms:  # the hazard check: the learner's stream still busy when it sends
            torch.cuda._sleep(busy_cycles(self.busy_ms))

        def send() -> None:
            t = time.perf_counter()
            try:
                sent["epoch"] = self.sender.send(weights)
            except BaseException as e:
                sent["error"] = e
            sent["round_s"] = time.perf_counter() - t

        thread = threading.Thread(target=send, name="gpu-ipc-learner", daemon=True)
        thread.start()
        d, p = self.driver, self.p
        n, plan, outcome = d.begin(), None, p.Outcome(error="the benchmark's driver gave up on the round")
        try:
            metas = d.collect(n)
            if errors := [m.error for m in metas if m.error]:
                raise RuntimeError("; ".join(errors))
            plan = p.make_plan(metas, manifest, min(m.bucket_bytes for m in metas))
            ticket = d.ticket(n, n, plan, [0], 1, metas, self.timeout_s, {})
            receiver.send("stage", msgspec.msgpack.encode(d.stage(n, 0)))
            if bad := d.joined(n, ticket):
                raise RuntimeError(f"the receiver did not join round {n}: {bad}")
            go = time.perf_counter()
            d.go(n)
            receiver.send("load", (n, self.busy_ms))  # the engine's phase 2 (`rollout_plane_load`)
            loaded = receiver.expect("loaded")
            outcome = p.Outcome(n)
        finally:
            d.finish(n, outcome, plan, [0])
            thread.join(self.timeout_s)
        if "error" in sent:
            raise sent["error"]
        if thread.is_alive():
            raise TimeoutError(f"the learner's send of round {n} did not return")
        return {
            "ipc_load_s": loaded["end"] - go, "receiver_s": loaded["end"] - loaded["start"], "round_s": sent["round_s"],
            "bytes": loaded["bytes"], "tensors": loaded["tensors"], "buckets": len(plan.buckets),
        }  # fmt: skip

    def close(self) -> None:
        self.sender.close()
        self.driver.store = None


def run_size(
    size: str | tuple[int, ...], bucket_bytes: list[int], *, slots: int = 2, repeats: int = 3, warmup: int = 1,
    device_index: int = 0, seed: int = 0, timeout_s: float = 120.0, d2d_repeats: int = 5, busy_ms: float = 0,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every bucket size of `bucket_bytes` on one model `size` (a key of SHAPES, or its shape):
    one result per bucket size (see the module's docstring for what is measured)."""
    import torch

    p = plane()
    shape = SHAPES[size] if isinstance(size, str) else tuple(size)
    name = size if isinstance(size, str) else "x".join(map(str, shape))
    device = torch.device("cuda", device_index)
    torch.cuda.set_device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    weights = {
        n: torch.randn(t.shape, generator=g, dtype=torch.bfloat16, device=device)
        for n, t in llama(shape, "meta").named_parameters()
    }
    manifest = {n: p.TensorSpec("bfloat16", tuple(t.shape)) for n, t in weights.items()}
    source = {n: t.reshape(-1).view(torch.uint8) for n, t in weights.items()}
    nbytes = sum(t.numel() for t in source.values())
    params = sum(t.numel() for t in weights.values())
    source_sum = checksum(weights)
    copy = d2d(nbytes, device, d2d_repeats)
    log(
        f"{name}: {params / 1e9:.3f}B params, {nbytes / 1e9:.3f} GB; D2D {copy['d2d_s'] * 1e3:.2f} ms = {nbytes / copy['d2d_s'] / 1e9:.0f} GB/s"
    )
    receiver = Receiver(shape, device_index, timeout_s)
    mirrors: dict[str, Any] = {}
    out = []
    try:
        mirrors = {n: p.from_ipc_handle(h, device) for n, h in receiver.expect("ready", max(timeout_s, 300)).items()}
        for bb in bucket_bytes:
            learner = Learner(p, bb, slots, device, timeout_s, busy_ms)
            rounds = []
            try:
                for r in range(warmup + repeats):
                    receiver.send("reset")
                    receiver.expect("reset")
                    got = learner.round(weights, manifest, receiver)
                    got["exact"] = all(torch.equal(mirrors[n], source[n]) for n in source)
                    receiver.send("checksum")
                    got["checksum"] = receiver.expect("checksum")
                    got["warmup"] = r < warmup
                    rounds.append(got)
                    log(
                        f"  bucket {bb / 2**20:g} MiB round {r}{' (warm-up)' if r < warmup else ''}: IPC+load {got['ipc_load_s'] * 1e3:.1f} ms "
                        f"({nbytes / got['ipc_load_s'] / 1e9:.1f} GB/s), round {got['round_s'] * 1e3:.1f} ms, exact {got['exact']}, "
                        f"checksum {'ok' if got['checksum'] == source_sum else 'DIFFERS'}"
                    )  # fmt: skip
            finally:
                learner.close()
            timed = [r for r in rounds if not r["warmup"]] or rounds
            best, median = min(r["ipc_load_s"] for r in timed), statistics.median(r["ipc_load_s"] for r in timed)
            out.append({
                "size": name, "shape": list(shape), "params": params, "bytes": nbytes, "bucket_bytes": bb, "slots": slots, "busy_ms": busy_ms,
                "buckets": rounds[0]["buckets"], "tensors": len(weights),
                "ipc_load_s_best": best, "ipc_load_s_median": median,
                "ipc_load_gbps_best": nbytes / best / 1e9, "ipc_load_gbps_median": nbytes / median / 1e9,
                "receiver_s_best": min(r["receiver_s"] for r in timed), "round_s_median": statistics.median(r["round_s"] for r in timed),
                "first_round_s": rounds[0]["round_s"], **copy, "d2d_gbps": nbytes / copy["d2d_s"] / 1e9,
                "ratio": (nbytes / best) / (nbytes / copy["d2d_s"]),
                "exact": all(r["exact"] for r in rounds), "checksum_source": source_sum,
                "checksums_match": all(r["checksum"] == source_sum for r in rounds), "rounds": rounds,
            })  # fmt: skip
    finally:
        mirrors.clear()  # the receiver's memory is let go here before it exits
        torch.cuda.synchronize(device)
        receiver.close()
    return out


HEADER = f"{'size':>6} {'params':>7} {'GB':>6} {'bucket':>7} {'slots':>5} {'bkts':>5} {'IPC+load ms':>11} {'GB/s':>7} {'(med)':>7} {'D2D ms':>7} {'D2D GB/s':>8} {'ratio':>6} {'1st rnd ms':>10} {'exact':>5}"


def row(r: dict[str, Any]) -> str:
    return (
        f"{r['size']:>6} {r['params'] / 1e9:>6.2f}B {r['bytes'] / 1e9:>6.2f} {r['bucket_bytes'] / 2**20:>5g}Mi {r['slots']:>5} {r['buckets']:>5} "
        f"{r['ipc_load_s_best'] * 1e3:>11.1f} {r['ipc_load_gbps_best']:>7.1f} {r['ipc_load_gbps_median']:>7.1f} "
        f"{r['d2d_s'] * 1e3:>7.2f} {r['d2d_gbps']:>8.0f} {r['ratio']:>6.3f} {r['first_round_s'] * 1e3:>10.1f} "
        f"{'yes' if r['exact'] and r['checksums_match'] else 'NO':>5}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="1B", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--bucket-mb", default="64", help="comma-separated bucket sizes in MiB (the plane's default: 64)")
    ap.add_argument("--slots", type=int, default=2, help="the learner's CUDA slots (the plane's default: 2)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per bucket size")
    ap.add_argument("--warmup", type=int, default=1, help="rounds per bucket size left out of the figures")
    ap.add_argument("--d2d-repeats", type=int, default=5)
    ap.add_argument("--device", type=int, default=0, help="CUDA device index")
    ap.add_argument("--timeout", type=float, default=120.0, help="every wait on a peer, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--busy-ms", type=float, default=0, help="hazard check (not a figure): a GPU sleep queued before each round"
    )
    ap.add_argument("--out", default="", help="write a JSON report here")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_ipc: no CUDA device", file=sys.stderr)
        return 2
    buckets = [int(float(b) * 2**20) for b in args.bucket_mb.split(",")]
    device = torch.cuda.get_device_name(args.device)
    print(f"device: {device}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    results = []
    for size in args.sizes.split(","):
        results += run_size(
            size, buckets, slots=args.slots, repeats=args.repeats, warmup=args.warmup, device_index=args.device,
            seed=args.seed, timeout_s=args.timeout, d2d_repeats=args.d2d_repeats, busy_ms=args.busy_ms, log=lambda s: print(s, flush=True),
        )  # fmt: skip
    print(
        f"\n{device}: IPC+load = PlaneSender -> cuda_ipc slots -> PlaneReceiver -> nn.Module params; best of {args.repeats} (GB/s also median); ratio = best IPC+load GB/s / D2D GB/s"
    )
    print(HEADER)
    for r in results:
        print(row(r))
    if args.out:
        report = {
            "device": device,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "args": vars(args),
            "results": results,
        }
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"report: {args.out}")
    return 0 if all(r["exact"] and r["checksums_match"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
