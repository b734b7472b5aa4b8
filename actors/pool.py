"""Engine actors on Ray: start N vLLM engines in a placement group, call them, shut them down.

Owns: one actor per engine with its resources and pinned cores (the cluster itself:
`actors.cluster`), readiness with a timeout, translation of Ray errors into
`rollout.errors`, and a shutdown that leaves no process or /dev/shm segment behind (a driver
SIGKILLed cannot shut down: what it left is recorded, and the next start removes it, `actors.leftovers`).
The actor itself is `ray.remote(VLLMPolicy)`: a shell with no logic of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.channel import Channel
from actors.cluster import connect, missing_resources
from actors.leftovers import Record, reap
from policies.group_calls import CANCEL, HELLO, RESULTS, SUBMIT
from policies.shm import Snapshot, descendants, sweep_when_gone
from policies.vllm_args import checked_engine_args, engine_env
from policies.vllm_policy import VLLMPolicy
from rollout.config import Config
from rollout.errors import EngineDeadError, InvalidConfigError, InvalidPromptError, RetryableError, RolloutError
from rollout.log import get_logger
from rollout.specdecode import SpecCounters
from rollout.types import EngineStats, GroupResult, ProgressReport, Request, Trajectory

log = get_logger(__name__)


class RayEngine:
    """One engine actor, seen through the `rollout.backend.Engine` interface.

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

    async def generate_group(self, requests: list[Request]) -> AsyncIterator[Trajectory]:
        # Each sample comes back as it finishes, so the scheduler gives its slot on this engine to
        # the next request at once (a group's slots held until its last sample ended let the
        # engine's batch drain in waves). Leaving early (cancelled, closed) aborts the rest.
        key = str(next(self._keys))
        group = self._waiting[key] = _Group(len(requests))
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._submit)
        self._outbox.append((key, requests))
        if self._serving is None:
            self._serving = asyncio.ensure_future(self._serve())
        left = len(requests)
        try:
            while left:
                item = await group.inbox.get()
                if isinstance(item, BaseException):
                    raise item
                for traj in item:
                    left -= 1
                    yield traj
        finally:
            if self._waiting.get(key) is group:  # given up before its last sample: abort the rest
                self._cancel(key)

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
            log.error("engine results lost", engine=self.engine_id, groups=len(self._waiting), error=f"{type(error).__name__}: {error}")
            self._fail(error, list(self._waiting))

    def _on_frame(self, kind: bytes, payload: bytes) -> None:
        if kind == RESULTS:
            try:
                results = msgspec.msgpack.decode(payload, type=list[GroupResult])
            except Exception as e:  # the engine's to answer for: every group out on it fails, loudly
                log.error("engine results lost", engine=self.engine_id, groups=len(self._waiting), error=f"{type(e).__name__}: {e}")
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
                    group.inbox.put_nowait(r.trajectories)
                else:
                    del self._waiting[r.key]
                    group.inbox.put_nowait(EngineDeadError(r.error) if r.dead else RetryableError(r.error))
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
                payload = msgspec.msgpack.encode(batch)
            except Exception:  # some group cannot travel: fail those, send the rest
                batch = [(key, requests) for key, requests in batch if self._encodable(key, requests)]
                keys = [key for key, _ in batch]
                if not batch:
                    return
                payload = msgspec.msgpack.encode(batch)
            self._channel.send(self._identity, SUBMIT, payload)
        except Exception as e:  # the engine is not connected any more, or the socket refused
            self._fail(e, keys)

    def _encodable(self, key: str, requests: list[Request]) -> bool:
        """Whether the group `key` encodes for the wire; if not it fails now, naming the request and why."""
        for req in requests:
            try:
                msgspec.msgpack.encode(req)
            except Exception as e:
                self._fail(InvalidPromptError(f"request {req.request_id} (prompt {req.prompt_id!r}) cannot be sent to engine {self.engine_id}: {type(e).__name__}: {e}"), [key])
                return False
        return True

    def _cancel(self, key: str) -> None:
        self._waiting.pop(key, None)
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
                group.inbox.put_nowait(_copy(error))

    def close(self) -> None:
        """Stop this handle's `serve` call (the engine is being replaced or shut down)."""
        if self._serving is not None:
            self._serving.cancel()
        self._channel.unregister(self._identity)
        self._fail(EngineDeadError(f"engine {self.engine_id} was shut down"), list(self._waiting))

    async def stats(self) -> EngineStats:
        return await self._call(self.actor.stats.remote())

    async def progress(self) -> ProgressReport:
        return ProgressReport(await self._call(self.actor.progress.remote()))

    async def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)  # the `serve` call fails: every group out fails with EngineDeadError

    async def reset_prefix_cache(self) -> None:
        await self._call(self.actor.reset_prefix_cache.remote())

    async def batch(self) -> tuple[float, float, float]:
        return await self._call(self.actor.batch.remote())

    async def stage_weights(self, epoch: int, weights: Any) -> int:
        return await self._call(self.actor.stage_weights.remote(epoch, weights))

    async def drop_weights(self, epoch: int) -> None:
        await self._call(self.actor.drop_weights.remote(epoch))

    async def commit_weights(self, epoch: int) -> dict[str, float]:
        return await self._call(self.actor.commit_weights.remote(epoch))

    async def call(self, method: str, *args: Any) -> Any:
        """The policy's `method` (vLLM's weight-transfer calls, `rollout.weight_sync`)."""
        return await self._call(getattr(self.actor, method).remote(*args))

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
    """A group out on an engine: how many samples are still to come, and what came back so far
    (lists of trajectories, or the error that ends the group)."""

    __slots__ = ("left", "inbox")

    def __init__(self, samples: int):
        self.left = samples
        self.inbox: asyncio.Queue[list[Trajectory] | RolloutError] = asyncio.Queue()


