"""Where a CPU engine's processes run, and behind whom: its own cores, and after the driver.

A CPU engine's busy processes (vLLM's engine core and its model worker) fill the cores they run
on, and on a small machine the driver shares those cores. This actor's front-end (vLLM's output
handler, the streamed deltas, the data path) runs on them only while it starts them: they inherit
its cores, and then it returns to the cores it had, so that it handles one step's outputs while
the engine core computes the next (as vLLM's own API server does, a process of its own), instead
of taking turns with the engine core on its cores. Ray
starts its workers at nice 15 so that the driver and the raylet come first, but the kernel's
autogroups (`kernel.sched_autogroup_enabled`, on by default) give every session an equal share of
the CPU and apply nice only inside a session: every Ray worker is in the raylet's session, so the
nice orders nothing against the driver: on a small machine the driver's threads wait runnable but
unscheduled for seconds, finished samples reach it late, and the engines' batches drain while the
driver counts them full. So each CPU engine lowers its autogroup (Ray's session on that machine) to
Ray's worker nice, which restores what Ray meant: the driver first. (A Ray worker leads its process
group, so it cannot start a session, and an autogroup, of its own.) GPU engines are left alone:
there the engine core feeds the GPU, and nothing should come before it.
"""

from __future__ import annotations

import os
import socket

ENGINE_NICE = 15  # Ray's own worker niceness (`RAY_worker_niceness`): the driver comes first
AUTOGROUP = "/proc/self/autogroup"
DRIVER_SESSION = "ROLLOUT_DRIVER_AUTOGROUP"  # the driver's "host:/autogroup-N", set in each engine's environment


def session() -> str:
    """This process's "host:/autogroup-N" ("" outside an autogroup): what `behind_driver` compares."""
    return _session(_autogroup())


def _autogroup() -> str:
    """This process's /proc/self/autogroup: "/autogroup-N nice K", or "" where the kernel has no
    autogroups, or for a process in the root autogroup (one that never started a session, such as
    a container's init and everything below it: the kernel prints nothing for it)."""
    try:
        with open(AUTOGROUP) as f:
            return f.read().strip()
    except OSError:
        return ""


def _session(autogroup: str) -> str:
    """ "host:/autogroup-N" of a /proc/PID/autogroup text ("" for "")."""
    return f"{socket.gethostname()}:{autogroup.split()[0]}" if autogroup else ""


def pin(cores: str) -> set[int]:
    """The calling thread, and the engine core and worker processes vLLM spawns from it next (they
    inherit the mask), on `cores` ("0,1"). Left to the OS, the busy processes of engines sharing
    cores run slower and far less evenly. Returns the thread's cores before, for `unpin`."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    return before


def unpin(before: set[int]) -> None:
    """The calling thread back on the cores `pin` returned, once the processes it spawned run on
    theirs."""
    os.sched_setaffinity(0, before)


def behind_driver(nice: int = ENGINE_NICE) -> str:
    """Lower this process's autogroup (Ray's session on this machine: the raylet and its workers,
    this engine among them, and the processes vLLM spawns) to autogroup nice `nice`; where the
    kernel has no autogroups, or this process is in the root one, this process (and what it spawns
    next) to nice `nice`. Never raises a priority, and leaves an autogroup the driver is in
    (`DRIVER_SESSION`: a raylet started from the driver's session) as it is: there nice orders
    them, and the group holds whatever else that session runs. Returns the autogroup or nice now,
    for the log."""
    now = _autogroup()  # "/autogroup-2521 nice 0"
    if not now:  # no autogroups, or the root one (not ours to lower): plain nice orders the processes
        os.setpriority(os.PRIO_PROCESS, 0, max(nice, os.getpriority(os.PRIO_PROCESS, 0)))
        return f"nice {os.getpriority(os.PRIO_PROCESS, 0)}"
    if _session(now) == os.environ.get(DRIVER_SESSION):
        return f"{now}, the driver's"
    if int(now.rsplit(" ", 1)[1]) < nice:
        with open(AUTOGROUP, "w") as f:
            f.write(str(nice))  # lowering an autogroup needs no privilege
        now = _autogroup()
    return now
