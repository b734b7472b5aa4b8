"""Routing policy: one pure function of engine loads. The mechanism (waiting, counting) is the scheduler's."""

from __future__ import annotations

from typing import Sequence

from msgspec import Struct


class EngineLoad(Struct):
    requests: int = 0  # requests in flight on the engine
    tokens: int = 0  # outstanding tokens: prompt + max_tokens of those requests
    healthy: bool = True
    restarting: bool = False  # out of rotation until its restart succeeds


def route(loads: Sequence[EngineLoad], n: int, capacity: int, prefer: int | None = None, batch: int | None = None) -> int | None:
    """Index of the engine to take a group of `n` requests, or None: wait for room.

    The engine with the least outstanding tokens among healthy engines (the work waiting and in
    flight on each; ties go to fewer requests, then the lower index), chosen whether or not it has
    room: with `requests + n <= capacity` it takes the group, else the group waits for it. Only an
    engine that would otherwise run less than a full batch (`requests + n <= batch`, its running
    batch: vLLM's max_num_seqs) takes it instead, the least loaded of those, so no engine drains
    while a group waits. Choosing only among engines with room sent the long samples of a
    long-tailed set to whichever engine freed slots first. `batch` None: the least loaded engine
    with room (no waiting for a fuller one).
    `prefer` (the engine an episode or a session is on, holding its KV): that engine while it is
    healthy, waiting for its room rather than moving.
    """
    if prefer is not None and loads[prefer].healthy:
        return prefer if loads[prefer].requests + n <= capacity else None
    best = fit = None  # the least loaded engine, and the least loaded with room for the group
    best_tokens = best_requests = fit_tokens = fit_requests = 0
    limit = capacity - n
    for i, load in enumerate(loads):  # runs per group over every engine: no tuple or lookup per engine
        if not load.healthy:
            continue
        requests, tokens = load.requests, load.tokens
        if best is None or tokens < best_tokens or (tokens == best_tokens and requests < best_requests):
            best, best_tokens, best_requests = i, tokens, requests
        if requests <= limit and (fit is None or tokens < fit_tokens or (tokens == fit_tokens and requests < fit_requests)):
            fit, fit_tokens, fit_requests = i, tokens, requests
    if batch is None or best == fit or fit is None:
        return fit
    return fit if fit_requests + n <= batch else None
