"""The engines as the scheduler sees them: room on each, running requests there, and what happens
when one dies.

Owns: each engine's load and health (`loads`), waiting for room (`acquire`: least outstanding
tokens via `router.route`, waiting for that engine's room unless another would run less than a
full batch; or the engine an episode is on), running a set of requests to their
end on one engine (`run`): if it dies (or the requests outlive `engines.request_timeout_s`), the
unfinished ones continue on another engine from its last progress report, up to
`engines.max_retries`; the health watch (`watch`: progress reports every
`engines.health_interval_s`, an engine silent past `engines.health_timeout_s` is killed);
taking engines out of rotation and back (`mark_dead`, `revive`, `give_up`).
Does not own: which requests (the scheduler), restarting engines (`RolloutEngine`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import anyio
import msgspec

from rollout.config import Config
from rollout.errors import EngineDeadError, RolloutError
from rollout.log import get_logger
from rollout.scheduling.protocols import Engine
from rollout.scheduling.router import EngineLoad, count, key, route
from rollout.types import Request, Trajectory

if TYPE_CHECKING:
    from rollout.handout.token_stream import TokenStream

log = get_logger(__name__)


class Runner:
    def __init__(
        self,
        cfg: Config,
        engines: Sequence[Engine],
        on_engine_dead: Callable[[int], bool] | None = None,
        on_all_dead: Callable[[EngineDeadError], None] | None = None,
    ):
        self.cfg = cfg
        self.engines = list(engines)
        self.on_engine_dead = on_engine_dead  # starts a restart; False when it will not
        self.on_all_dead = on_all_dead  # every engine gone for good: fail whoever waits
        self.on_load: Callable[[int, int], None] | None = None  # (engine, requests in flight) at every change
        self.reports: list[Mapping[str, Trajectory]] = [
            {} for _ in self.engines
        ]  # each engine's latest progress report
        self.loads = [EngineLoad() for _ in self.engines]
        self._keys = [key(load) for load in self.loads]  # `router.key` of each load, kept with it
        self._counts = [count(load) for load in self.loads]  # and its requests (OUT when out of rotation)
        self._capacity_freed = asyncio.Event()
        self.waiters = 0  # tasks waiting in `acquire` for room: only they need `_capacity_freed` set
        self.on_room: Callable[[int], None] | None = None  # room came free on an engine (-1: anywhere); `Lobby`
        self.changes = 0  # counts every change of the loads but a release (room taken, an engine out or back)

    # -- room on the engines -----------------------------------------------------------------

    async def acquire(self, n: int, cost: int, on: int | None = None) -> int:
        """Wait for room for `n` requests of `cost` tokens each and take it; returns the engine.
        `on`: that engine (an episode's), while it is in rotation. Raises EngineDeadError when
        every engine is dead."""
        while (i := self.take(n, cost, on)) is None:
            if not any(load.healthy or load.restarting for load in self.loads):
                raise EngineDeadError("every engine is dead")
            freed = self._capacity_freed
            self.waiters += 1
            try:
                await freed.wait()
            finally:
                self.waiters -= 1
        return i

    def take(self, n: int, cost: int, on: int | None = None) -> int | None:
        """Room for `n` requests of `cost` tokens each, taken on the engine `router.route` picks
        now (`on`: that one, while in rotation); None when it says wait."""
        batch = self.cfg.engines.max_inflight_per_engine
        i = route(
            self.loads,
            n,
            batch + self.cfg.engines.queue_depth,
            prefer=on,
            batch=batch,
            keys=self._keys,
            counts=self._counts,
        )
        if i is not None:
            self._add(i, n, n * cost)
            self.changes += 1
        return i

    def fits(self, i: int, n: int) -> bool:
        """Whether engine `i` is in rotation with room for `n` more requests."""
        load = self.loads[i]
        return (
            load.healthy
            and load.requests + n <= self.cfg.engines.max_inflight_per_engine + self.cfg.engines.queue_depth
        )

    def release(self, i: int, n: int, cost: int) -> None:
        self._add(i, -n, -n * cost)
        self._wake(i)

    def _add(self, i: int, requests: int, tokens: int) -> None:
        load = self.loads[i]
        load.requests += requests
        load.tokens += tokens
        self._keep(i)
        if self.on_load is not None:
            self.on_load(i, load.requests)

    def _keep(self, i: int) -> None:
        """Engine `i`'s load changed: its routing key and count follow."""
        load = self.loads[i]
        self._keys[i] = key(load)
        self._counts[i] = count(load)

    def _wake(self, i: int = -1) -> None:
        if self.waiters:  # no new event per finished sample while nobody waits: driver CPU for nothing
            self._capacity_freed.set()
            self._capacity_freed = asyncio.Event()
        if i < 0:
            self.changes += 1
        if self.on_room is not None:
            self.on_room(i)

    # -- running requests --------------------------------------------------------------------

    async def run(
        self, i: int, requests: list[Request], cost: int, finish: Callable[[Trajectory], None],
        stream: TokenStream | None = None,
    ) -> int:  # fmt: skip
        """Run `requests` (room for them already taken on engine `i`) until each has a trajectory,
        handed to `finish` as it ends; moves the unfinished ones when `i` dies. Returns the engine
        the last of them ran on. Every request gets a trajectory: a failed one says why.
        `stream`: the requests are streamed (`Request.stream`); their new tokens go there."""
        pending = {r.sample_index: r for r in requests}
        failure, moved = await self._attempt(i, pending, cost, finish, self.cfg.engines.request_timeout_s, stream)
        return await self.carry_on(i, pending, cost, finish, failure, moved, stream)

    async def carry_on(
        self, i: int, pending: dict[int, Request], cost: int, finish: Callable[[Trajectory], None], failure: str | None,
        moved: bool, stream: TokenStream | None = None,
    ) -> int:  # fmt: skip
        """After an attempt on engine `i` ended (`failure`: why, if it failed) with `pending` still
        unfinished (their room there given back): while they may move (`moved`: the engine died or
        timed out), continue them on another engine from `i`'s last progress report (or from
        what was streamed of them, if more), up to `engines.max_retries` times; whatever is left
        gets a failed trajectory saying why. Returns the engine the last of them ran on."""
        retries, timeout = 0, self.cfg.engines.request_timeout_s
        while pending and moved and retries < self.cfg.engines.max_retries:
            retries += 1
            for k, req in list(pending.items()):  # continue from the failed engine's last progress report
                partial = self.reports[i].get(req.request_id)
                if stream is not None:
                    partial = stream.resume_point(req, partial)
                if partial is not None and partial.finished_at:
                    finish(partial)
                    del pending[k]
                elif partial is not None and partial.token_ids:
                    pending[k] = msgspec.structs.replace(req, resume=partial)
            if not pending:
                break
            try:
                i = await self.acquire(len(pending), cost)
            except EngineDeadError as e:
                failure = str(e)
                break
            log.warning("samples moved to another engine", prompt=next(iter(pending.values())).prompt_id,
                        samples=len(pending), engine=i, reason=failure,
                        resumed_tokens=sum(len(r.resume.token_ids) for r in pending.values() if r.resume))  # fmt: skip
            failure, moved = await self._attempt(i, pending, cost, finish, timeout, stream)
        for req in pending.values():
            reason = failure or "engine returned no result"
            finish(failed(req, i, f"{reason} (moved {retries} times)" if retries else reason))
        return i

    async def _attempt(
        self,
        i: int,
        pending: dict[int, Request],
        cost: int,
        finish: Callable[[Trajectory], None],
        timeout: float | None,
        stream: TokenStream | None = None,
    ) -> tuple[str | None, bool]:
        """Run `pending` on engine `i` (room already taken), handing finished ones to `finish`.

        Returns (failure, whether the rest may move to another engine)."""
        failure, moved = None, False
        engine, requests = self.engines[i], list(pending.values())
        try:  # a cancel scope per group only where there is a timeout: one per group costs the driver's loop
            with anyio.fail_after(timeout) if timeout is not None else contextlib.nullcontext():
                group = engine.generate_group(requests, stream.put) if stream else engine.generate_group(requests)
                async for traj in group:
                    del pending[traj.sample_index]
                    self.release(i, 1, cost)  # per sample: the engine has room as soon as one ends
                    finish(traj)
        except TimeoutError:
            failure, moved = f"no result within engines.request_timeout_s={timeout} on engine {i}", True
        except RolloutError as e:
            failure, moved = self.failed_on(i, e)
        finally:
            if pending:
                self.release(i, len(pending), cost)
        return failure, moved

    def failed_on(self, i: int, error: RolloutError) -> tuple[str, bool]:
        """A group's attempt on engine `i` failed with `error`: (why, whether its unfinished samples
        may move on). A dead engine leaves rotation first."""
        if isinstance(error, EngineDeadError):
            self.mark_dead(i, str(error))
            return str(error), True
        return str(error), False

    # -- health ------------------------------------------------------------------------------

    async def watch(self) -> None:
        """Every `engines.health_interval_s`: each healthy engine reports its requests' progress.

        The reports are what a crash keeps. An engine that fails to answer within
        `engines.health_timeout_s`, or whose engine core has answered nothing for that long (the
        report says so), is killed, so its running groups move on instead of hanging.
        """
        async with anyio.create_task_group() as tg:
            for i in range(len(self.engines)):  # each on its own beat: a slow engine holds back no other's report
                tg.start_soon(self._watch_one, i)

    async def _watch_one(self, i: int) -> None:
        while True:
            await asyncio.sleep(self.cfg.engines.health_interval_s)
            if self.loads[i].healthy:
                await self._check(i)

    async def _check(self, i: int) -> None:
        engine, timeout = self.engines[i], self.cfg.engines.health_timeout_s
        try:  # asyncio's timeout, not anyio's: a report per engine every 2 s is 128 a second at 256 engines
            async with asyncio.timeout(timeout):
                reports = await engine.progress()
        except TimeoutError:
            reason = f"engine {i}: no health report within engines.health_timeout_s={timeout}"
        except RolloutError as e:
            reason = str(e)
        except Exception as e:  # anything else from the engine's edge: its problem, not the health watch's
            reason = f"engine {i}: health report failed: {type(e).__name__}: {e}"
        else:
            if engine is self.engines[i] and self.loads[i].healthy:  # not one that left rotation meanwhile
                self.reports[i] = reports
            return
        if engine is self.engines[i]:
            self.mark_dead(i, reason)
            await engine.kill()  # its calls fail now, and its groups move on

    def mark_dead(self, i: int, reason: str) -> None:
        """Take engine `i` out of rotation (its running groups move on) and have it restarted."""
        if self.loads[i].healthy:
            self.loads[i].healthy = False
            self._keep(i)
            log.error("engine out of rotation", engine=i, reason=reason)
            self.loads[i].restarting = self.on_engine_dead is not None and self.on_engine_dead(i)
        self._check_alive()

    def revive(self, i: int, engine: Engine) -> None:
        """A restarted engine `i`, at the current epoch: back into rotation."""
        self.engines[i] = engine
        self.reports[i] = {}  # the old engine's: the samples it held have moved on
        self.loads[i].healthy, self.loads[i].restarting = True, False
        self._keep(i)
        log.info("engine back in rotation", engine=i)
        self._wake()

    def give_up(self, i: int, reason: str) -> None:
        """Engine `i` will not come back."""
        self.loads[i].restarting = False
        log.error("engine gone for good", engine=i, reason=reason)
        self._check_alive()

    def _check_alive(self) -> None:
        if not any(load.healthy or load.restarting for load in self.loads) and self.on_all_dead is not None:
            self.on_all_dead(EngineDeadError("every engine is dead (and none is restarting)"))
        self._wake()  # waiters re-check: there may be no engine left at all


def failed(req: Request, engine_id: int, reason: str) -> Trajectory:
    return Trajectory(
        request_id=req.request_id,
        prompt_id=req.prompt_id,
        sample_index=req.sample_index,
        prompt_token_ids=list(req.token_ids or []),
        finish_reason="error",
        error=reason,
        engine_id=engine_id,
        finished_at=time.time(),
    )
