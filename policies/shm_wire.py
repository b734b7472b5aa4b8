"""The shm wire of the `shm` weight-transfer backend (`policies.shm_transfer`): what a worker is
told (`ShmInitInfo`, checked on construction; `ShmUpdateInfo`), what the learner asks for
(`ShmTrainerInitInfo`), the round's byte stream (`layout`: each tensor at an offset aligned to
`ALIGN`), the 16-byte messages on each worker's socket (`MSG`, `ABORT`), and the ring's mapping.

Owns: the infos, `layout`, `MSG`, `recv_msg`, `ring`, `spanning`. Does not own: the engines and
the round's calls (`policies.shm_transfer`, `policies.shm_trainer`).
"""

from __future__ import annotations

import mmap
import socket
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, WeightTransferInitInfo

from policies.gloo_wire import GlooUpdateInfo, check_fields

BACKEND = "shm"
ALIGN = 64  # each tensor's offset in the stream: any dtype's view, on a cache line
MSG = struct.Struct("<qq")  # (round, chunk): learner -> worker "chunk in its slot", worker -> learner "drained"
ABORT = -1  # chunk of a round the learner gave up (its source disagreed with its metadata)


@dataclass(kw_only=True)
class ShmInitInfo(WeightTransferInitInfo):
    """Worker side: the learner's socket (an abstract Unix address), this worker's place, the ring."""

    address: str
    rank_offset: int
    world_size: int
    slots: int
    slot_bytes: int
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        check_fields(self, "shm", str=("address",), int=("rank_offset", "world_size", "slots", "slot_bytes"),
                     positive=("world_size", "slots", "slot_bytes", "timeout_s"))  # fmt: skip


ShmUpdateInfo = GlooUpdateInfo  # one round: what the trainer sends, in order (the same metadata as gloo's)


@dataclass
class ShmTrainerInitInfo(TrainerInitInfo):
    """Trainer side. `world_size`: 1 + every model worker of every engine (`client.world_size()`
    of rollout's client). The ring holds `slots` x `slot_bytes` of shared memory."""

    backend: ClassVar[str] = BACKEND

    world_size: int
    slots: int = 4
    slot_bytes: int = 32 << 20
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.slots < 2 or self.slot_bytes < ALIGN:
            raise ValueError(
                f"shm transfer: slots {self.slots} (at least 2, to fill one while another drains), "
                f"slot_bytes {self.slot_bytes} (at least {ALIGN})"
            )


def layout(info: ShmUpdateInfo) -> tuple[list[tuple[str, torch.dtype, list[int], int, int]], int]:
    """The round's tensors in the stream: (name, dtype, shape, offset, bytes) each, and its length.
    Both sides compute it alike from the same metadata."""
    out, at = [], 0
    for name, dtype_name, shape in zip(info.names, info.dtype_names, info.shapes):
        dtype = getattr(torch, dtype_name)
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        at = -(-at // ALIGN) * ALIGN
        out.append((name, dtype, list(shape), at, nbytes))
        at += nbytes
    return out, at


def spanning(tensors: list[tuple[str, Any, Any, int, int]], lo: int, hi: int) -> str:
    """The names of the tensors with bytes in [`lo`, `hi`) of the stream (an error's chunk)."""
    names = [t[0] for t in tensors if t[3] < hi and t[3] + t[4] > lo]
    return ", ".join(names) if len(names) <= 2 else f"{names[0]} .. {names[-1]}"


def recv_msg(sock: socket.socket) -> tuple[int, int]:
    """One `MSG` from `sock`; ConnectionError when the peer closed it."""
    data = b""
    while len(data) < MSG.size:
        got = sock.recv(MSG.size - len(data))
        if not got:
            raise ConnectionError("connection closed by the peer")
        data += got
    return MSG.unpack(data)


def ring(fd: int, nbytes: int) -> torch.Tensor:
    """The shared file mapped here, as bytes (the mapping outlives the fd, closed by the caller)."""
    return torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
