"""Reward functions: loaded from `reward: "package.module:function"`, called once per trajectory.

The function is `reward(prompt: Prompt, trajectory: Trajectory) -> float` (or `async def`). It
runs off the engine path: a sync function in a worker thread, an async one on the event loop.
Whatever it raises (`BaseException`s too, `rollout.inputs.usercode`), or a value that is not a finite
real number, marks that trajectory failed (`error` holds the reason or the traceback); nothing
else stops.
"""

from __future__ import annotations

import importlib
import math
import numbers
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from rollout.errors import InvalidConfigError
from rollout.inputs.usercode import UserCodeError, invoke, shown
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
    """Set `traj.reward`, or mark `traj` failed with the reason. Never raises (but the caller's
    cancellation): whatever `fn` raises, `SystemExit` included, fails this trajectory only."""
    if not traj.ok:
        return
    try:
        value = await invoke(fn, prompt, traj)
    except UserCodeError as e:
        traj.finish_reason = "error"
        traj.error = "reward function raised:\n" + "".join(traceback.format_exception(e.error, limit=-8))
        return
    if (number := finite(value)) is None:
        traj.finish_reason = "error"
        traj.error = f"reward function returned {shown(value)}, expected a finite number"
        return
    traj.reward = number


def finite(value: Any) -> float | None:
    """`value` as a float if it is a finite real number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError):  # an int past float's range, an odd Real
        return None
    return number if math.isfinite(number) else None
