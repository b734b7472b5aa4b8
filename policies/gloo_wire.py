"""The gloo wire of the `gloo` weight-transfer backend (`policies.gloo_transfer`): what a worker is
told (`GlooInitInfo`, checked on construction; `GlooUpdateInfo`; the control infos `SETTLE`,
`DISCARD`, `JOINED`), how a round's tensors are cut into buckets (alike on both sides, from the
same metadata), the trainer's store and the pair groups (trainer + one worker each), and the
trainer's broadcast of a round.

Owns: the infos, `buckets`, `tcp_store`, `reachable` (a bounded connect: TCPStore's own can outlast
its timeout; stoppable), `pair_group`, `broadcast`, `send`, `wait_ready`, and `GlooCollective` (a
NeMo RL-style trainer rank with no client). Every wait is bounded by the timeout it is given.
Does not own: vLLM's engine classes and the round's calls (`policies.gloo_transfer`).
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

DEFAULT_BUCKET_BYTES = 64 << 20
# update infos that move no bytes (`rollout.weights.transfer` sends them through vLLM's update_weights,
# so vLLM ends its update session when they fail): wait for the staged bytes; drop them unloaded
SETTLE, DISCARD = "settle", "discard"
# an update info asking, without waiting, whether the worker's rendezvous failed (raises why, the
# round dropped); a rendezvous still running answers nothing
JOINED = "joined"


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    """Worker side: where the trainer's store is, and this worker's place in the group. Checked
    on construction (ValueError naming the field): the worker's init checks it and returns."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    session: str = "rollout"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        check_fields(self, "gloo", str=("master_address", "session"), int=("master_port", "rank_offset", "world_size",
                     "bucket_bytes"), positive=("world_size", "bucket_bytes", "timeout_s"))  # fmt: skip
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"gloo init info: master_port {self.master_port} is no TCP port")


