"""The driver's handle on one engine actor: `RayEngine`, the `rollout.scheduling.protocols.Engine` the scheduler
runs groups on. Groups and their samples cross the zmq data path (`actors.channel`), and so do,
once the engine is connected, progress reports and the per-update calls (`rollout.wire.CALLS`,
unless an argument is an ObjectRef); everything else (the `serve` call that lasts as long as the
engine, stats, kill) is a Ray call, its errors translated into `rollout.errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import ray
import zmq
from ray.exceptions import RayActorError, RayTaskError

from actors.channel import Channel
from rollout import errors
from rollout.errors import EngineDeadError, InvalidPromptError, RetryableError, RolloutError
from rollout.log import get_logger
from rollout.packed import encode
from rollout.types import Delta, EngineStats, GroupResult, ProgressReport, Request, SpecCounters, Trajectory
from rollout.wire import ANSWER, CALL, CALLS, CANCEL, DELTAS, FAILED, HELLO, PROGRESS, RESULTS, SUBMIT

log = get_logger(__name__)


class RayEngine:
    """One engine actor, seen through the `rollout.scheduling.protocols.Engine` interface.

    Groups cross the driver's zmq data path (`actors.channel`), not one Ray call each: the groups
    started in one turn of the event loop go out in one submit frame, and each results frame brings
    back every sample the engine finished in one turn of its loop. One Ray call lasts as long as
    the engine (`serve`, started with the first group): when it fails, the engine died, and every
    group out on it fails with EngineDeadError (its samples move on from their progress reports).
    """

    def __init__(self, actor: Any, engine_id: int, channel: Channel):
        self.actor = actor
        self.engine_id = engine_id
        self._channel = channel
        self._identity = channel.register(engine_id, self._on_frame)
        self._waiting: dict[str, _Group] = {}  # key -> its group, until its last sample or its error
        self._outbox: list[tuple[str, list[Request]]] = []  # started this turn, or before the engine said hello
        self._keys = itertools.count()
        self._serving: asyncio.Task | None = None  # the `serve` call, while it lasts
        self._connected = False  # the engine said hello on this `serve` call
        self._reports: deque[asyncio.Future] = deque()  # progress reports asked for on the data path, in order
        self._calls: dict[int, asyncio.Future] = {}  # id -> a call of `CALLS` asked for on the data path
        self._call_ids = itertools.count()

    async def generate_group(
        self, requests: list[Request], on_delta: Callable[[Delta], None] | None = None
    ) -> AsyncIterator[Trajectory]:
        # Each sample comes back as it finishes, so the scheduler gives its slot on this engine to
        # the next request at once (a group's slots held until its last sample ended let the
        # engine's batch drain in waves). Leaving early (cancelled, closed) aborts the rest.
        # `on_delta`: a streamed sample's new tokens (`Request.stream`), after every engine step.
        inbox: asyncio.Queue[list[Trajectory] | BaseException] = asyncio.Queue()
        key = self._start(requests, inbox.put_nowait, on_delta)
        left = len(requests)
        try:
            while left:
                item = await inbox.get()
                if isinstance(item, BaseException):
                    raise item
                for traj in item:
                    left -= 1
                    yield traj
        finally:
            if key in self._waiting:  # given up before its last sample: abort the rest
                self._cancel(key)

    def start_group(
        self, requests: list[Request], deliver: Callable[[list[Trajectory] | RolloutError], None]
    ) -> Callable[[], None]:
        """`generate_group` without a task: `deliver` gets each results frame's samples of the group
        as they come (from the data path's reader callback), or the RolloutError that ends it.
        Returns the call that aborts what has not finished."""
        return functools.partial(self._cancel, self._start(requests, deliver))

    def _start(
        self, requests: list[Request], deliver: Callable[[Any], None], on_delta: Callable[[Delta], None] | None = None
    ) -> str:
        key = str(next(self._keys))
        self._waiting[key] = _Group(len(requests), deliver, on_delta)
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._submit)
        self._outbox.append((key, requests))
        if self._serving is None:
            self._serving = asyncio.ensure_future(self._serve())
        return key

    async def _serve(self) -> None:
        """The engine's `serve` call: while it lasts, the engine is alive. When it ends, every group
        out on the engine fails (a dead engine: EngineDeadError; their samples move on)."""
        try:
            await self._call(self.actor.serve.remote(self._channel.open(), self._identity))
            error: Exception = EngineDeadError(f"engine {self.engine_id} stopped serving")
        except Exception as e:
            error = e
        finally:
            self._serving, self._connected = None, False
        if self._waiting:
            log.error(
                "engine results lost",
                engine=self.engine_id,
                groups=len(self._waiting),
                error=f"{type(error).__name__}: {error}",
            )
        self._lost(error)

    def _lost(self, error: Exception) -> None:
        """The `serve` call ended: whatever was asked for on it (groups, reports, calls) fails with `error`."""
        self._fail(error, list(self._waiting))
        asked = [*self._reports, *self._calls.values()]
        self._reports.clear()
        self._calls.clear()
        for future in asked:
            if not future.done():
                future.set_exception(
                    _copy(error)
                    if isinstance(error, RolloutError)
                    else EngineDeadError(f"engine {self.engine_id}: {error}")
                )

    def _on_frame(self, kind: bytes, payload: bytes) -> None:
        if kind == RESULTS:
            try:
                results = msgspec.msgpack.decode(payload, type=list[GroupResult])
            except Exception as e:  # the engine's to answer for: every group out on it fails, loudly
                log.error(
                    "engine results lost",
                    engine=self.engine_id,
                    groups=len(self._waiting),
                    error=f"{type(e).__name__}: {e}",
                )
                self._fail(e, list(self._waiting))
                return
            for r in results:
                group = self._waiting.get(r.key)
                if group is None:  # cancelled meanwhile
                    continue
                if r.error is None:
                    group.left -= len(r.trajectories)
                    if group.left <= 0:
                        del self._waiting[r.key]
                    group.deliver(r.trajectories)
                else:
                    del self._waiting[r.key]
                    group.deliver(EngineDeadError(r.error) if r.dead else RetryableError(r.error))
        elif kind == DELTAS:
            try:
                deltas = msgspec.msgpack.decode(payload, type=list[Delta])
            except Exception as e:  # a stream loses its early tokens, not its samples: they come whole at the end
                log.error("engine deltas lost", engine=self.engine_id, error=f"{type(e).__name__}: {e}")
                return
            for d in deltas:
                if (group := self._waiting.get(d.key)) is not None and group.on_delta is not None:
                    group.on_delta(d)
        elif kind in (PROGRESS, FAILED):
            if self._reports and not (report := self._reports.popleft()).done():  # answers come in the order asked
                if kind == PROGRESS:
                    report.set_result(payload)
                else:
                    report.set_exception(EngineDeadError(payload.decode(errors="replace")))
        elif kind == ANSWER:
            call_id, error, value = msgspec.msgpack.decode(payload, type=tuple[int, list[str] | None, Any])
            if (future := self._calls.pop(call_id, None)) is not None and not future.done():
                if error is None:
                    future.set_result(value)
                else:
                    future.set_exception(self._rebuilt(*error))
        elif kind == HELLO and self._serving is not None:
            self._connected = True
            self._submit()

    def _submit(self) -> None:
        """Send the groups started this turn in one frame, once the engine said hello. Runs as a loop
        callback, where an exception would reach no one: whatever fails here fails the groups it
        concerns, with the reason."""
        if not self._connected:
            return
        batch, self._outbox = self._outbox, []
        if not batch:
            return
        keys = [key for key, _ in batch]
        try:
            try:
                payload = encode(batch)
            except Exception:  # some group cannot travel: fail those, send the rest
                batch = [(key, requests) for key, requests in batch if self._encodable(key, requests)]
                keys = [key for key, _ in batch]
                if not batch:
                    return
                payload = encode(batch)
            self._channel.send(self._identity, SUBMIT, payload)
        except Exception as e:  # the engine is not connected any more, or the socket refused
            self._fail(e, keys)

    def _encodable(self, key: str, requests: list[Request]) -> bool:
        """Whether the group `key` encodes for the wire; if not it fails now, naming the request and why."""
        for req in requests:
            try:
                encode(req)
            except Exception as e:
                self._fail(
                    InvalidPromptError(
                        f"request {req.request_id} (prompt {req.prompt_id!r}) cannot be sent to engine "
                        f"{self.engine_id}: {type(e).__name__}: {e}"
                    ),
                    [key],
                )
                return False
        return True

    def _cancel(self, key: str) -> None:
        if self._waiting.pop(key, None) is None:
            return  # ended already (its last sample, its error), or aborted before
        if any(k == key for k, _ in self._outbox):
            self._outbox = [(k, r) for k, r in self._outbox if k != key]
        elif self._connected:
            try:
                self._channel.send(self._identity, CANCEL, msgspec.msgpack.encode([key]))
            except Exception:  # not connected any more: the engine is gone, and its groups with it
                pass

    def _fail(self, error: Exception, keys: list[str]) -> None:
        """Fail the groups `keys` with `error` (a RolloutError, else a RetryableError naming it)."""
        if not isinstance(error, RolloutError):
            error = RetryableError(f"engine {self.engine_id}: {type(error).__name__}: {error}")
        for key in keys:
            if (group := self._waiting.pop(key, None)) is not None:
                group.deliver(_copy(error))

    def close(self) -> None:
        """Stop this handle's `serve` call (the engine is being replaced or shut down)."""
        if self._serving is not None:
            self._serving.cancel()
        self._channel.unregister(self._identity)
        self._connected = False
        self._lost(EngineDeadError(f"engine {self.engine_id} was shut down"))

    async def stats(self) -> EngineStats:
        return await self._call(self.actor.stats.remote())

    async def progress(self) -> ProgressReport:
        """The engine's progress report: on the data path once the engine is connected (a Ray call
        costs the driver ~300-450 us), through Ray before."""
        if self._connected:
            try:
                self._channel.send(self._identity, PROGRESS, b"")
            except Exception:  # the data path broke (its `serve` call ends with it): ask through Ray
                pass
            else:
                report = asyncio.get_running_loop().create_future()
                self._reports.append(report)
                return ProgressReport(await report)
        return ProgressReport(await self._call(self.actor.progress.remote()))

    async def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)  # the `serve` call fails: every group out fails with EngineDeadError

    async def reset_prefix_cache(self) -> None:
        await self._call(self.actor.reset_prefix_cache.remote())

    async def batch(self) -> tuple[float, float, float]:
        return await self._call(self.actor.batch.remote())

    async def stage_weights(self, epoch: int, weights: Any) -> int:
        return await self.call("stage_weights", epoch, weights)

    async def drop_weights(self, epoch: int) -> None:
        await self.call("drop_weights", epoch)

    async def commit_weights(self, epoch: int) -> dict[str, float]:
        return await self.call("commit_weights", epoch)

    async def call(self, method: str, *args: Any) -> Any:
        """The policy's `method` (a weight update's phases, vLLM's weight-transfer calls): one of
        `CALLS` on the data path once the engine is connected, a frame each way; through Ray before,
        or when an argument is what msgpack does not carry (an ObjectRef to the weights)."""
        frame = self._frame(method, args) if self._connected and method in CALLS else None
        if frame is None:
            return await self._call(getattr(self.actor, method).remote(*args))
        call_id, payload = frame
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        try:
            self._channel.send(self._identity, CALL, payload)
            return await future
        except asyncio.CancelledError:
            if future.cancelled() and self._connected:  # given up: the engine cancels it, as `ray.cancel` would
                with contextlib.suppress(Exception):
                    self._channel.send(self._identity, CALL, msgspec.msgpack.encode((call_id, None, [])))
            raise
        except zmq.ZMQError as e:  # not connected any more: the engine is gone (its `serve` call ends with it)
            raise EngineDeadError(f"engine {self.engine_id}: {method}: the data path is closed: {e}") from e
        finally:
            self._calls.pop(call_id, None)

    def _frame(self, method: str, args: tuple) -> tuple[int, bytes] | None:
        """The call's frame, if its arguments arrive as sent (not an ObjectRef; not a dataclass
        that would arrive as a dict, nor a tuple as a list): else Ray carries it."""
        call_id = next(self._call_ids)
        try:
            payload = msgspec.msgpack.encode((call_id, method, args))
        except (TypeError, OverflowError):
            return None
        return (call_id, payload) if msgspec.msgpack.decode(payload)[2] == list(args) else None

    def _rebuilt(self, kind: str, message: str) -> RolloutError:
        """An error a call on the data path raised in the engine, as `_translate` makes it of Ray's."""
        cls = getattr(errors, kind, None)
        if isinstance(cls, type) and issubclass(cls, RolloutError):
            with contextlib.suppress(Exception):
                return cls(message)
        return RetryableError(f"engine {self.engine_id}: {message}")

    async def run_raw(self, requests: list[Request], outputs: bool = False) -> dict:
        return await self._call(self.actor.run_raw.remote(requests, outputs))

    async def spec_counters(self) -> SpecCounters:
        return await self._call(self.actor.spec_counters.remote())

    async def _call(self, ref: Any) -> Any:
        try:
            return await ref
        except asyncio.CancelledError:
            if isinstance(ref, ray.ObjectRef):  # anything else (a local stand-in in tests) has nothing to cancel in Ray
                ray.cancel(ref)
            raise
        except (RayTaskError, RayActorError) as e:
            raise self._translate(e) from e

    def _translate(self, e: Exception) -> RolloutError:
        if isinstance(e, RayActorError):
            return EngineDeadError(f"engine {self.engine_id} is dead: {e}")
        cause = getattr(e, "cause", None)
        if isinstance(cause, RolloutError):
            return cause
        return RetryableError(f"engine {self.engine_id}: {cause or e}")


class _Group:
    """A group out on an engine: how many samples are still to come, and where what comes back
    goes (lists of trajectories, or the error that ends the group; a streamed sample's deltas)."""

    __slots__ = ("left", "deliver", "on_delta")

    def __init__(self, samples: int, deliver: Callable[[Any], None], on_delta: Callable[[Delta], None] | None):
        self.left = samples
        self.deliver = deliver
        self.on_delta = on_delta


def _copy(error: RolloutError) -> RolloutError:
    """A fresh exception per waiting group (one object raised in many tasks would pile up their
    tracebacks); the same one where its type cannot be rebuilt from a message."""
    try:
        return type(error)(str(error))
    except Exception:
        return error
