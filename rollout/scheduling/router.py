"""Routing policy: one pure function of engine loads. The mechanism (waiting, counting) is the scheduler's."""

from __future__ import annotations

from collections.abc import Sequence

from msgspec import Struct


class EngineLoad(Struct):
    requests: int = 0  # requests in flight on the engine
    tokens: int = 0  # outstanding tokens: prompt + max_tokens of those requests
    healthy: bool = True
    restarting: bool = False  # out of rotation until its restart succeeds


SPAN = 1 << 32  # an engine's key: tokens * SPAN + requests, one integer that orders as (tokens, requests)
OUT = 1 << 200  # the key of an engine out of rotation: after every other


def key(load: EngineLoad) -> int:
    return load.tokens * SPAN + load.requests if load.healthy else OUT


def count(load: EngineLoad) -> int:
    return load.requests if load.healthy else OUT


def route(
    loads: Sequence[EngineLoad], n: int, capacity: int, prefer: int | None = None, batch: int | None = None,
    keys: Sequence[int] | None = None, counts: Sequence[int] | None = None,
) -> int | None:  # fmt: skip
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
    `keys`: each engine's `key`, kept up to date by the caller (`Runner`): the least loaded engine
    is then found at C speed (`min`, `index`), not by a Python loop over every engine per group.
    Without, they are computed here. `counts`: each engine's requests (OUT
    when out of rotation), kept the same way: when no engine runs below a full batch, the answer
    (wait) is known without looking for the least loaded engine with room, a loop in Python that
    was most of the driver's time once groups were routed as each sample ended.
    """
    if prefer is not None and loads[prefer].healthy:
        return prefer if loads[prefer].requests + n <= capacity else None
    if keys is None:
        keys, counts = [key(load) for load in loads], [count(load) for load in loads]
    least = min(keys, default=OUT)
    if least == OUT:  # no engine in rotation
        return None
    limit = capacity - n
    if least % SPAN <= limit:  # the least loaded engine has room: it takes the group
        return keys.index(least)
    if batch is not None and counts is not None and min(counts) + n > batch:
        return None  # whichever has room would run more than a full batch: wait for the least loaded
    fit = min((k for k in keys if k != OUT and k % SPAN <= limit), default=None)  # the least loaded with room
    if fit is None or (batch is not None and fit % SPAN + n > batch):
        return None
    return keys.index(fit)