def check_fields(info: Any, backend: str, *, positive: tuple[str, ...] = (), **kinds: tuple[str, ...]) -> None:
    """An init info's fields of the right type (`str=`, `int=` names; `timeout_s` a number) and
    `positive` ones above 0. Raises ValueError naming the field."""
    want = {"str": (str,), "int": (int,)}
    for kind, names in kinds.items():
        for name in names:
            v = getattr(info, name)
            if not isinstance(v, want[kind]) or isinstance(v, bool):
                raise ValueError(f"{backend} init info: {name} must be {kind}, got {type(v).__name__} {v!r}")
    if not isinstance(info.timeout_s, (int, float)) or isinstance(info.timeout_s, bool):
        raise ValueError(f"{backend} init info: timeout_s must be a number, got {info.timeout_s!r}")
    for name in positive:
        if not getattr(info, name) > 0:
            raise ValueError(f"{backend} init info: {name} must be > 0, got {getattr(info, name)!r}")


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One round: what the trainer sends, in order (vLLM's NCCL update info, plus the round)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    round: int = 0


def buckets(
    names: list[str], dtypes: list[str], shapes: list[list[int]], bucket_bytes: int
) -> list[list[tuple[str, torch.dtype, list[int], int]]]:
    """The round's tensors cut into buckets of at most `bucket_bytes` (a larger tensor alone):
    (name, dtype, shape, bytes) each. Both sides cut alike from the same metadata."""
    out: list[list[Any]] = [[]]
    used = 0
    for name, dtype_name, shape in zip(names, dtypes, shapes):
        dtype = getattr(torch, dtype_name)
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        if out[-1] and used + nbytes > bucket_bytes:
            out.append([])
            used = 0
        out[-1].append((name, dtype, list(shape), nbytes))
        used += nbytes
    return [b for b in out if b]


def offsets(bucket: list[tuple[str, torch.dtype, list[int], int]]) -> tuple[list[int], int]:
    """Where each of the bucket's tensors starts in the staging buffer, each at a multiple of its
    itemsize (a load views it as its dtype), and the buffer's size."""
    out, at = [], 0
    for _, dtype, _, nbytes in bucket:
        at = -(-at // dtype.itemsize) * dtype.itemsize
        out.append(at)
        at += nbytes
    return out, at


def slices(buf: torch.Tensor, bucket: list[tuple[str, torch.dtype, list[int], int]]) -> list[torch.Tensor]:
    """`buf` cut into the bucket's tensors, in order: each is broadcast on its own (no packing)."""
    return [buf[at : at + b[3]] for at, b in zip(offsets(bucket)[0], bucket)]


def tcp_store(address: str, port: int, timeout_s: float, master: bool = False) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(
        address, port, None, master, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def reachable(address: str, port: int, timeout_s: float, stop: threading.Event | None = None) -> None:
    """Until something accepts a connection at (`address`, `port`), within `timeout_s`: TCPStore's
    own connect retries with a backoff that can outlast its timeout by minutes. `stop` set ends
    the wait at once (ConnectionAbortedError). Raises TimeoutError."""
    deadline, stop = time.monotonic() + timeout_s, stop or threading.Event()
    while (left := deadline - time.monotonic()) > 0:
        try:
            socket.create_connection((address, port), timeout=left).close()
            return
        except ConnectionRefusedError:  # the learner's store may be just starting
            if stop.wait(min(0.05, max(left, 0))):
                raise ConnectionAbortedError(f"stopped waiting for {address}:{port}") from None
        except OSError as e:
            raise ConnectionError(f"no connection to {address}:{port}: {type(e).__name__}: {e}") from e
    raise TimeoutError(f"nothing accepted a connection at {address}:{port} within {timeout_s:g} s")


def pair_group(store: Any, session: str, worker: int, timeout_s: float, *, trainer: bool) -> Any:
    """The ProcessGroupGloo of the trainer (rank 0) and worker rank `worker` (rank 1), standalone
    (never vLLM's). A pair per worker: broadcasts to all workers run side by side, each on its
    own connection, and a worker that fails breaks only its own pair."""
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(dist.PrefixStore(f"{session}/pair{worker}/", store), 0 if trainer else 1, 2, opts)


def close_groups(groups: list[Any]) -> None:
    for pg in groups:
        try:
            pg.shutdown()
        except Exception:  # a group broken by a dead peer has nothing left to close
            pass


def broadcast(pg: Any, buf: torch.Tensor) -> Any:
    """Start a broadcast of `buf` from rank 0; returns its work (`.wait()`)."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([buf], opts)


def wait_ready(store: Any, session: str, round: int, ranks: Any, timeout_s: float) -> None:
    """Until every worker rank of `ranks` posted its receives of round `round` (a trainer with no
    client to call, `GlooCollective`, broadcasts only then)."""
    try:
        store.wait([f"{session}/ready/{round}/{r}" for r in ranks], datetime.timedelta(seconds=timeout_s))
    except Exception as e:
        raise TimeoutError(f"gloo transfer: workers not receiving round {round} within {timeout_s:g} s: {e}") from e


def send(
    pgs: list[Any],
    pairs: Iterator[tuple[str, torch.Tensor]],
    info: GlooUpdateInfo,
    bucket_bytes: int,
    inflight: int = 2,
) -> None:
    """Broadcast the round's tensors to every worker's pair group, in the buckets the workers cut,
    each tensor on its own (no packing copy: on a busy learner process, concatenating buckets
    cost more than the transfer), `inflight` buckets on their way at a time; each tensor checked
    against what the workers were told (a source that disagrees would load garbage). A worker
    whose pair fails is left out (its engine's own call fails and leaves rotation); raises when
    none is left."""
    live = list(pgs)
    sending: deque[list[tuple[Any, Any]]] = deque()

    def finish(works: list[tuple[Any, Any]]) -> None:
        errors = []
        for pg, work in works:
            try:
                work.wait()
            except Exception as e:
                if pg in live:
                    live.remove(pg)
                errors.append(e)
        if not live:
            raise RuntimeError(f"gloo transfer: no worker left: {errors[0]}") from errors[0]

    for bucket in buckets(info.names, info.dtype_names, info.shapes, bucket_bytes):
        while len(sending) >= inflight:
            finish(sending.popleft())
        works = []
        for name, dtype, shape, _ in bucket:
            got, t = next(pairs)
            if got != name or t.dtype != dtype or list(t.shape) != shape:
                raise ValueError(
                    f"WeightSource yielded {got!r} {t.dtype} {list(t.shape)}, "
                    f"metadata() declared {name!r} {dtype} {shape}"
                )
            flat = (
                t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            )  # a view of a contiguous CPU tensor: no copy
            works += [(pg, broadcast(pg, flat)) for pg in live]
        sending.append(works)
    while sending:
        finish(sending.popleft())


class GlooCollective:
    """One rank of a NeMo RL-style trainer on the gloo group: no client; the rollout side drives the
    engines (`RolloutGeneration.init_collective` / `update_weights_from_collective`) while rank 0
    `broadcast`s, in the order given to `prepare_refit_info`. Ranks 0..train_world_size-1 are
    the trainer's, the engines' workers follow; rank 0 hosts the store at (`ip`, `port`)."""

    def __init__(self, ip: str, port: int, world_size: int, *, rank: int, train_world_size: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 300.0,
                 session: str = "rollout"):  # fmt: skip
        self.rank, self.workers_from, self.world_size, self.session = rank, train_world_size, world_size, session
        self.bucket_bytes, self.timeout_s, self.round = bucket_bytes, timeout_s, 0
        self.store = tcp_store(ip, port, timeout_s, master=rank == 0)
        self.pgs = (
            [pair_group(self.store, session, r, timeout_s, trainer=True) for r in range(train_world_size, world_size)]
            if rank == 0
            else []
        )

    def broadcast(self, weights: Mapping[str, torch.Tensor]) -> None:
        """This round's tensors (HF name -> tensor) to every engine; ranks other than 0 return."""
        self.round += 1
        if self.rank:
            return
        info = GlooUpdateInfo(list(weights), [str(t.dtype).removeprefix("torch.") for t in weights.values()],
                              [list(t.shape) for t in weights.values()], self.round)  # fmt: skip
        wait_ready(self.store, self.session, self.round, range(self.workers_from, self.world_size), self.timeout_s)
        send(self.pgs, iter(weights.items()), info, self.bucket_bytes)

    def shutdown(self) -> None:
        close_groups(self.pgs)
        self.pgs, self.store = [], None
