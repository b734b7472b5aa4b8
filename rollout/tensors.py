"""Weights on their way from a learner to the engines: check, pack, unpack.

Owns: the model's manifest (every parameter's name, shape and dtype, read from the safetensors
headers of the model directory, no tensor loaded), the checks that reject a state dict or a
directory that does not fit it or holds NaN/inf (before any engine is touched; a directory is read
one tensor at a time, `check_directory`), and the wire form of a state dict
(`Packed`: raw bytes per tensor, which Ray's object store moves zero-copy, bfloat16 included).
Both ends use it: the driver checks and packs (`rollout.weights`), the engines unpack and stage
(`policies.weight_loading`). Needs no vLLM.
Does not own: loading into vLLM (`policies.vllm_policy.VLLMPolicy.commit_weights`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec

from rollout.errors import InvalidWeightsError

# safetensors dtype names <-> torch dtype names
_ST_TO_TORCH = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]


Manifest = dict[str, TensorSpec]


class Packed(msgspec.Struct):
    """A state dict on the wire: `specs[name]` describes `data[name]` (a flat uint8 numpy array)."""

    specs: Manifest
    data: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.data.values())


def read_manifest(model_dir: str | Path) -> Manifest:
    """Name -> (dtype, shape) of every tensor in the model's safetensors files (headers only).
    Raises InvalidWeightsError naming the directory when it has none, and the file when one is
    damaged (`_opened`)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise InvalidWeightsError(f"{model_dir}: no *.safetensors files")
    manifest: Manifest = {}
    for f in files:
        with _opened(f) as st:
            for name in st.keys():
                sl = st.get_slice(name)
                manifest[name] = TensorSpec(
                    _ST_TO_TORCH.get(sl.get_dtype(), sl.get_dtype().lower()), tuple(sl.get_shape())
                )
    return manifest


@contextlib.contextmanager
def _opened(f: Path) -> Iterator[Any]:
    """`f` opened by safetensors. A file cut short or zeroed (a copy interrupted, a disk or sync
    failure) raises InvalidWeightsError naming it: safetensors' own error speaks of a header and
    names no file, which in a sharded checkpoint leaves the reader guessing which shard."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(f), framework="pt") as st:
            yield st
    except SafetensorError as e:
        raise InvalidWeightsError(f"{f}: not a readable safetensors file (damaged or cut short?): {e}") from e


def check_specs(got: Manifest, want: Manifest, what: str) -> None:
    """Raise InvalidWeightsError listing every missing, unknown or mismatched tensor."""
    if problems := spec_problems(got, want):
        shown = "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
        raise InvalidWeightsError(f"{what} does not fit the model: {shown}")


def spec_problems(got: Manifest, want: Manifest) -> list[str]:
    """Every missing, unknown or mismatched tensor of `got` against `want`, one line each."""
    problems = [f"missing {n}" for n in sorted(want.keys() - got.keys())]
    problems += [f"unknown {n}" for n in sorted(got.keys() - want.keys())]
    for name in sorted(got.keys() & want.keys()):
        g, w = got[name], want[name]
        if g.shape != w.shape:
            problems.append(f"{name}: shape {list(g.shape)}, model has {list(w.shape)}")
        elif g.dtype != w.dtype:
            problems.append(f"{name}: dtype {g.dtype}, model has {w.dtype} (cast it first)")
    return problems


def pack(weights: Mapping[str, Any] | str | Path, manifest: Manifest) -> Packed | str:
    """Check `weights` against the model; a state dict becomes `Packed`, a directory its path."""
    if isinstance(weights, (str, Path)):
        path = Path(weights).expanduser()
        if not path.is_dir():
            raise InvalidWeightsError(f"weights: {str(weights)!r} is not a directory")
        check_directory(path, manifest)
        return os.path.abspath(path)
    specs = check_state_dict(weights, manifest)
    return Packed(specs=specs, data={name: tensor_bytes(name, t) for name, t in weights.items()})


def check_state_dict(weights: Any, manifest: Manifest) -> Manifest:
    """The specs of a state dict, checked against the model (not its values: `tensor_bytes`).
    Raises InvalidWeightsError naming every tensor that does not fit."""
    if not isinstance(weights, Mapping):
        raise InvalidWeightsError(f"weights: expected a state dict or a directory, got {type(weights).__name__}")
    if not weights:
        raise InvalidWeightsError("weights: the state dict is empty")
    specs = {name: tensor_spec(name, t) for name, t in weights.items()}
    check_specs(specs, manifest, "state dict")
    return specs


def tensor_bytes(name: str, t: Any) -> Any:
    """One tensor of a state dict on the wire: its bytes as a flat uint8 numpy array (a view of a
    contiguous CPU tensor, no copy), its values checked on them (`check_finite`)."""
    import torch

    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    check_finite(name, t, data)
    return data


def check_directory(path: Path, manifest: Manifest) -> None:
    """The checks of a state dict, on a directory of safetensors files: its headers against the
    model, then every floating-point tensor's values (`check_finite`). Streamed: one tensor in
    memory at a time (safetensors maps the file and copies out the one asked for), so a checkpoint
    larger than RAM is checked in the memory of its largest tensor; the reads also warm the page
    cache the engines load from next. Raises InvalidWeightsError naming the file and the tensor."""
    check_specs(read_manifest(path), manifest, f"weights directory {path}")
    for f in sorted(path.glob("*.safetensors")):
        with _opened(f) as st:
            for name in st.keys():
                try:
                    check_finite(name, st.get_tensor(name))
                except InvalidWeightsError as e:
                    raise InvalidWeightsError(f"weights directory {path}: {f.name}: {e}") from None


def tensor_spec(name: str, t: Any) -> TensorSpec:
    """The spec of one tensor of a state dict. Raises InvalidWeightsError naming it when it is not
    a tensor, or holds no data (a `meta` tensor: the shape of a parameter, never its values)."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise InvalidWeightsError(f"weights[{name!r}]: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_meta:
        raise InvalidWeightsError(f"weights[{name!r}]: on device meta, which holds no data (materialize it first)")
    return TensorSpec(str(t.dtype).removeprefix("torch."), tuple(t.shape))


