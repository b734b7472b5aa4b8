"""Simulated engines hosted for the driver (`benchmarks/cluster_sim.py`): `SimHost` runs many
`benchmarks.sim_engine.SimEngine`s in one process (a Ray actor per few dozen engines, not one per
engine, so the simulation leaves the driver its CPU); `EngineHandle` makes one of them look like an
actor handle to the driver's real `actors.handle.RayEngine`; `SimPool` is the `EnginePool` over them
(restart, kill, stall, counts). With `local`, the hosts are plain objects in the driver's process
(tests: no Ray; the driver's CPU is then not its own).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import random
import resource
from typing import Any

from actors.channel import Channel
from actors.handle import RayEngine
from benchmarks.sim_engine import TABLE, LengthDist, SimEngine, SimSpec
from rollout.errors import EngineDeadError
from rollout.packed import Logprobs, TokenIds


class SimHost:
    """Many simulated engines in one process (a Ray actor in the benchmark, a plain object in tests)."""

    def __init__(self, spec: SimSpec, engine_ids: list[int]):
        rng = random.Random(spec.seed)
        dist = LengthDist(spec.length)
        self.spec = spec
        self.lengths = [dist.sample(rng) for _ in range(TABLE)]
        cap = max(self.lengths)
        self.tokens = TokenIds(rng.randrange(4, spec.vocab) for _ in range(TABLE + cap)).tobytes()
        self.logprobs = Logprobs(-rng.random() * 3 for _ in range(TABLE + cap)).tobytes()
        self.engines = {i: self._new(i) for i in engine_ids}
        self.retired: dict[str, float] = {}  # counts of engines replaced by a restart
        self.calls: dict[str, int] = {}  # the driver's calls, by method: its Ray hops

    def _new(self, i: int) -> SimEngine:
        return SimEngine(self.spec, i, self.lengths, self.tokens, self.logprobs)

    async def call(self, i: int, name: str, *args: Any) -> Any:
        """Engine `i`'s method `name`, as the actor method of the same name would answer it."""
        engine = self.engines[i]
        self.calls[name] = self.calls.get(name, 0) + 1
        if engine.stalled and not engine.dead:
            await engine.died.wait()
        if engine.dead:
            raise EngineDeadError(f"engine {i} is dead (the simulator killed it)")
        result = getattr(engine, name)(*args)
        if not inspect.isawaitable(result):
            return result
        task = asyncio.ensure_future(result)
        engine.calls.add(task)
        task.add_done_callback(engine.calls.discard)
        try:
            return await task
        except asyncio.CancelledError:
            if engine.dead:
                raise EngineDeadError(f"engine {i} is dead (the simulator killed it)") from None
            raise

    def kill_engine(self, i: int) -> None:
        self.engines[i].stop()

    def stall_engine(self, i: int) -> None:
        self.engines[i].freeze()

    def restart_engine(self, i: int) -> None:
        self.engines[i].stop()
        for k, v in self.engines[i].counts.items():
            self.retired[k] = self.retired.get(k, 0) + v
        self.engines[i] = self._new(i)

    def counts(self) -> dict[str, float]:
        """Summed over this host's engines, with the process's CPU seconds."""
        out = {"cpu_s": sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), **self.retired}
        out.update({f"calls.{k}": v for k, v in self.calls.items()})
        for e in self.engines.values():
            e._account()
            for k, v in e.counts.items():
                out[k] = out.get(k, 0) + v
        return out


class EngineHandle:
    """Engine `i` of a host, as `RayEngine` uses an actor handle: `handle.method.remote(*args)`."""

    def __init__(self, host: Any, i: int):
        self.host, self.i = host, i

    def __getattr__(self, name: str) -> _Method:
        return _Method(self.host, self.i, name)


class _Method:
    __slots__ = ("host", "i", "name")

    def __init__(self, host: Any, i: int, name: str):
        self.host, self.i, self.name = host, i, name

    def remote(self, *args: Any) -> Any:
        return self.host.call.remote(self.i, self.name, *args)


class SimRayEngine(RayEngine):
    """The driver's real `RayEngine`; only `kill` differs (`ray.kill` would take the whole host)."""

    async def kill(self) -> None:
        await self.actor.host.kill_engine.remote(self.engine_id)


class Local:
    """A plain object as an actor handle (`obj.method.remote(*args)` -> an awaitable), for tests."""

    def __init__(self, target: Any):
        self.target = target

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self.target, name))


class _LocalMethod:
    __slots__ = ("method",)

    def __init__(self, method: Any):
        self.method = method

    def remote(self, *args: Any) -> asyncio.Future:
        result = self.method(*args)
        if inspect.isawaitable(result):
            return asyncio.ensure_future(result)
        done = asyncio.get_running_loop().create_future()
        done.set_result(result)
        return done


class SimPool:
    """The `EnginePool` protocol over `count` simulated engines on `hosts` hosts (Ray actors, or
    plain objects in this process with `local`). Build it with `SimPool.start`."""

    def __init__(
        self,
        hosts: list[Any],
        count: int,
        local: bool,
        objects: list[SimHost] | None = None,
        address: str = "127.0.0.1",
    ):
        self.hosts, self.local, self.objects = hosts, local, objects or []
        self.per_host = math.ceil(count / len(hosts))
        self.channel = Channel(address)
        self.engines = [SimRayEngine(EngineHandle(self.host(i), i), i, self.channel) for i in range(count)]
        self.restarts: list[int] = []
        self.restarted = asyncio.Event()  # set at each restart

    @classmethod
    def start(cls, spec: SimSpec, count: int, hosts: int = 4, local: bool = False) -> SimPool:
        hosts = min(hosts, count)
        per = math.ceil(count / hosts)
        ids = [list(range(h * per, min(count, (h + 1) * per))) for h in range(hosts)]
        if local:
            objects = [SimHost(spec, i) for i in ids if i]
            return cls([Local(o) for o in objects], count, True, objects)
        import ray

        actor = ray.remote(SimHost).options(num_cpus=0, max_concurrency=100_000)
        return cls([actor.remote(spec, i) for i in ids if i], count, False, address=ray.util.get_node_ip_address())

    async def ready(self) -> None:
        """Wait until every host is up, as the real pool waits for its engines before the driver
        runs: a host still starting (its process importing, on a busy machine for seconds) would
        miss the health watch's first reports and be killed."""
        await self.counts()

    def host(self, i: int) -> Any:
        return self.hosts[i // self.per_host]

    def share(self, payload: Any) -> Any:
        if self.local or isinstance(payload, str):
            return payload
        import ray

        return ray.put(payload)

    async def restart(self, i: int) -> SimRayEngine:
        self.engines[i].close()
        await self.host(i).restart_engine.remote(i)
        self.engines[i] = SimRayEngine(EngineHandle(self.host(i), i), i, self.channel)
        self.restarts.append(i)
        self.restarted.set()
        return self.engines[i]

    async def kill(self, i: int) -> None:
        await self.host(i).kill_engine.remote(i)

    async def stall(self, i: int) -> None:
        await self.host(i).stall_engine.remote(i)

    async def counts(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in await asyncio.gather(*(h.counts.remote() for h in self.hosts)):
            for k, v in c.items():
                out[k] = out.get(k, 0) + v
        return out

    async def shutdown(self) -> None:
        for e in self.engines:
            e.close()
        self.channel.close()
        if self.local:
            for o in self.objects:
                for e in o.engines.values():
                    e.stop()
            return
        import ray

        for h in self.hosts:
            ray.kill(h, no_restart=True)
