"""The class handed to `ray.remote` for an engine: a shell whose public methods call the same
methods of the object it holds, and nothing else.

Ray wraps every method of an actor class for its tracing (`ray.util.tracing`), private ones
included and with tracing off: each call goes through a wrapper that looks the flag up, and a
coroutine method gets a coroutine of its own around it. On `ray.remote(VLLMPolicy)` that wrapping
was on every call the policy makes to itself: per request (`generate`, `_run_piece`, `_piece`),
per engine step and per request waiting in vLLM's queue (`_after_step`, `_started`, `_state`),
per progress report and per results frame. Here Ray wraps the shell's methods, the ones the driver
calls; the policy's own calls stay plain.
"""

from __future__ import annotations

import inspect
from typing import Any


def shell(cls: type) -> type:
    """A class to pass to `ray.remote` in place of `cls`: built with `cls`'s arguments, it holds a
    `cls` (`.inner`) and forwards each public method (coroutine, async generator or plain) to it."""
    methods: dict[str, Any] = {"__init__": _init(cls), "__module__": __name__, "__doc__": cls.__doc__}
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        if not name.startswith("_"):
            methods[name] = _forward(name, fn)
    return type(cls.__name__, (), methods)  # the same name: Ray's actor and log prefixes stay `VLLMPolicy`


def _init(cls: type) -> Any:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        self.inner = cls(*args, **kwargs)

    return __init__


def _forward(name: str, fn: Any) -> Any:
    if inspect.isasyncgenfunction(fn):

        async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            async for item in getattr(self.inner, name)(*args, **kwargs):
                yield item

    elif inspect.iscoroutinefunction(fn):

        async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await getattr(self.inner, name)(*args, **kwargs)

    else:

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.inner, name)(*args, **kwargs)

    call.__name__, call.__qualname__, call.__doc__ = name, fn.__qualname__, fn.__doc__
    return call
