"""Process-level concerns of a driver: SIGTERM handled like Ctrl-C, and the heap frozen once
the engines are up. Used by `RolloutEngine`, `SyncRolloutEngine` and the `rollout` command."""

from __future__ import annotations

import asyncio
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

    Called on a running event loop, the loop handles it (`loop.add_signal_handler`, as asyncio's
    runner handles Ctrl-C): the SystemExit is raised between two of the loop's callbacks. Raised by
    a plain handler, it came out of whatever code the loop was running, where a group's guard takes
    a SystemExit for that code's own (user code's `sys.exit` fails its group,
    `rollout.inputs.usercode`): one group failed, the signal lost, and a busy driver never stopped.
    Returns what `restore_sigterm` takes, or None when nothing was installed."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        return None
    try:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, exit_on_sigterm, signal.SIGTERM, None)
        return loop
    except (RuntimeError, NotImplementedError):  # no loop here (`SyncRolloutEngine`), or one without signals
        return signal.signal(signal.SIGTERM, exit_on_sigterm)


def restore_sigterm(old: Any) -> None:
    if isinstance(old, asyncio.AbstractEventLoop):
        if not old.is_closed():
            old.remove_signal_handler(signal.SIGTERM)  # the default handler again
    elif old is not None:
        signal.signal(signal.SIGTERM, old)


def exit_on_sigterm(signum: int, frame: Any) -> None:
    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:  # on the loop: one more came before the first was handled
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the shutdown short
    raise SystemExit(128 + signum)  # out of the loop: asyncio's runner cancels the tasks, __aexit__ runs
