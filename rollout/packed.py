"""Per-token data held and moved packed: `TokenIds` (int32) and `Logprobs` (float64), typed arrays.

As Python lists, a trajectory's token ids and logprobs would be a Python object per token, which
the driver decodes from msgpack one by one and whose lists its garbage collector walks, per token,
in every full collection (with thousands of samples in flight, long pauses of the driver's loop;
docs/guides/scaling.md). Packed, a trajectory's ids cross the data path as one msgpack bin each
(little-endian, decoded by one copy), the collector sees one object with nothing to walk, and
`Batch.to_tensors` views them as tensors without a Python int or float per token.

For user code they behave as lists: `len`, indexing, iteration, `==` with a list or tuple of
the same values, `+` with any sequence, `+=`, `extend`, `append`; a slice or a concatenation is a
plain list. Underneath each is an `array.array`: the buffer protocol gives numpy and
torch a view (`torch.frombuffer`, `numpy.asarray`), `list(x)` a list. Encoding them takes a hook
(msgspec knows no arrays): `encode` (msgpack, packed) and `to_json` (lists) here, or `enc_hook=`
`wire_hook` / `json_hook` with msgspec's own encoders. Decoding needs none: the fields that hold them
read a list (JSON, data written before) or packed bytes, and `Trajectory.__post_init__` unpacks.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from typing import Any

import msgspec

_SWAP = sys.byteorder != "little"  # the wire is little-endian whatever the host


class _Packed(array):
    __slots__ = ()  # nothing per instance: to the collector an array is one object with nothing in it
    code, size = "", 0  # array typecode, bytes per value

    def __new__(cls, values: Iterable[Any] | bytes = ()) -> Any:
        """From any iterable of values, or packed bytes (as `wire_hook` makes them)."""
        if isinstance(values, (bytes, bytearray, memoryview)):
            out = super().__new__(cls, cls.code)
            out.frombytes(values)
            if _SWAP:
                out.byteswap()
            return out
        return super().__new__(cls, cls.code, values)

    def __getitem__(self, index: Any) -> Any:
        item = super().__getitem__(index)
        return item.tolist() if isinstance(index, slice) else item

    def __add__(self, other: Iterable[Any]) -> list:  # type: ignore[override]
        return self.tolist() + list(other)

    def __radd__(self, other: Iterable[Any]) -> list:
        return list(other) + self.tolist()

    def __iadd__(self, other: Iterable[Any]) -> Any:  # type: ignore[override]
        self.extend(other)
        return self

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple)):
            return len(self) == len(other) and self.tolist() == list(other)
        return super().__eq__(other)

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tolist()!r})"


class TokenIds(_Packed):
    """Token ids, packed as int32 (vLLM's own token id type; `rollout.types` bounds ids to it)."""

    __slots__ = ()
    code = "i"
    size = array("i").itemsize


class Logprobs(_Packed):
    """Logprobs, packed as float64: every value as it was given (vLLM's float32 ones exactly)."""

    __slots__ = ()
    code = "d"
    size = array("d").itemsize


_array = array.__new__  # the C constructor, bytes read by one copy: decoding skips our `__new__`


def unpack(value: Any, kind: type[_Packed], field: str) -> Any:
    """A field's decoded value as `kind` when it came packed (bytes); anything else as it is.
    Raises ValueError naming `field` when the bytes are not whole values."""
    if type(value) is not bytes:
        return value
    if len(value) % kind.size:
        raise ValueError(f"{field}: {len(value)} packed bytes are not whole {kind.size}-byte values")
    if _SWAP:
        return kind(value)
    return _array(kind, kind.code, value)


def wire_hook(obj: Any) -> Any:
    """msgspec `enc_hook` for msgpack: a packed array as its little-endian bytes."""
    if isinstance(obj, _Packed):
        if not _SWAP:
            return obj.tobytes()
        swapped = array(obj.typecode, obj)
        swapped.byteswap()
        return swapped.tobytes()
    raise TypeError(f"Encoding objects of type {type(obj).__name__} is unsupported")


def json_hook(obj: Any) -> Any:
    """msgspec `enc_hook` for JSON (and `msgspec.to_builtins`): a packed array as a list."""
    if isinstance(obj, _Packed):
        return obj.tolist()
    raise TypeError(f"Encoding objects of type {type(obj).__name__} is unsupported")


_WIRE = msgspec.msgpack.Encoder(enc_hook=wire_hook)
_JSON = msgspec.json.Encoder(enc_hook=json_hook)


def encode(obj: Any) -> bytes:
    """msgpack, per-token arrays packed: what crosses the data path, progress reports and the durable log."""
    return _WIRE.encode(obj)


def to_json(obj: Any) -> bytes:
    """JSON, per-token arrays as lists of numbers (what `rollout run --out` writes)."""
    return _JSON.encode(obj)


def tensor(values: Any, dtype: Any) -> Any:
    """`values` as a new 1-D torch tensor of `dtype`: a packed array read through its buffer (no
    Python object per value), anything else as `torch.tensor` reads it."""
    import torch

    if isinstance(values, _Packed):
        if not len(values):
            return torch.empty(0, dtype=dtype)
        packed = torch.int32 if values.code == "i" else torch.float64
        return torch.frombuffer(values, dtype=packed).to(dtype, copy=True)
    return torch.tensor(values, dtype=dtype)