class RayEnginePool:
    """N engine actors in one placement group. Use `await RayEnginePool.start(cfg, path)`."""

    def __init__(self, cfg: Config, actors: list[Any], pg: Any, started_ray: bool, record: Record | None = None):
        self.cfg = cfg
        self.actors = actors
        self.channel = Channel(ray.util.get_node_ip_address())  # the engines' data path: groups, samples
        self.engines = [RayEngine(a, i, self.channel) for i, a in enumerate(actors)]
        self._pg = pg
        self._started_ray = started_ray
        self.model_path = ""
        self._shm: dict[int, tuple[list[str], list[int], str]] = {}  # engine -> (/dev/shm names, pids, host) at start
        self._starting: dict[int, Any] = {}  # engine -> its `start` call, until it answers
        self._record = record  # what a SIGKILL of this driver would leave, for the next start (`actors.leftovers`)
        self._ray_pids: set[int] = set()  # this driver's children that are its local cluster's

    @classmethod
    async def start(cls, cfg: Config, model_path: str) -> RayEnginePool:
        """Start every engine concurrently; raises EngineDeadError if one fails or times out."""
        checked_engine_args(cfg, model_path)  # bad engine args, and what vLLM's model config refuses, fail here
        await asyncio.to_thread(reap)  # what killed drivers on this machine left
        children = descendants(os.getpid())
        started_ray = connect(cfg)
        record = Record()
        if missing := missing_resources(cfg, ray.cluster_resources()):  # else the placement group waits for the whole start timeout
            if started_ray:
                ray.shutdown()
            raise InvalidConfigError(missing)
        e = cfg.engines
        bundle = {"CPU": e.cpus_per_engine, **({"GPU": e.gpus_per_engine} if e.gpus_per_engine else {})}
        pg = placement_group([bundle] * e.count, strategy=e.placement_strategy)
        actors: list[Any] = []
        pool = cls(cfg, actors, pg, started_ray, record)
        pool.model_path = model_path
        if started_ray and cfg.ray.address is None:  # a local cluster: its processes are this driver's children
            pool._ray_pids = descendants(os.getpid()) - children
            record.cluster(sorted(pool._ray_pids))
        try:
            await asyncio.wait_for(pg.ready(), timeout=e.start_timeout_s)
            actors.extend(pool._spawn(i) for i in range(e.count))
            pool.engines = [RayEngine(a, i, pool.channel) for i, a in enumerate(actors)]
            log.info("engines starting", count=e.count, model=model_path)
            pool._starting = {i: a.start.remote() for i, a in enumerate(actors)}
            held = await asyncio.wait_for(asyncio.gather(*pool._starting.values()), timeout=e.start_timeout_s)
            pool._starting.clear()
            pool._shm = dict(enumerate(held))
            for i in range(e.count):
                pool._remember(i)
        except BaseException as err:
            if isinstance(err, (asyncio.TimeoutError, GetTimeoutError, RayActorError, RayTaskError)):
                pool._starting.clear()  # hung or failed: nothing to wait for
            await pool.shutdown()
            if isinstance(err, (asyncio.TimeoutError, GetTimeoutError)):
                raise EngineDeadError(f"engines did not start within engines.start_timeout_s={e.start_timeout_s}") from err
            if isinstance(err, (RayActorError, RayTaskError)):
                cause = getattr(err, "cause", None)  # the engine's own EngineDeadError names the cause in one line
                raise EngineDeadError(str(cause) if isinstance(cause, RolloutError) else f"an engine failed to start: {err}") from err
            raise
        log.info("engines ready", count=e.count)
        return pool

    def _spawn(self, i: int) -> Any:
        """Engine actor `i` in bundle `i` of the placement group (not started yet)."""
        e = self.cfg.engines
        return ray.remote(VLLMPolicy).options(
            name=None,
            num_cpus=e.cpus_per_engine,
            num_gpus=e.gpus_per_engine,
            max_concurrency=e.max_inflight_per_engine + 16,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i),
            runtime_env={"env_vars": engine_env(i, e.cpus_per_engine, e.gpus_per_engine, self.cfg.logging.level)},
        ).remote(self.cfg, self.model_path, i)

    async def restart(self, i: int) -> RayEngine:
        """Replace engine `i` (killed first, freeing its bundle) with a fresh one at epoch 0."""
        ray.kill(self.actors[i], no_restart=True)
        self.engines[i].close()
        actor = self.actors[i] = self._spawn(i)
        self.engines[i] = RayEngine(actor, i, self.channel)
        start = self._starting[i] = actor.start.remote()  # kept if this is cancelled: shutdown waits for it
        try:
            held = await asyncio.wait_for(start, timeout=self.cfg.engines.start_timeout_s)
            del self._starting[i]
            # What the killed engine's processes left in /dev/shm (160 MiB per ring buffer); the
            # new engine runs where the old one did (same placement bundle).
            names, pids, _ = self._shm.get(i, ([], [], ""))
            await actor.sweep_left.remote(names, pids)
        except (asyncio.TimeoutError, GetTimeoutError) as err:
            self._starting.pop(i, None)
            raise EngineDeadError(f"engine {i} did not restart within engines.start_timeout_s") from err
        except (RayActorError, RayTaskError) as err:
            self._starting.pop(i, None)
            cause = getattr(err, "cause", None)
            raise EngineDeadError(str(cause) if isinstance(cause, RolloutError) else f"engine {i} failed to restart: {err}") from err
        self._shm[i] = held
        self._remember(i)
        return self.engines[i]

    def _remember(self, i: int) -> None:
        """Engine `i`'s /dev/shm names and processes in this run's record, and with a local cluster
        every process below Ray's own by now (its workers, the engine actors and their vLLM
        processes), for the start after a SIGKILL of this driver (`actors.leftovers`)."""
        names, pids, host = self._shm[i]
        if self._record is None or host != socket.gethostname():
            return
        local = bool(self._ray_pids)
        if local:
            self._record.cluster(sorted(self._ray_pids.union(*(descendants(p) for p in self._ray_pids))))
        self._record.engine(i, names, pids, local)

    def share(self, payload: Any) -> Any:
        """Put `payload` in Ray's object store once; every engine reads the same copy."""
        return payload if isinstance(payload, str) else ray.put(payload)

    async def shutdown(self) -> None:
        """Stop every engine (vLLM shutdown first, so its processes and shm go), then the actors."""
        for engine in self.engines:
            engine.close()
        if self._starting:  # a half-started engine has spawned processes but not yet said what they hold
            starts = [asyncio.ensure_future(_swallow(r)) for r in self._starting.values()]
            await _settle(starts, self.cfg.engines.start_timeout_s)
            self._starting.clear()
        if self.actors:
            refs = [a.shutdown.remote() for a in self.actors]
            await _settle([asyncio.ensure_future(_swallow(r)) for r in refs], 60)
            for a in self.actors:
                ray.kill(a, no_restart=True)
            self.actors.clear()
        self.channel.close()
        # An engine killed without a replacement left its /dev/shm names; those on this machine go here.
        this_host = socket.gethostname()
        here = [(names, pids) for names, pids, host in self._shm.values() if host == this_host]
        if here:
            await sweep_when_gone(Snapshot({n for names, _ in here for n in names}, {p for _, pids in here for p in pids}), timeout=10.0)
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        if self._record is not None:
            self._record.close()
        log.info("engines shut down")


def _copy(error: RolloutError) -> RolloutError:
    """A fresh exception per waiting group (one object raised in many tasks would pile up their
    tracebacks); the same one where its type cannot be rebuilt from a message."""
    try:
        return type(error)(str(error))
    except Exception:
        return error


async def _settle(tasks: list[asyncio.Future], timeout: float) -> None:
    """Wait for `tasks` at most `timeout` s, then cancel what is left (no task outlives shutdown)."""
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in pending:
        task.cancel()


async def _swallow(ref: Any) -> None:
    try:
        await ref
    except Exception:  # a dead actor has nothing left to shut down
        pass
