"""Environments for multi-turn episodes: the protocol a user implements, and checking its answers.

An environment is a class with two methods, sync or async (a sync one runs in a worker thread):

    class Calculator:
        def __init__(self, **env_args): ...
        async def reset(self, prompt: Prompt) -> Observation: ...       # or None: the prompt as it is
        async def step(self, action: Action) -> Step | tuple: ...       # (observation, reward, done)

One instance per episode (`env: "package.module:Class"`, built with `env_args`, or a factory
passed in code). An observation is text (a user message), a `{"role": ..., "content": ...}`
message (`"tool"` for a tool's answer), a list of such messages, or token ids (used as they are);
None ends nothing by itself (only `done` does). `step` gets the model's turn as an `Action`.
What an environment returns is checked here (`as_step`, `as_messages`); anything else, an
exception or a step slower than `episode.step_timeout_s` fails that episode only, with the reason.
Does not own: running turns on engines (`rollout.episodes`), rendering messages to tokens
(`rollout.chat`).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import anyio
import msgspec

from rollout.errors import InvalidConfigError, RolloutError
from rollout.rewards import import_object
from rollout.types import Prompt

Observation = str | dict[str, Any] | list[dict[str, Any]] | list[int] | None


class Action(msgspec.Struct, frozen=True):
    """The model's turn, as the environment sees it."""

    text: str  # decoded (special tokens skipped)
    token_ids: list[int]
    finish_reason: str  # "stop" (it ended its turn) or "length"
    turn: int  # 0-based


class Step(msgspec.Struct, frozen=True):
    """An environment's answer to a turn."""

    observation: Observation = None
    reward: float = 0.0
    done: bool = False


class Env(Protocol):
    def reset(self, prompt: Prompt) -> Any: ...

    def step(self, action: Action) -> Any: ...


class EnvError(RolloutError):
    """An environment raised, timed out or answered something that is not a step; fails its episode."""


EnvFactory = Callable[[], Any]


def load_env(path: str | None, env_args: dict[str, Any]) -> EnvFactory | None:
    """`package.module:Class` (or a factory function) -> a function building one environment per
    episode with `env_args`. Raises InvalidConfigError naming the `env` key."""
    if path is None:
        if env_args:
            raise InvalidConfigError("env_args: set without env")
        return None
    module_name, cls = import_object("env", path, "package.module:Class")
    if cls is None or not callable(cls):
        raise InvalidConfigError(f"env: module {module_name!r} has no class or factory {path.partition(':')[2]!r}")
    if inspect.isclass(cls) and not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise InvalidConfigError(f"env: {path!r} has no reset and step methods")
    try:
        inspect.signature(cls).bind(**env_args)
    except TypeError as e:
        raise InvalidConfigError(f"env_args: do not fit {path!r}: {e}") from e
    return lambda: cls(**env_args)


async def call(fn: Callable[..., Any], arg: Any, timeout: float | None, what: str) -> Any:
    """Call an environment method (sync in a thread, async on the loop) within `timeout`.
    Raises EnvError naming `what` and the cause."""
    try:
        with anyio.fail_after(timeout):
            if inspect.iscoroutinefunction(fn):
                return await fn(arg)
            result = await anyio.to_thread.run_sync(fn, arg, abandon_on_cancel=True)
            return await result if inspect.isawaitable(result) else result
    except TimeoutError as e:
        raise EnvError(f"environment {what} took longer than episode.step_timeout_s={timeout}") from e
    except EnvError:
        raise
    except Exception as e:
        raise EnvError(f"environment {what} raised {type(e).__name__}: {e}") from e


def as_step(value: Any) -> Step:
    """A `Step` from what `step` returned: a Step, or (observation, reward, done). Raises EnvError."""
    if isinstance(value, Step):
        step = value
    elif isinstance(value, tuple) and len(value) == 3:
        obs, reward, done = value
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
            raise EnvError(f"environment step returned reward {reward!r}, expected a finite number")
        if not isinstance(done, bool):
            raise EnvError(f"environment step returned done {done!r}, expected a bool")
        step = Step(obs, float(reward), done)
    else:
        raise EnvError(f"environment step returned {_short(value)}; expected a Step or (observation, reward, done)")
    as_messages(step.observation)  # checks its shape
    return step


def as_messages(obs: Observation) -> list[dict[str, Any]] | list[int] | None:
    """An observation as chat messages, or token ids (None: nothing). Raises EnvError."""
    if obs is None:
        return None
    if isinstance(obs, str):
        return [{"role": "user", "content": obs}]
    if isinstance(obs, dict):
        obs = [obs]
    if isinstance(obs, list) and obs and all(isinstance(x, int) and not isinstance(x, bool) for x in obs):
        return list(obs)
    if isinstance(obs, list) and obs and all(_is_message(m) for m in obs):
        return [dict(m) for m in obs]
    raise EnvError(f"environment observation {_short(obs)} is not text, a message, messages or token ids")


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 120 else text[:117] + "..."


def check_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
    """Raise EnvError when an observation's token ids fall outside the vocabulary."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise EnvError(f"{what}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
