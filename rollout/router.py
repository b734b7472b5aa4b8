"""Routing policy: one pure function of engine loads. The mechanism (waiting, counting) is the scheduler's."""

from __future__ import annotations

from typing import Sequence

from msgspec import Struct


class EngineLoad(Struct):
    requests: int = 0  # requests in flight on the engine
    tokens: int = 0  # outstanding tokens: prompt + max_tokens of those requests
    healthy: bool = True
    restarting: bool = False  # out of rotation until its restart succeeds


def route(loads: Sequence[EngineLoad], n: int, capacity: int, prefer: int | None = None) -> int | None:
    """Index of the engine to take a group of `n` requests, or None if none has room.

    Least outstanding tokens among healthy engines with `requests + n <= capacity`; ties go to
    fewer requests, then the lower index. `prefer` (the engine an episode or a session is on,
    holding its KV): that engine while it is healthy, waiting for its room rather than moving.
    """
    if prefer is not None and loads[prefer].healthy:
        return prefer if loads[prefer].requests + n <= capacity else None
    best: int | None = None
    for i, load in enumerate(loads):
        if not load.healthy or load.requests + n > capacity:
            continue
        if best is None or (load.tokens, load.requests) < (loads[best].tokens, loads[best].requests):
            best = i
    return best
