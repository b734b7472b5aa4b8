"""The gloo wire of the `gloo` weight-transfer backend (`policies.gloo_transfer`): how a round's
tensors are cut into buckets (alike on both sides, from the same metadata), the trainer's store and
the pair groups (trainer + one worker each), and the trainer's broadcast of a round.

Owns: `buckets`, `tcp_store`, `reachable` (a bounded connect: TCPStore's own can outlast its
timeout), `pair_group`, `broadcast`, `send`, `wait_ready`. Every wait is bounded by the timeout it
is given. Does not own: vLLM's engine classes and the round's calls (`policies.gloo_transfer`).
"""

from __future__ import annotations

import datetime
import socket
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from policies.gloo_transfer import GlooUpdateInfo


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


def reachable(address: str, port: int, timeout_s: float) -> None:
    """Until something accepts a connection at (`address`, `port`), within `timeout_s`: TCPStore's
    own connect retries with a backoff that can outlast its timeout by minutes. Raises TimeoutError."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            socket.create_connection((address, port), timeout=left).close()
            return
        except ConnectionRefusedError:  # the learner's store may be just starting
            time.sleep(min(0.05, max(left, 0)))
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
