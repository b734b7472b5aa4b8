"""Shared-memory hygiene for an engine's process tree: nothing left in /dev/shm after shutdown.

vLLM's engine core and workers talk through POSIX shared memory (`psm_*` ring buffers,
`sem.mp-*` semaphores); Intel OpenMP leaves a `__KMP_REGISTERED_LIB_<pid>_*` file per process.
A process that is killed before its clean-up (the engine core takes longer than vLLM's shutdown
grace period on a loaded machine; a signal mid-step) leaves them behind, and a `psm_` buffer is
160 MiB of RAM. `snapshot()` records what this process and its descendants hold while they run;
`sweep()` after shutdown removes the ones nobody maps any more. An engine records its names at
start; when its whole actor is killed, its replacement (or the pool at shutdown) sweeps them.
Weights staged for an update (`staging_dir`) carry the engine process's pid and go the same way.
Only names such a tree used are ever touched, so other programs' segments are safe.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

SHM = Path("/dev/shm")
PREFIXES = ("psm_", "sem.mp-")


def staging_dir(engine_id: int) -> str:
    """A new directory for weights staged by this process: in /dev/shm when there is one
    (written and read once), else the default tmp dir; named by pid, so a sweep after this
    process is killed finds it."""
    fast = str(SHM) if SHM.is_dir() and os.access(SHM, os.W_OK) else None
    return tempfile.mkdtemp(prefix=f"rollout-weights-{engine_id}-{os.getpid()}-", dir=fast)


def _staged_by(pid: int) -> list[Path]:
    return [p for d in {SHM, Path(tempfile.gettempdir())} for p in d.glob(f"rollout-weights-*-{pid}-*")]


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def mapped(pids: set[int] | None = None) -> set[str]:
    """Names under /dev/shm mapped by `pids` (every process when None). Matched by inode: a
    semaphore stays mapped under the temporary name it was created as, long since renamed."""
    if pids is None:
        pids = {int(e) for e in os.listdir("/proc") if e.isdigit()}
    inodes = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                inodes.update(int(line.split()[4]) for line in f if "/dev/shm/" in line)
        except OSError:  # exited, or not readable
            continue
    out = set()
    for entry in os.scandir(SHM):
        try:
            if entry.inode() in inodes:
                out.add(entry.name)
        except OSError:
            continue
    return out


class Snapshot:
    def __init__(self, names: set[str], pids: set[int]):
        self.names, self.pids = names, pids

    def merge(self, other: Snapshot) -> Snapshot:
        return Snapshot(self.names | other.names, self.pids | other.pids)


def snapshot(pid: int | None = None) -> Snapshot:
    """What `pid` (default: this process) and its descendants hold in /dev/shm now."""
    root = os.getpid() if pid is None else pid
    pids = descendants(root) | {root}
    return Snapshot({n for n in mapped(pids) if n.startswith(PREFIXES)}, pids)


def sweep(snap: Snapshot) -> list[str]:
    """Unlink the snapshot's segments no live process maps; and the OpenMP files and staged
    weights of its dead pids."""
    in_use = mapped()
    removed = []
    candidates = [SHM / n for n in snap.names if n not in in_use]
    for pid in snap.pids:
        if not alive(pid):
            candidates += [*SHM.glob(f"__KMP_REGISTERED_LIB_{pid}_*"), *_staged_by(pid)]
    for path in candidates:
        try:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            continue
    return removed


async def sweep_when_gone(snap: Snapshot, timeout: float = 30.0) -> list[str]:
    """`sweep` once the snapshot's processes have exited (a killed tree takes a moment to go;
    until then it still maps its segments), waiting at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in snap.pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)  # the OS process table: nothing to wait on
    return sweep(snap)


def alive(pid: int) -> bool:
    """A process that still runs (a zombie has let go of its memory: not alive)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
