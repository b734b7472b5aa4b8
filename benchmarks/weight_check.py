"""What the value check of a weights directory costs (`rollout.tensors.check_directory`).

`update_weights(directory)` reads every tensor of the directory's safetensors files, one at a
time, and checks it for NaN/inf before any engine loads it. This measures, on a warm page cache
(the best of `--repeat` runs each): the header check alone (`read_manifest`, what ran before),
the full check (headers + values), and reading every byte of the files (`read_bytes`: a lower
bound on what any loader does with them), on the embedded tiny model and on a random bf16 model of
`--gib` GiB in two shards (Llama-7B-like 4096 x 4096 matrices, written to `--dir`).
`--engine` also times `update_weights(directory)` on the tiny model's real engines (`tiny.yaml`,
2 engines: run it under the engine lock), which includes the check.

    python benchmarks/weight_check.py --gib 1 --out weight_check_report
    flock /tmp/rollout-engine.lock python benchmarks/weight_check.py --gib 0 --engine --out weight_check_report

Prints one table and writes `OUT/weight_check.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from rollout.tensors import check_directory, read_manifest
from rollout.tiny import resolve_model_path


def best_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1000 * min(times), 2)


def random_model(directory: Path, gib: float) -> Path:
    """`gib` GiB of bf16 4096 x 4096 matrices (32 MiB each) in two shards."""
    count = max(2, round(gib * 1024 / 32))
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"model.layers.{i}.weight": torch.randn(4096, 4096, generator=g).to(torch.bfloat16) for i in range(count)
    }
    names = sorted(tensors)
    directory.mkdir(parents=True, exist_ok=True)
    for k, part in enumerate((names[: count // 2], names[count // 2 :])):
        save_file({n: tensors[n] for n in part}, str(directory / f"model-{k + 1:05d}-of-00002.safetensors"))
    return directory


def measure(name: str, directory: Path, repeat: int) -> dict:
    manifest = read_manifest(directory)
    files = sorted(directory.glob("*.safetensors"))
    nbytes = sum(f.stat().st_size for f in files)
    for f in files:
        f.read_bytes()  # warm the page cache
    return {
        "model": name,
        "MiB": round(nbytes / 2**20, 1),
        "headers_ms": best_ms(lambda: read_manifest(directory), repeat),
        "check_ms": best_ms(lambda: check_directory(directory, manifest), repeat),
        "read_ms": best_ms(lambda: [f.read_bytes() for f in files], repeat),
    }


async def engine_update_ms(directory: Path, repeat: int) -> float:
    from rollout import RolloutEngine
    from rollout.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml", ["logging.level=warning"])
    async with RolloutEngine(cfg) as engine:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            await engine.update_weights(str(directory))
            times.append(time.perf_counter() - t0)
    return round(1000 * min(times), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="size of the random bf16 model (0: tiny only)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the random model (default: a temp dir)")
    ap.add_argument(
        "--engine", action="store_true", help="also time update_weights(directory) on the tiny model's engines"
    )
    ap.add_argument("--out", default="weight_check_report")
    args = ap.parse_args()

    tiny = resolve_model_path("tiny")
    rows = [measure("tiny", tiny, args.repeat)]
    if args.gib > 0:
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            rows.append(
                measure(f"random bf16 {args.gib:g} GiB", random_model(Path(d) / "model", args.gib), args.repeat)
            )
    if args.engine:
        rows[0]["update_weights_ms"] = asyncio.run(engine_update_ms(tiny, args.repeat))

    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_check.json").write_text(json.dumps({"rows": rows, "repeat": args.repeat}, indent=2) + "\n")


if __name__ == "__main__":
    main()
