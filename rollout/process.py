"""Process-level concerns of a driver: SIGTERM handled like Ctrl-C, and the heap frozen once
the engines are up. Used by `RolloutEngine`, `SyncRolloutEngine` and the `rollout` command."""

from __future__ import annotations

import gc
import signal
import threading
from typing import Any


def freeze_heap() -> None:
    """Take every object alive now out of the garbage collector's view, as vLLM's servers and its
    benchmark client do once started. For a driver process after `RolloutEngine` has started: its
    heap then holds torch, transformers, Ray and vLLM's config classes, and a full collection
    walking it stalled the scheduler for 0.2-0.3 s every few seconds on the tiny bench. Objects
    alive now that later form unreachable cycles are never freed, so call it once, after start-up
    (the `rollout` command does), and `gc.unfreeze()` before the process exits.
    """
    gc.collect()
    gc.freeze()


def catch_sigterm() -> Any:
    """SIGTERM exits like Ctrl-C does, through `__aexit__`/`__exit__`, so the engines shut down
    cleanly. Only where nobody else handles it (the default handler, in the main thread).
    Returns the handler to restore, or None when nothing was installed."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        return signal.signal(signal.SIGTERM, exit_on_sigterm)
    return None


def restore_sigterm(old: Any) -> None:
    if old is not None:
        signal.signal(signal.SIGTERM, old)


def exit_on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the shutdown short
    raise SystemExit(128 + signum)  # unwinds the event loop; asyncio.run cancels the tasks, __aexit__ runs
