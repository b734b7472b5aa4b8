"""Reward functions: loaded from `reward: "package.module:function"`, called once per trajectory.

The function is `reward(prompt: Prompt, trajectory: Trajectory) -> float` (or `async def`). It
runs off the engine path: a sync function in a worker thread, an async one on the event loop.
An exception, or a value that is not a finite number, marks that trajectory failed (`error`
holds the reason or the traceback); nothing else stops.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import anyio

from rollout.errors import InvalidConfigError
from rollout.types import Prompt, Trajectory

RewardFn = Callable[[Prompt, Trajectory], Any]


def import_object(key: str, path: str, form: str) -> tuple[str, Any]:
    """Import the `package.module:name` a config `key` names; returns (module name, the object or
    None if the module has no such name). The current directory is searched too (after installed
    modules), as `python -m` does: `rollout` is a console script, whose sys.path lacks it.
    Raises InvalidConfigError naming `key` for a path not of `form` or a module that does not import."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidConfigError(f"{key}: expected {form!r}, got {path!r}")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise InvalidConfigError(f"{key}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from e
    return module_name, getattr(module, attr, None)


def load_reward(path: str | None) -> RewardFn | None:
    """Import `package.module:function`; raises InvalidConfigError naming the `reward` key."""
    if path is None:
        return None
    module_name, fn = import_object("reward", path, "package.module:function")
    if fn is None:
        raise InvalidConfigError(f"reward: module {module_name!r} has no attribute {path.partition(':')[2]!r}")
    if not callable(fn):
        raise InvalidConfigError(f"reward: {path!r} is not callable")
    return fn


async def score(fn: RewardFn, prompt: Prompt, traj: Trajectory) -> None:
    """Set `traj.reward`, or mark `traj` failed with the reason. Never raises (but cancellation)."""
    if not traj.ok:
        return
    try:
        if inspect.iscoroutinefunction(fn):
            value = await fn(prompt, traj)
        else:
            value = await anyio.to_thread.run_sync(fn, prompt, traj)
    except Exception:
        traj.finish_reason = "error"
        traj.error = "reward function raised:\n" + traceback.format_exc(limit=8)
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        traj.finish_reason = "error"
        traj.error = f"reward function returned {value!r}, expected a finite number"
        return
    traj.reward = float(value)
