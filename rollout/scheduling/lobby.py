"""Groups waiting for room on an engine (`Lobby`): the largest token budget (`max_tokens`) goes
first, equal budgets in arrival order, so the long samples of a long-tailed set start first (LPT).

Two kinds wait here. A group run as a task (`Lobby.acquire`: episodes, a caller's submission, ...)
waits on its own event, and the first in line sits in `Runner.acquire`, which routes it. A callback
group (`rollout.scheduling.callback_group`: the learner's plain groups, no task of their own) is started
from `_next` as soon as it is first in line and an engine has room: when it arrives, and on the
loop's turn after the runner says room came free (`Runner.on_room`: one look for all the room
freed in a turn). A group with a larger budget arriving while a task waits in `Runner.acquire`
takes its place; that one waits again. Once the scheduler exits (`close`), nothing starts.
"""

from __future__ import annotations

import asyncio
import heapq
from typing import Any, Protocol

import anyio

from rollout.scheduling.runner import Runner


class Startable(Protocol):
    n: int  # requests
    cost: int  # tokens each

    def start(self, engine: int) -> None:
        """Room for it is taken on `engine`: send it there."""
        ...

    def crash(self, error: BaseException) -> None:
        """It cannot start (a bug): it fails, saying why."""
        ...


class Lobby:
    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        runner.on_room = self._freed
        self._waiting: list[list[Any]] = []  # heap of [-budget, arrival, event or callback group]
        self._arrivals = 0
        self._head: tuple[list[Any], anyio.CancelScope] | None = None  # the task in `Runner.acquire`
        self._shrunk = asyncio.Event()  # set when a group leaves the waiting ones
        self._again = False  # a look at the line is on the loop already (`_next` deferred a turn)
        self._room = -2  # -2: no look at the line on the loop for freed room; else the engine freed (-1: several)
        self._stuck = (0, -1)  # (arrival of the first in line, `Runner.changes`) when it last found no room
        self.closed = False  # the scheduler exited: nothing starts any more

    async def acquire(self, n: int, cost: int, budget: int) -> int:
        """`Runner.acquire(n, cost)` once no group with a larger budget (or as large, earlier) waits."""
        entry = self._enter(budget, asyncio.Event())
        try:
            while True:
                while self._head is not None or self._waiting[0] is not entry:
                    entry[2] = asyncio.Event()
                    await entry[2].wait()
                heapq.heappop(self._waiting)
                self._shrunk.set()
                with anyio.CancelScope() as scope:
                    self._head = (entry, scope)
                    try:
                        return await self.runner.acquire(n, cost)
                    finally:
                        self._head = None
                        self._next()
                heapq.heappush(self._waiting, entry)
        except BaseException:  # cancelled while waiting: the next one may be the head now
            if any(e is entry for e in self._waiting):
                self._waiting.remove(entry)
                heapq.heapify(self._waiting)
                self._shrunk.set()
                self._next()
            raise

    def add(self, group: Startable, budget: int) -> None:
        """A callback group: started (`group.start(engine)`) once first in line with room taken for it."""
        entry = self._enter(budget, group)
        if (head := self._waiting[0]) is not entry and self._stuck[0] == head[1]:
            return  # behind a head that found no room: the room that comes free looks again (`_freed`)
        self._next()

    def _enter(self, budget: int, what: Any) -> list[Any]:
        self._arrivals += 1
        entry = [-budget, self._arrivals, what]
        heapq.heappush(self._waiting, entry)
        if self._head is not None and entry < self._head[0]:
            self._head[1].cancel()  # overtaken: it waits again, this one goes first
        return entry

    async def room(self, limit: int) -> None:
        """Wait until fewer than `limit` groups wait here (a caller's submission, which takes no
        learner queue slots, is read no further ahead than that)."""
        while len(self._waiting) >= limit:
            if self._shrunk.is_set():
                self._shrunk = asyncio.Event()
            await self._shrunk.wait()

    def __len__(self) -> int:
        """Groups waiting (the head in `Runner.acquire` not counted)."""
        return len(self._waiting)

    def close(self) -> None:
        """The scheduler exited: room that comes back now (its cancelled tasks') starts nothing."""
        self.closed = True

    def _freed(self, i: int) -> None:
        """Room came free on engine `i` (-1: anywhere; `Runner.on_room`): one look at the line on the
        loop's next turn covers every sample freed in this one (a results frame, a burst of frames),
        instead of a look per finished sample."""
        if self._room == -2:
            self._room = i
            asyncio.get_running_loop().call_soon(self._look_freed)
        elif self._room != i:
            self._room = -1

    def _look_freed(self) -> None:
        freed, self._room = self._room, -2
        self._next(freed)

    def _next(self, freed: int = -1, defer: bool = True) -> None:
        """Start the callback groups first in line while engines have room; wake the first task in
        line. `freed`: the engine whose room grew, if that is the only change (-1: look anyway).
        Tasks waiting in `Runner.acquire` (a session's turn for its engine, samples moving on) get
        the room first: with any, this looks again on the loop's next turn, after them."""
        if self._head is not None or not self._waiting or self.closed:
            return
        if defer and self.runner.waiters:
            if not self._again:
                self._again = True
                asyncio.get_running_loop().call_soon(self._look_again)
            return
        runner = self.runner
        while self._head is None and self._waiting:
            entry = self._waiting[0]
            what = entry[2]
            if isinstance(what, asyncio.Event):
                what.set()
                return
            if self._stuck == (entry[1], runner.changes) and freed >= 0 and not runner.fits(freed, what.n):
                # nothing but a release on `freed`, still too full for it, since it found no room:
                # the router's answer is the same (`router.route`: only `freed`'s load moved)
                return
            try:
                i = runner.take(what.n, what.cost)
            except Exception as e:  # a bug routing it: that group fails, not the one whose sample freed the room
                i = e
            if i is None:
                self._stuck = (entry[1], runner.changes)
                return  # no room: `Runner.on_room` calls again when some comes free
            heapq.heappop(self._waiting)
            self._shrunk.set()
            if isinstance(i, Exception):
                what.crash(i)
            else:
                what.start(i)
            freed = -1

    def _look_again(self) -> None:
        self._again = False
        self._next(defer=False)
