"""The lobby (`rollout.scheduling.lobby`) over a real `Runner`: callback groups start largest budget
first as room comes free, and the room a turn of the loop frees is looked at once, not once per
finished sample (at 256 engines a look per sample was most of the router's calls); and
on the engine over fakes, nothing starts once the scheduler has exited."""

from __future__ import annotations

import asyncio

import anyio

from rollout.config import load_config
from rollout.engine import RolloutEngine
from rollout.scheduling.lobby import Lobby
from rollout.scheduling.runner import Runner
from rollout.types import Prompt
from tests.support.fake_engine_runs import TIMEOUT, settled
from tests.support.fakes import FakePool, HeldEngine


class Group:
    """A callback group as the lobby sees it (`lobby.Startable`)."""

    def __init__(self, name: str, started: list[tuple[str, int]], n: int = 2, cost: int = 10):
        self.name, self.started, self.n, self.cost = name, started, n, cost

    def start(self, engine: int) -> None:
        self.started.append((self.name, engine))

    def crash(self, error: BaseException) -> None:
        raise AssertionError(f"{self.name} crashed: {error}")


def full_lobby(engines: int = 2) -> tuple[Runner, Lobby, list[tuple[str, int]], list[int]]:
    """A lobby whose `engines` engines are full (4 requests each), and 3 groups of 2 waiting.
    Returns the runner, the lobby, the groups started (name, engine) and the routes tried."""
    cfg = load_config(
        None,
        [
            f"engines.count={engines}",
            "sampling.n=2",
            "engines.max_inflight_per_engine=2",
            "engines.queued_per_engine=2",
        ],
    )
    runner = Runner(cfg, [object()] * engines)
    lobby, started, routes = Lobby(runner), [], []
    take = runner.take

    def counted(n: int, cost: int, on: int | None = None) -> int | None:
        routes.append(n)
        return take(n, cost, on)

    runner.take = counted
    for i in range(engines):
        assert runner.take(4, 10) is not None
    for name, budget in (("short", 8), ("long", 64), ("mid", 16)):
        lobby.add(Group(name, started), budget)
    routes.clear()
    return runner, lobby, started, routes


async def test_the_room_freed_in_one_turn_is_looked_at_once():
    runner, lobby, started, routes = full_lobby()
    for _ in range(4):  # a results frame: engine 0's four samples, handed back one by one
        runner.release(0, 1, 10)
    assert started == [] and routes == []  # nothing routed per sample
    await asyncio.sleep(0)  # the loop's next turn
    assert started == [("long", 0), ("mid", 0)]  # largest budget first, as much as the room holds
    assert len(routes) == 3  # one look: two groups started, the third found no room


async def test_room_freed_on_several_engines_in_one_turn_starts_groups_on_each():
    runner, lobby, started, routes = full_lobby()
    runner.release(0, 2, 10)
    runner.release(1, 2, 10)
    await asyncio.sleep(0)
    assert sorted(started) == [("long", 0), ("mid", 1)] or sorted(started) == [("long", 1), ("mid", 0)]
    assert len(lobby) == 1


async def test_room_freed_in_a_later_turn_is_looked_at_again():
    runner, lobby, started, routes = full_lobby()
    runner.release(0, 1, 10)
    await asyncio.sleep(0)
    assert started == []  # one request's room: the head (2 requests) does not fit yet
    runner.release(0, 1, 10)
    await asyncio.sleep(0)
    assert started == [("long", 0)]


async def test_a_group_arriving_behind_a_head_without_room_routes_nothing_until_room_comes_free():
    runner, lobby, started, routes = full_lobby()  # its head ("long", 2 requests) found no room
    lobby.add(Group("late", started), 4)  # a smaller budget: behind the head
    runner.release(0, 1, 10)
    await asyncio.sleep(0)
    assert started == [] and routes == []  # room for 1 on engine 0: the head still does not fit
    lobby.add(Group("longest", started), 128)  # a new head: it looks
    assert len(routes) == 1 and started == []
    runner.release(0, 1, 10)
    await asyncio.sleep(0)
    assert started == [("longest", 0)] and len(routes) == 3  # then "long" found no room


async def test_nothing_starts_once_the_scheduler_has_exited(make_cfg):
    # A caller's submission (a task) holds the only room; the learner's groups wait in the lobby.
    # Exiting cancels the submission, whose room comes back: no waiting group may start then.
    held = HeldEngine(0, {"*"}, anyio.Event())
    cfg = make_cfg("engines.count=1", "engines.max_inflight_per_engine=2", "engines.queued_per_engine=1")
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=FakePool([held])) as engine:
            engine.submit([Prompt(token_ids=[7, 7], id="s0")])
            await settled()
            assert len(held.arrived) == 2  # both its samples wait on the engine
            engine.feed([Prompt(token_ids=[8, 8], id=f"q{i}") for i in range(3)])
            await settled()
            assert len(held.arrived) == 2  # the learner's groups wait for its room
        await settled()
    assert len(held.arrived) == 2
