"""The routing policy: a pure function of engine loads."""

from __future__ import annotations

import asyncio
import random

import pytest

from rollout.config import load_config
from rollout.scheduling.router import EngineLoad, count, key, route
from rollout.scheduling.runner import Runner


def loads(*specs: tuple) -> list[EngineLoad]:
    return [EngineLoad(*s) for s in specs]


def test_least_outstanding_tokens_wins():
    assert route(loads((1, 500), (3, 100), (0, 300)), n=1, capacity=8) == 1


def test_tokens_outrank_requests():
    # engine 0 has fewer requests but more outstanding tokens
    assert route(loads((0, 200), (5, 100)), n=1, capacity=8) == 1


def test_tie_on_tokens_goes_to_fewer_requests():
    assert route(loads((3, 100), (2, 100), (4, 100)), n=1, capacity=8) == 1


def test_full_tie_goes_to_lower_index():
    assert route(loads((2, 100), (2, 100), (2, 100)), n=1, capacity=8) == 0
    assert route(loads((5, 900), (2, 100), (2, 100)), n=1, capacity=8) == 1


def test_empty_engines():
    assert route(loads((0, 0), (0, 0)), n=4, capacity=4) == 0


def test_whole_group_must_fit():
    # engine 0 is idlest by tokens but has room for 2 more requests, the group needs 3
    assert route(loads((6, 10), (4, 500)), n=3, capacity=8) == 1
    assert route(loads((6, 10), (4, 500)), n=2, capacity=8) == 0  # exactly at capacity fits


def test_skips_unhealthy():
    assert route(loads((0, 0, False), (7, 900)), n=1, capacity=8) == 1
    assert route(loads((0, 0, False), (7, 900, True), (7, 900, False)), n=1, capacity=8) == 1


@pytest.mark.parametrize(
    "specs, n, capacity",
    [
        (((8, 10), (8, 10)), 1, 8),  # all full
        (((6, 10), (7, 10)), 3, 8),  # room for some requests, not for the group
        (((0, 0, False), (0, 0, False)), 1, 8),  # all dead
        (((0, 0),), 9, 8),  # a group larger than any engine
        ((), 1, 8),  # no engines
    ],
)
def test_none_when_nothing_fits(specs, n, capacity):
    assert route(loads(*specs), n=n, capacity=capacity) is None


def test_does_not_mutate_loads():
    ls = loads((1, 10), (0, 0))
    before = [(x.requests, x.tokens, x.healthy) for x in ls]
    route(ls, n=2, capacity=8)
    assert [(x.requests, x.tokens, x.healthy) for x in ls] == before


def test_a_preferred_engine_is_waited_for_while_it_serves():
    loads = [EngineLoad(requests=4, tokens=400), EngineLoad(requests=0)]
    assert route(loads, 1, capacity=4, prefer=0) is None  # full: wait for it, its KV is there
    assert route(loads, 1, capacity=5, prefer=0) == 0
    loads[0].healthy = False
    assert route(loads, 1, capacity=5, prefer=0) == 1  # gone: anywhere


def test_the_engine_with_less_waiting_work_is_waited_for_rather_than_one_with_room():
    """On long tails, the least outstanding tokens among engines with room sent a group
    to whichever engine freed slots first. With `batch` (the running batch), the least loaded engine
    is waited for while the one with room still runs a full batch."""
    ls = loads((8, 100), (6, 5000))  # engine 0: full, little work left; engine 1: room, long samples
    assert route(ls, n=2, capacity=8) == 1  # before: room decides
    assert route(ls, n=2, capacity=8, batch=4) is None  # engine 1 runs a full batch anyway: wait for engine 0
    assert route(loads((7, 100), (6, 5000)), n=1, capacity=8, batch=4) == 0  # engine 0 has room: it takes it


def test_an_engine_below_a_full_batch_takes_the_group_rather_than_drain():
    ls = loads((8, 100), (2, 5000))  # engine 1 would run 2 + 2 <= batch 4: never let it drain
    assert route(ls, n=2, capacity=8, batch=4) == 1
    assert route(loads((8, 100), (3, 5000)), n=2, capacity=8, batch=4) is None  # 3 + 2 > 4: its batch stays full
    assert route(loads((8, 100, False), (6, 5000)), n=2, capacity=8, batch=4) == 1  # the idlest is dead: not waited for


def scan(ls: list[EngineLoad], n: int, capacity: int, batch: int | None) -> int | None:
    """The rule spelt out as a loop over the engines (what `route` did before its keys)."""
    healthy = [i for i, load in enumerate(ls) if load.healthy]
    if not healthy:
        return None
    order = lambda i: (ls[i].tokens, ls[i].requests, i)  # noqa: E731
    best = min(healthy, key=order)
    room = [i for i in healthy if ls[i].requests + n <= capacity]
    fit = min(room, key=order) if room else None
    if batch is None or fit is None or fit == best:
        return fit
    return fit if ls[fit].requests + n <= batch else None


def test_route_by_keys_is_the_rule_on_random_loads():
    rng = random.Random(29)
    for _ in range(5000):
        ls = [EngineLoad(rng.randrange(0, 10), rng.choice([0, 50, 100, rng.randrange(0, 10**6)]), rng.random() > 0.2)
              for _ in range(rng.randrange(0, 9))]  # fmt: skip
        n, capacity = rng.randrange(1, 4), rng.randrange(1, 11)
        batch = rng.choice([None, rng.randrange(1, capacity + 1)])
        assert route(ls, n, capacity, batch=batch) == scan(ls, n, capacity, batch), (ls, n, capacity, batch)


def test_the_runner_keeps_each_engines_key_with_its_load():
    cfg = load_config(
        None, ["engines.count=3", "engines.max_inflight_per_engine=3", "engines.queued_per_engine=1", "sampling.n=1"]
    )
    runner = Runner(cfg, [object()] * 3)
    rng = random.Random(7)

    async def steps() -> None:
        held: list[tuple[int, int]] = []
        for _ in range(300):
            if held and rng.random() < 0.5:
                i, cost = held.pop(rng.randrange(len(held)))
                runner.release(i, 1, cost)
            elif sum(load.requests for load in runner.loads if load.healthy) < 8:
                cost = rng.randrange(1, 500)
                held.append((await runner.acquire(1, cost), cost))
            if rng.random() < 0.05:
                runner.mark_dead(k := rng.randrange(3), "test")
                assert runner._keys == [key(load) for load in runner.loads]
                assert runner._counts == [count(load) for load in runner.loads]
                runner.revive(k, object())
            assert runner._keys == [key(load) for load in runner.loads]
            assert runner._counts == [count(load) for load in runner.loads]

    asyncio.run(steps())
