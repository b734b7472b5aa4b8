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
What an environment returns is checked here, field by field (`as_step`, `as_messages`: a reward
that is not a finite real number, a `done` that is not a bool, a message with an unknown role, text
that is not UTF-8, `tool_calls` not in OpenAI's shape or not JSON); anything else, whatever it
raises (`BaseException`s too, `rollout.inputs.usercode`) or a call longer than `episode.step_timeout_s`
fails that episode only, naming the field or the cause.
Does not own: running turns on engines (`rollout.episodes.loop`), rendering messages to tokens
(`rollout.episodes.chat`).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec

from rollout.errors import InvalidConfigError, RolloutError
from rollout.inputs.rewards import finite, import_object
from rollout.inputs.usercode import UserCodeError, invoke, shown
from rollout.types import Prompt

Observation = str | dict[str, Any] | list[dict[str, Any]] | list[int] | None
ROLES = ("system", "user", "assistant", "tool")  # what an observation's messages may be


class Action(msgspec.Struct, frozen=True):
    """The model's turn, as the environment sees it."""

    text: str  # decoded (special tokens skipped)
    token_ids: list[int]
    finish_reason: str  # "stop" (it ended its turn) or "length"
    turn: int  # 0-based
    # What vLLM's parsers (`serve.tool_parser`, `serve.reasoning_parser`) read in `text`, as a chat
    # reply carries them: the text outside tool calls and reasoning, the calls in OpenAI's shape
    # (`{"id", "type": "function", "function": {"name", "arguments": JSON string}}`), the reasoning.
    content: str | None = None
    tool_calls: list[dict[str, Any]] = msgspec.field(default_factory=list)
    reasoning: str | None = None


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
    """Call an environment method (sync in a worker thread, async on the loop) within `timeout` of
    the call itself (`rollout.inputs.usercode`). Raises EnvError naming `what` and the cause."""
    try:
        return await invoke(fn, arg, timeout=timeout)
    except TimeoutError as e:
        raise EnvError(f"environment {what} took longer than episode.step_timeout_s={timeout}") from e
    except UserCodeError as e:
        raise EnvError(f"environment {what} raised {e}") from e.error


def as_step(value: Any, what: str = "step") -> Step:
    """A `Step` from what `step` returned: a Step, or (observation, reward, done), every field
    checked (a Struct checks nothing when built). Raises EnvError naming `what` and the field."""
    if isinstance(value, Step):
        obs, reward, done = value.observation, value.reward, value.done
    elif isinstance(value, tuple) and len(value) == 3:
        obs, reward, done = value
    else:
        raise EnvError(f"environment {what} returned {shown(value)}; expected a Step or (observation, reward, done)")
    if (number := finite(reward)) is None:
        raise EnvError(f"environment {what}: Step.reward: expected a finite number, got {shown(reward)}")
    if not isinstance(done, bool):
        raise EnvError(f"environment {what}: Step.done: expected a bool, got {shown(done)}")
    as_messages(obs, f"environment {what}: Step.observation")
    return Step(obs, number, done)


def as_messages(obs: Observation, where: str = "environment observation") -> list[dict[str, Any]] | list[int] | None:
    """An observation as chat messages, or token ids (None: nothing). Raises EnvError naming
    `where` and the field within it."""
    if obs is None:
        return None
    if isinstance(obs, str):
        return [{"role": "user", "content": _text(obs, where)}]
    if isinstance(obs, dict):
        return [_message(obs, where)]
    if isinstance(obs, list) and obs and all(isinstance(x, int) and not isinstance(x, bool) for x in obs):
        return list(obs)
    if isinstance(obs, list) and obs and any(isinstance(m, dict) for m in obs):
        return [_message(m, f"{where}[{i}]") for i, m in enumerate(obs)]
    raise EnvError(f"{where}: expected text, a message, messages or token ids, got {shown(obs)}")


def _message(m: Any, where: str) -> dict[str, Any]:
    """A chat message an environment sent, checked field by field (what the chat template reads)."""
    if not isinstance(m, dict):
        raise EnvError(f"{where}: expected a message {{'role': ..., 'content': ...}}, got {shown(m)}")
    if m.get("role") not in ROLES:
        raise EnvError(f"{where}.role: expected one of {', '.join(ROLES)}, got {shown(m.get('role'))}")
    _text(m.get("content"), f"{where}.content")
    for key in ("name", "tool_call_id"):
        if key in m:
            _text(m[key], f"{where}.{key}")
    if "tool_calls" in m:
        _tool_calls(m["tool_calls"], f"{where}.tool_calls")
    return dict(m)


def _tool_calls(calls: Any, where: str) -> None:
    """OpenAI's shape: [{"type": "function", "id": ..., "function": {"name": ..., "arguments": ...}}],
    arguments a JSON string or an object, the whole of it JSON (templates write it with `tojson`)."""
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls
    ):
        raise EnvError(
            f"{where}: expected a list of {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}, "
            f"got {shown(calls)}"
        )
    for i, call in enumerate(calls):
        fn = call["function"]
        _text(fn.get("name"), f"{where}[{i}].function.name")
        args = fn.get("arguments")
        if not isinstance(args, str | dict):
            raise EnvError(f"{where}[{i}].function.arguments: expected a JSON string or an object, got {shown(args)}")
        if isinstance(args, str):
            try:
                json.loads(args)
            except (ValueError, RecursionError) as e:
                raise EnvError(f"{where}[{i}].function.arguments: is not JSON: {shown(args)}: {e}") from e
    try:
        json.dumps(calls, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise EnvError(f"{where}: is not JSON: {type(e).__name__}: {e}") from e


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise EnvError(f"{where}: expected a string, got {shown(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise EnvError(f"{where}: is not valid UTF-8: {e.reason} at {e.start}") from e
    return value


def check_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
    """Raise EnvError when an observation's token ids fall outside the vocabulary."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise EnvError(f"{what}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
