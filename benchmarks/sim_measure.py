"""What `benchmarks/cluster_sim.py` measures of the driver's process besides its CPU time: CPU by
thread, RSS, and its garbage collections."""

from __future__ import annotations

import gc
import os
import time
from typing import Any


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads by name: the event loop's (`main`) and Ray's own."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        name = "main" if int(tid) == os.getpid() else stat[stat.index("(") + 1 : stat.rindex(")")].rstrip("0123456789")
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class Collections:
    """The driver's garbage collections while it lives (`gc.callbacks`): how many of each generation,
    the time in them, the longest full one (what a finished group waits behind)."""

    def __init__(self) -> None:
        self.count, self.seconds, self.longest = [0, 0, 0], 0.0, 0.0
        self._t = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
            return
        took = time.perf_counter() - self._t
        self.count[info["generation"]] += 1
        self.seconds += took
        if info["generation"] == 2:
            self.longest = max(self.longest, took)

    def stop(self) -> None:
        gc.callbacks.remove(self._on)

    def figures(self, wall: float) -> dict[str, Any]:
        return {"gc_collections": self.count, "gc_share": self.seconds / wall, "gc_full_max_ms": 1e3 * self.longest}
