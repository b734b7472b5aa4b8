"""How a weight plane's bytes move, and the store that coordinates it; torch's public APIs only.

Owns: the plane's rendezvous store (a `torch.distributed.TCPStore` hosted by learner rank 0; every
other party is a client), waiting on its keys with a deadline and an abort check, and the two data
paths behind one interface:
- process groups (`gloo` on CPU, `nccl` on GPU): `Groups` creates standalone process groups
  (`ProcessGroupGloo` / `ProcessGroupNCCL` over a `PrefixStore`, never the default group, so
  vLLM's own is untouched); a bucket is one `broadcast` from the learner rank (group rank 0);
- shared slots (`shm` on one host's CPU, `cuda_ipc` on one GPU): the learner rank owns `count`
  buffers of `bucket_bytes` (files in /dev/shm mapped by every worker, or CUDA memory shared by
  IPC handle); a bucket is written into a slot, and the slot is reused once every engine acked it.
  /dev/shm holds `count * bucket_bytes` per learner rank, whatever the model's size.
Does not own: what goes in a bucket (`policies.transfer`), the rounds (`rollout.plane`,
`policies.plane_worker`).
"""

from __future__ import annotations

import datetime
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout.errors import WeightSyncError

POLL_S = 1.0  # how often a long wait on the store checks whether the round was aborted


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def connect(host: str, port: int, timeout_s: float, *, master: bool = False) -> Any:
    """The plane's store: hosted here (`master`, port 0 picks a free one) or reached as a client."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(host, port, None, master, timeout=_delta(timeout_s), wait_for_workers=False)
    except Exception as e:  # torch raises DistNetworkError / RuntimeError, by version
        what = f"host the weight plane's store on {host}:{port}" if master else f"reach the weight plane's store at {host}:{port}"
        raise WeightSyncError(f"cannot {what}: {type(e).__name__}: {e}", []) from e


def wait_key(store: Any, key: str, timeout_s: float | None, what: str, abort: Callable[[], str | None] | None = None) -> bytes:
    """The value of `key` once set. Raises TimeoutError naming `what` after `timeout_s` (None: no
    deadline), WeightSyncError with `abort()`'s reason as soon as it returns one."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
        if left <= 0:
            raise TimeoutError(f"no {what} within {timeout_s:g} s")
        try:
            store.wait([key], _delta(left))
            return store.get(key)
        except Exception as e:
            if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                raise ConnectionError(f"waiting for {what}: the store is gone ({type(e).__name__}: {e}); the learner disconnected?") from e
        if abort is not None and (reason := abort()):
            raise WeightSyncError(reason, [])


class Groups:
    """Process groups of one party, by key, created on first use; `backend` gloo or nccl."""

    def __init__(self, backend: str, store: Any, timeout_s: float, device: Any = None):
        self.backend, self.store, self.timeout_s, self.device = backend, store, timeout_s, device
        self.groups: dict[str, Any] = {}

    def get(self, key: str, rank: int, world: int) -> Any:
        """Group `key`, joining it as `rank` of `world` if new (blocks until every member joined)."""
        if key not in self.groups:
            import torch.distributed as dist

            store = dist.PrefixStore(f"group/{key}/", self.store)
            if self.backend == "gloo":
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = _delta(self.timeout_s)
                opts._devices = [dist.ProcessGroupGloo.create_default_device()]
                self.groups[key] = dist.ProcessGroupGloo(store, rank, world, opts)
            else:
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = _delta(self.timeout_s)
                self.groups[key] = dist.ProcessGroupNCCL(store, rank, world, opts)
        return self.groups[key]

    def keep(self, keys: set[str]) -> None:
        """Leave every group not in `keys` (an engine restarted, or a transfer on it failed)."""
        for key in set(self.groups) - keys:
            self.drop(key)

    def drop(self, key: str) -> None:
        pg = self.groups.pop(key, None)
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # a group broken by a dead peer has nothing left to close
                pass

    @staticmethod
    def broadcast(pg: Any, buf: Any) -> Any:
        """Start a broadcast of `buf` from group rank 0; returns the work to `wait()` on."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return pg.broadcast([buf], opts)

    def staging(self, nbytes: int) -> Any:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=self.device if self.backend == "nccl" else "cpu")


SLOT_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
_SLOT_NAME = re.compile(r"rollout-plane-.+-(\d+)-r\d+-s\d+")  # ...-{learner pid}-r{rank}-s{slot}


def sweep_orphan_slots() -> list[str]:
    """Unlink shm slots whose learner process is gone: a learner killed mid-round could not unlink
    its own. Run by a learner making slots (a restarted one cleans after the one before) and by a
    worker whose round failed. Slots are host-local, and so are the pids in their names."""
    from policies.shm import alive

    removed = []
    for path in Path(SLOT_DIR).glob("rollout-plane-*"):
        if (m := _SLOT_NAME.fullmatch(path.name)) and not alive(int(m.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


class Slots:
    """A learner rank's shared buffers: `count` of `nbytes`, in /dev/shm (shm) or on its GPU (cuda_ipc)."""

    def __init__(self, backend: str, session: str, rank: int, count: int, nbytes: int, device: Any = None):
        import torch

        self.backend, self.paths, self.nbytes = backend, [], nbytes
        if backend == "shm":
            sweep_orphan_slots()
            self.paths = [f"{SLOT_DIR}/rollout-plane-{session}-{os.getpid()}-r{rank}-s{i}" for i in range(count)]
            self.views = [torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8) for p in self.paths]
            self.handles: list[Any] = [[p, nbytes] for p in self.paths]
        else:
            self.views = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(count)]
            self.handles = [ipc_handle(v) for v in self.views]

    def close(self) -> None:
        for p in self.paths:
            try:
                os.unlink(p)  # workers' mappings stay valid until they let go
            except FileNotFoundError:
                pass
        self.paths, self.views = [], []


def open_slots(backend: str, handles: list[Any], device: Any = None) -> list[Any]:
    """A worker's views of a learner rank's slots. Raises OSError / RuntimeError when they cannot be
    reached (shm: the engine is not on the learner's host; cuda_ipc: not on its GPU)."""
    import torch

    if backend == "shm":
        return [torch.from_file(path, shared=True, size=int(n), dtype=torch.uint8) for path, n in handles]
    return [from_ipc_handle(h, device) for h in handles]


# CUDA IPC: the handle of a learner's CUDA buffer in plain values (no pickle crosses the store),
# rebuilt with torch's own `rebuild_cuda_tensor` on the worker's index of the same physical GPU.
def ipc_handle(t: Any) -> list[Any]:
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)
    (_, size, stride, offset, _, _, device, handle, size_bytes, offset_bytes, _, ref_handle, ref_offset, event, event_sync) = args
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return [list(size), list(stride), offset, device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event, event_sync, uuid]


def from_ipc_handle(h: list[Any], device: Any = None) -> Any:
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    size, stride, offset, _, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event, event_sync, uuid = h
    local = [i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == uuid]
    if not local:
        raise RuntimeError(f"cuda_ipc: the learner's GPU {uuid} is not visible here; use nccl for an engine on another GPU")
    return rebuild_cuda_tensor(
        torch.Tensor, tuple(size), tuple(stride), offset, torch.storage.UntypedStorage, torch.uint8, local[0],
        handle, size_bytes, offset_bytes, False, ref_handle, ref_offset, event, event_sync,
    )  # fmt: skip
