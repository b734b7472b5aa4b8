"""An engine that fails to start: its cause in one line, and nothing of it left in /dev/shm.

vLLM's engine core runs in a process of its own; when it fails during start-up (a KV cache too
small for one request at `max_model_len`, a model it cannot load) it logs the traceback to its
stderr and exits, and `AsyncLLM` raises only "Engine core initialization failed. See root cause
above". The root cause is the last exception line the engine core wrote. Under Ray an actor's
stderr (which its engine core inherits) is a file, Ray's or the run's engine log
(`rollout.log.output_to_file`), so the actor can read it back (`cause_from_stderr`) and the
message names that log; elsewhere (a terminal) it is already on screen and vLLM's message is kept.
The shared memory the half-built engine had opened is mapped by nobody once it is gone
(`sweep_new`).
"""

from __future__ import annotations

import gc
import os
import re

from policies.shm import PREFIXES, SHM, Snapshot, sweep
from rollout.log import ENGINE_LOG_ENV

# "ValueError: To serve at least one request ...", "torch.OutOfMemoryError: ...": a traceback's last line.
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit): \S.*$")
_VLLM_WRAPPER = "Engine core initialization failed"
TAIL_BYTES = 256 * 1024


def shm_names() -> set[str]:
    """vLLM's names in /dev/shm now (every process's)."""
    try:
        return {n for n in os.listdir(SHM) if n.startswith(PREFIXES)}
    except OSError:
        return set()


def start_failure(error: BaseException, before: set[str], engine_id: int) -> str:
    """Why engine `engine_id` failed to start, in one line; removes the /dev/shm names made since
    `before` (`shm_names()` before the start) that no live process maps any more."""
    gc.collect()  # the half-built AsyncLLM's message queues let go of their mappings
    sweep_new(before)
    cause = cause_from_stderr() or f"{type(error).__name__}: {error}"
    where = f" (its log: {path})" if (path := os.environ.get(ENGINE_LOG_ENV)) else ""
    return f"engine {engine_id} failed to start: {cause}{where}"


def sweep_new(before: set[str]) -> list[str]:
    """Unlink vLLM names made since `before` that nobody maps: the failed engine's (another engine
    starting beside it maps its own while it lives, so they stay)."""
    return sweep(Snapshot(shm_names() - before, set()))


def cause_from_stderr(path: str | None = None) -> str | None:
    """The last exception line in the tail of this process's stderr (a file under Ray), other than
    vLLM's wrapper saying to look above; None when stderr is not a file or holds none."""
    try:
        path = path or os.readlink("/proc/self/fd/2")
        if not os.path.isfile(path):
            return None
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - TAIL_BYTES))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    lines = [line.strip() for line in tail.splitlines()]
    causes = [line for line in lines if _EXCEPTION_LINE.match(line) and _VLLM_WRAPPER not in line]
    return causes[-1] if causes else None
