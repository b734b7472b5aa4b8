"""Calling user code (an environment's `reset` and `step`, a reward function): a sync function in a
worker thread, an async one on the event loop; what it raises is the failure of its own episode or
trajectory, never of the group or the engine.

Owns two promises:
- Whatever user code raises comes back as `UserCodeError` (the original as `__cause__`),
  `BaseException`s included: `SystemExit` (argparse on a bad tool call), a `CancelledError` of its
  own, `KeyboardInterrupt` raised in a worker thread. Only the caller's own cancellation (the
  engine closing, a cancelled submission: the enclosing cancel scope is cancelled) and a
  `KeyboardInterrupt` on the event loop's thread pass through (`passes_through`).
- A timeout measures the call itself. A sync function's clock starts when it starts running in
  its worker thread, not while it waits for one: sync environments and reward functions share
  anyio's default thread limiter (40 threads;
  `anyio.to_thread.current_default_thread_limiter().total_tokens` changes it), and thousands of
  episodes in flight queue for it. A sync call that outlives its timeout cannot be killed: the
  caller gets `TimeoutError`, the thread is abandoned (it runs on, holding no limiter token, and
  what it returns is dropped).
Does not own: what the answers mean (`rollout.episodes.env`, `rollout.inputs.rewards`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable
from typing import Any

import anyio


class UserCodeError(Exception):
    """User code raised `__cause__` (any exception but the caller's own cancellation)."""

    def __init__(self, error: BaseException):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


async def invoke(fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
    """`fn(*args)`: async on the loop, sync in a worker thread (an awaitable it returns is awaited).
    Raises TimeoutError after `timeout` seconds of the call itself, UserCodeError for what it raised."""
    scope = anyio.CancelScope()
    try:
        with scope:
            if not inspect.iscoroutinefunction(fn):
                result, raised = await anyio.to_thread.run_sync(
                    _run_in_thread, scope, timeout, fn, args, abandon_on_cancel=True
                )
                if raised is not None:  # whatever a worker thread raises is the code's own
                    raise UserCodeError(raised) from raised
            else:
                _start_clock(scope, timeout)
                result = await fn(*args)
            if inspect.isawaitable(result):
                result = await result
    except UserCodeError:
        raise
    except BaseException as e:
        if passes_through(e):
            raise
        if scope.cancel_called:  # our own deadline, whatever the code made of the cancellation
            raise TimeoutError from e
        raise UserCodeError(e) from e
    if scope.cancelled_caught:
        raise TimeoutError
    return result


def passes_through(error: BaseException) -> bool:
    """Whether `error`, raised on the event loop's thread out of user code (or out of a group of
    episodes), is not the code's own failure: the caller is being cancelled (a cancel scope around
    it was cancelled, or its asyncio task has a cancellation pending), or a KeyboardInterrupt, which
    on the loop's thread may be the process's own Ctrl-C and must stop the process. Signals reach
    the main thread only, so what a worker thread raises, KeyboardInterrupt included, never gets
    here: it is always the code's own (`invoke`)."""
    if isinstance(error, KeyboardInterrupt):
        return True
    if isinstance(error, anyio.get_cancelled_exc_class()) or isinstance(error, BaseExceptionGroup):
        return _being_cancelled()
    return False


def _being_cancelled() -> bool:
    if anyio.current_effective_deadline() == -math.inf:  # an enclosing scope was cancelled
        return True
    try:
        task = asyncio.current_task()
    except RuntimeError:  # not on asyncio
        return False
    return task is not None and task.cancelling() > 0


def _run_in_thread(
    scope: anyio.CancelScope, timeout: float | None, fn: Callable[..., Any], args: tuple
) -> tuple[Any, BaseException | None]:
    """`fn(*args)` in a worker thread, starting the clock first. What it raises comes back as a
    value: raised through the loop's future, a GeneratorExit or SystemExit is not a plain exception
    to asyncio (it would end the awaiting coroutine or the loop)."""
    if timeout is not None:
        anyio.from_thread.run_sync(_start_clock, scope, timeout)  # on the loop: the call starts now
    try:
        return fn(*args), None
    except BaseException as e:
        return None, e


def _start_clock(scope: anyio.CancelScope, timeout: float | None) -> None:
    if timeout is not None:
        scope.deadline = anyio.current_time() + timeout


def shown(value: Any) -> str:
    """`repr(value)` cut short for an error message; never raises (a repr that raises, an int past
    Python's digit limit, is shown by its type)."""
    try:
        text = repr(value)
    except Exception:
        return f"a {type(value).__name__}"
    return text if len(text) < 120 else text[:117] + "..."
