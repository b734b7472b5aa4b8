"""The OS's view of what a driver started: its processes below it, which are alive, waiting for
them to go, and killing what a SIGKILLed driver could not stop."""

from __future__ import annotations

import os
import signal
import time


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        out.add(pid)
    return out


def wait_gone(pids: set[int], timeout: float = 60) -> set[int]:
    deadline = time.monotonic() + timeout
    while (left := alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.5)  # polling the OS process table; nothing to wait on
    return left


def kill_orphans(pids: set[int]) -> None:
    """What a SIGKILLed driver started and could not stop (its Ray cluster, its engines)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive(pids):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if not wait_gone(pids, timeout=30):
            return