def check_finite(name: str, t: Any, data: Any = None) -> None:
    """Raise InvalidWeightsError naming `name` when a floating-point tensor holds NaN or inf.
    `data`: its bytes on the CPU (`tensor_bytes`), when the caller has them already."""
    import math

    import torch

    if not t.is_floating_point() or not t.numel():
        return
    t = t.detach()
    if data is None and t.device.type == "cpu":
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    ok = finite_bits(str(t.dtype).removeprefix("torch."), data) if data is not None else None
    if ok is None:  # on an accelerator, or a float8 without IEEE's patterns: the min and max are NaN if any element is
        low, high = torch.aminmax(
            t.to(torch.float16) if t.element_size() == 1 else t
        )  # float16 holds every float8 value
        ok = math.isfinite(float(low)) and math.isfinite(float(high))
    if not ok:
        raise InvalidWeightsError(f"weights[{name!r}]: contains NaN or inf")


# An IEEE float is NaN or inf exactly when its bits without the sign, read as an unsigned
# integer, reach +inf's (all exponent bits set); float8_e4m3fn has no inf and one NaN, 0x7F.
_NONFINITE = {  # dtype -> (unsigned integer of its width, lowest non-finite pattern)
    "float64": ("uint64", 0x7FF0_0000_0000_0000),
    "float32": ("uint32", 0x7F80_0000),
    "float16": ("uint16", 0x7C00),
    "bfloat16": ("uint16", 0x7F80),
    "float8_e5m2": ("uint8", 0x7C),
    "float8_e4m3fn": ("uint8", 0x7F),
}
_CHUNK = 1 << 18  # elements per pass: the masked copy stays in cache


def finite_bits(dtype: str, data: Any) -> bool | None:
    """Whether a tensor of `dtype` whose bytes are `data` (a flat uint8 numpy array) holds no NaN or
    inf: True for a dtype that is not floating point, None for a float format this does not read
    (`check_finite` does). Read from the bits, in numpy on the calling thread: one pass, nothing
    allocated past one chunk. Not torch: its reductions fan out to its intra-op threads, and in a
    driver whose cores the engines keep busy, a call waits for those threads to be scheduled far
    longer than its work takes."""
    import numpy as np

    if dtype not in _NONFINITE:
        return None if dtype.startswith(("float", "bfloat")) else True
    unsigned, lowest = _NONFINITE[dtype]
    bits = data.view(unsigned)
    mask = np.iinfo(unsigned).max >> 1  # every bit but the sign
    buf = np.empty(min(bits.size, _CHUNK), unsigned)
    for i in range(0, bits.size, _CHUNK):
        part = bits[i : i + _CHUNK]
        out = np.bitwise_and(part, mask, out=buf[: part.size])
        if out.max() >= lowest:
            return False
    return True


def fingerprint(directory: str | Path) -> list[tuple[str, int, int, int]]:
    """(name, size, mtime_ns, inode) of every file of a weights directory: what a restart checks
    before loading it again under the epoch it was first loaded as. A checkpoint written over it
    (in place or by rename) changes it."""
    out = []
    for f in sorted(Path(directory).iterdir()):
        if f.is_file():
            st = f.stat()
            out.append((f.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return out


def unpack(packed: Packed) -> dict[str, Any]:
    """`Packed` -> state dict of torch tensors (views on the received buffers where possible)."""
    import torch

    out = {}
    for name, spec in packed.specs.items():
        buf = (
            torch.frombuffer(bytearray(packed.data[name]), dtype=torch.uint8)
            if packed.data[name].size
            else torch.empty(0, dtype=torch.uint8)
        )
        out[name] = buf.view(getattr(torch, spec.dtype)).reshape(spec.shape)
    return out


def save_dir(state: Mapping[str, Any], directory: str | Path) -> Path:
    """Write a state dict as `model.safetensors` in `directory` (created); returns the directory."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file(dict(state), str(d / "model.safetensors"))
    return d
