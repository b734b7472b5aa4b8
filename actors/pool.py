"""Engine actors on Ray: start N vLLM engines in a placement group, call them, shut them down.

Owns: one actor per engine with its resources and pinned cores (the cluster itself:
`actors.cluster`), readiness with a timeout, translation of Ray errors into
`rollout.errors`, and a shutdown that leaves no process or /dev/shm segment behind (a driver
SIGKILLed cannot shut down: what it left is recorded, and the next start removes it, `actors.leftovers`).
The actor itself is `ray.remote(shell(VLLMPolicy))`: a shell with no logic of its own (`actors.shell`); the driver's
handle on each is `actors.handle.RayEngine`, its groups on the data path of `actors.channel`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.channel import Channel
from actors.cluster import connect, missing_resources
from actors.handle import RayEngine
from actors.leftovers import Record, reap
from actors.shell import shell
from policies.shm import Snapshot, descendants, sweep_when_gone
from policies.vllm_args import checked_engine_args, engine_env
from policies.vllm_policy import VLLMPolicy
from rollout.config import Config
from rollout.errors import EngineDeadError, InvalidConfigError, RolloutError
from rollout.log import get_logger, open_run_logs, record_engine_start

log = get_logger(__name__)
ENGINE_ACTOR = shell(VLLMPolicy)  # what `ray.remote` gets: Ray's tracing wrappers stay on the driver's calls


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
        self.logs: Path | None = None  # the folder of the engines' output files (`rollout.log`); None: the console

    @classmethod
    async def start(cls, cfg: Config, model_path: str) -> RayEnginePool:
        """Start every engine concurrently; raises EngineDeadError if one fails or times out."""
        t0 = time.perf_counter()
        logs = open_run_logs(cfg.logging.dir, cfg.logging.level, cfg.logging.verbose)  # before vLLM and Ray speak
        checked_engine_args(cfg, model_path)  # bad engine args, and what vLLM's model config refuses, fail here
        await asyncio.to_thread(reap)  # what killed drivers on this machine left
        children = descendants(os.getpid())
        started_ray = connect(cfg)
        record = Record()
        if missing := missing_resources(
            cfg, ray.cluster_resources()
        ):  # else the placement group waits for the whole start timeout
            if started_ray:
                ray.shutdown()
            raise InvalidConfigError(missing)
        e = cfg.engines
        bundle = {"CPU": e.cpus_per_engine, **({"GPU": e.gpus_per_engine} if e.gpus_per_engine else {})}
        pg = placement_group([bundle] * e.count, strategy=e.placement_strategy)
        actors: list[Any] = []
        pool = cls(cfg, actors, pg, started_ray, record)
        pool.logs = logs
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
                raise EngineDeadError(
                    f"engines did not start within engines.start_timeout_s={e.start_timeout_s}"
                ) from err
            if isinstance(err, (RayActorError, RayTaskError)):
                cause = getattr(err, "cause", None)  # the engine's own EngineDeadError names the cause in one line
                raise EngineDeadError(
                    str(cause) if isinstance(cause, RolloutError) else f"an engine failed to start: {err}"
                ) from err
            raise
        log.info("engines ready", count=e.count)
        record_engine_start("pool", e.count, time.perf_counter() - t0)
        return pool

    def _spawn(self, i: int) -> Any:
        """Engine actor `i` in bundle `i` of the placement group (not started yet)."""
        e = self.cfg.engines
        log_file = str(self.logs / f"engine-{i}.log") if self.logs else ""
        env = engine_env(i, e.cpus_per_engine, e.gpus_per_engine, self.cfg.logging.level, log_file)
        return (
            ray.remote(ENGINE_ACTOR)
            .options(
                name=None,
                num_cpus=e.cpus_per_engine,
                num_gpus=e.gpus_per_engine,
                max_concurrency=e.max_inflight_per_engine + 16,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": env},
            )
            .remote(self.cfg, self.model_path, i)
        )

    async def restart(self, i: int) -> RayEngine:
        """Replace engine `i` (killed first, freeing its bundle) with a fresh one at epoch 0."""
        t0 = time.perf_counter()
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
        except (TimeoutError, GetTimeoutError) as err:
            self._starting.pop(i, None)
            raise EngineDeadError(f"engine {i} did not restart within engines.start_timeout_s") from err
        except (RayActorError, RayTaskError) as err:
            self._starting.pop(i, None)
            cause = getattr(err, "cause", None)
            raise EngineDeadError(
                str(cause) if isinstance(cause, RolloutError) else f"engine {i} failed to restart: {err}"
            ) from err
        self._shm[i] = held
        self._remember(i)
        record_engine_start("restart", 1, time.perf_counter() - t0)
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
            await sweep_when_gone(
                Snapshot({n for names, _ in here for n in names}, {p for _, pids in here for p in pids}), timeout=10.0
            )
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        if self._record is not None:
            self._record.close()
        log.info("engines shut down")


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
