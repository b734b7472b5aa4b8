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
    best_tokens = best_requests = 0
    limit = capacity - n
    for i, load in enumerate(loads):  # runs per group over every engine: no tuple or lookup per engine
        requests = load.requests
        if requests > limit or not load.healthy:
            continue
        tokens = load.tokens
        if best is None or tokens < best_tokens or (tokens == best_tokens and requests < best_requests):
            best, best_tokens, best_requests = i, tokens, requests
    return best
