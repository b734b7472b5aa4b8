"""What a killed driver leaves on this machine, and its removal by the next start.

A driver stopped by any catchable means shuts its engines and local Ray cluster down itself
(`RayEnginePool.shutdown`). SIGKILL (the OOM killer, `kill -9`, a scheduler's hard limit) cannot
be caught: Ray's fate-sharing ends most of what the driver started, not all of it (on the tiny
CPU engines two Ray processes, one holding a 160 MiB `psm_` ring buffer, outlived the driver). So
each run keeps a record while it runs (`Record`): the driver's pid, the processes of the local
cluster it started and of its engines, and the /dev/shm names its engines hold. A clean
shutdown deletes it. The next start on this machine (`reap`) finds the records whose driver is
gone, ends the recorded processes that still run, removes the recorded names nobody maps, and
logs what it removed.

Never another live run's: a record is reaped only once its driver is gone; a process is ended
only if it is the recorded one (pid and start time, so a reused pid is not), and a name only once
no process maps it (`policies.shm.sweep`). Records live in a per-user directory under the temp
dir. A joined cluster's processes (`ray.address`) are its own: only engines' names are recorded.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import tempfile
import time
from pathlib import Path

from policies.shm import Snapshot, alive, sweep
from rollout.log import get_logger

log = get_logger(__name__)
GRACE_S = 10.0  # a recorded process that SIGTERM has not ended by then gets SIGKILL
_serial = (
    itertools.count()
)  # one record per pool: a process may run several (one after the other, or a test's beside a session's)


def runs_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"rollout-{os.getuid()}" / "runs"


def started(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot, /proc's field 22): with the pid, it names one process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def same(pid: int, start: int | None) -> bool:
    """`pid` still runs and is the process that was recorded (not a later one with its pid)."""
    return start is not None and alive(pid) and started(pid) == start


class Record:
    """This run's record on disk: rewritten whenever it changes, deleted by `close`."""

    def __init__(self, directory: Path | None = None):
        self.pid = os.getpid()
        self.path = (directory or runs_dir()) / f"{self.pid}-{started(self.pid)}-{next(_serial)}.json"
        self.processes: dict[
            int, int | None
        ] = {}  # pid -> start time: ended by the next start if this driver is killed
        self.engines: dict[int, tuple[list[str], list[int]]] = {}  # engine -> (/dev/shm names, pids)

    def cluster(self, pids: list[int]) -> None:
        """The local cluster's processes (this driver started them)."""
        self.processes.update({p: started(p) for p in pids})
        self._write()

    def engine(self, i: int, names: list[str], pids: list[int], local_cluster: bool) -> None:
        """Engine `i` on this machine holds `names`; its processes `pids` are ended too when they
        belong to this driver's local cluster."""
        self.engines[i] = (sorted(names), sorted(pids))
        if local_cluster:
            self.processes.update({p: started(p) for p in pids})
        self._write()

    def close(self) -> None:
        self.path.unlink(missing_ok=True)

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        body = {"pid": self.pid, "start": started(self.pid), "processes": sorted(self.processes.items()),
                "engines": {str(i): list(v) for i, v in self.engines.items()}}  # fmt: skip
        tmp.write_text(json.dumps(body))
        tmp.replace(self.path)


def reap(directory: Path | None = None, grace_s: float = GRACE_S) -> list[str]:
    """Remove what killed drivers on this machine left (see the module's note); returns what was
    removed, in words, and logs it. Records of live drivers, and unreadable ones, are left alone."""
    directory = directory or runs_dir()
    removed: list[str] = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            rec = json.loads(path.read_text())
            driver, procs = (int(rec["pid"]), rec["start"]), [(int(p), s) for p, s in rec["processes"]]
            names = {n for names, _ in rec["engines"].values() for n in names}
            pids = {int(p) for _, ps in rec["engines"].values() for p in ps}
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written (a temp file is renamed into place, so only a foreign file), or not ours
        if alive(driver[0]) and driver[1] in (None, started(driver[0])):  # its driver runs: not ours to touch
            continue
        ended = _end([(p, s) for p, s in procs if same(p, s)], grace_s)
        gone = sweep(Snapshot(names, pids))  # names nobody maps now; OpenMP files and staged weights of dead pids
        path.unlink(missing_ok=True)
        if ended or gone:
            what = f"driver pid {driver[0]}: {len(ended)} processes {sorted(ended)}, /dev/shm {sorted(gone)}"
            log.warning("removed what a killed run left", driver=driver[0], processes=sorted(ended), shm=sorted(gone))
            removed.append(what)
    return removed


def _end(procs: list[tuple[int, int | None]], grace_s: float) -> list[int]:
    """SIGTERM each, SIGKILL what still runs after `grace_s`; returns their pids once all are gone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, _ in procs:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while any(same(p, s) for p, s in procs) and time.monotonic() < deadline:
            time.sleep(0.1)  # the OS process table: nothing to wait on
        if not any(same(p, s) for p, s in procs):
            break
    return [p for p, _ in procs]
