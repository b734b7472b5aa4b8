"""Real engines for the integration tier: the one config fixture, shared engine pools, process and
/dev/shm checks.

An engine start (a Ray actor, vLLM's engine core and worker processes, the model) is what the tier
spends its time on, so engines are started once per kind and shared: `SharedPools` keeps one pool
per set of settings vLLM is started with (`pool_key`), and each test gets a `RolloutEngine` of its
own over it (`SharedPools.engine`), with its own driver-side settings (sampling, scheduling,
environment, health checks) and its own `weight_sync` (mode and bound: the engine reads them at
each use, never at start, so the lease sets them on the idle engines). When that engine exits, the pool is
handed back as a fresh one would be (resumed, the model's own weights loaded, prefix caches
emptied, every engine in rotation) or, when the test failed or any of that did not hold, shut down,
so a failed test never makes the next one fail. Tests that kill or reconfigure their engines start
their own (`RolloutEngine(integration_config(...))`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from policies.shm import mapped
from rollout import RolloutEngine, load_config
from rollout.config import Config
from rollout.log import configure, get_logger
from tests.support import starts

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 1024
POOL_INFLIGHT = 128  # every shared pool's max_inflight_per_engine: a test's own may be at most this
log = get_logger(__name__)


def integration_config(*overrides: str) -> Config:
    return load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            "model.dtype=float32",
            f"model.max_model_len={MAX_MODEL_LEN}",
            "sampling.max_tokens=16",
            "engines.max_inflight_per_engine=64",
            # Eager: no torch.compile at start (~3 s of each start here); the oracle runs' engines
            # (`oracle_runs.SMALL_KV`) and the CLI's keep vLLM's default, compiled path.
            "engines.vllm={block_size: 32, enforce_eager: true}",
            "logging.level=warning",
            # Logical CPUs for the local cluster: the shared pools alive at once and a test's own
            # pool must all fit; OpenMP threads stay pinned to the real cores.
            "ray.num_cpus=16",
            *overrides,
        ],
    )


# Engine settings the driver alone reads: a pool serves every config that differs only in these.
DRIVER_ONLY = {
    "max_inflight_per_engine", "queued_per_engine", "start_timeout_s", "health_interval_s", "health_timeout_s",
    "max_restarts", "restart_backoff_s", "request_timeout_s", "max_retries",
}  # fmt: skip


def _started_with(cfg: Config) -> dict[str, Any]:
    """What a pool's engine actors are started with: the model, the engines and vLLM's arguments,
    speculation, the logprobs kind."""
    engines = {k: v for k, v in msgspec.to_builtins(cfg.engines).items() if k not in DRIVER_ONLY}
    return {
        "model": msgspec.to_builtins(cfg.model),
        "engines": engines,
        "speculative": msgspec.to_builtins(cfg.speculative),
        "logprobs": cfg.sampling.logprobs,
    }


def pool_key(cfg: Config) -> bytes:
    """A pool's kind: what its engine actors are started with."""
    return msgspec.json.encode(_started_with(cfg), order="sorted")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict's leaves by their dotted paths."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    return {k: v for key, value in tree.items() for k, v in _flat(value, f"{prefix}.{key}".lstrip(".")).items()}


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(_shown, value)) + "]"
    if isinstance(value, str):  # a model directory by its name, a class by its own
        return value.rsplit("/", 1)[-1].rsplit(":", 1)[-1]
    return str(value)


def kind(cfg: Config) -> str:
    """A pool's kind in a few words, for the run's summary: what its engines are started with that
    the default integration config's are not, besides their count ("default" where nothing)."""
    here, base = _flat(_started_with(cfg)), _flat(_started_with(integration_config()))
    words = []
    for key in [*here, *(k for k in base if k not in here)]:
        value = here.get(key)
        if key == "engines.count" or value == base.get(key):
            continue
        name = key.removeprefix("engines.vllm.").removeprefix("engines.").removeprefix("model.")
        if name == "enforce_eager":
            words.append("eager" if value else "compiled")
        elif name == "speculative.method":
            words.append(f"spec-decode {value}")
        elif key not in here:
            words.append(f"{name} unset")
        else:
            words.append(f"{name.removeprefix('speculative.')}={_shown(value)}")
    return ", ".join(words) or "default"


def _set_weight_sync(shell: Any, weight_sync: Any) -> None:
    """Inside an engine actor (the shell over the policy, `actors.shell`): its weight-sync settings."""
    shell.inner.cfg = msgspec.structs.replace(shell.inner.cfg, weight_sync=weight_sync)


class Lease:
    """A shared pool as one RolloutEngine sees it: its shutdown hands the pool back."""

    def __init__(self, pool: Any):
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    async def shutdown(self) -> None:
        pass


class SharedPools:
    """Engine pools kept across tests, one per `pool_key`; at most `max_engines` engines alive
    (the least recently used idle pool stops first). The session's Ray cluster is started before
    any pool, so that no pool owns it."""

    def __init__(self, max_engines: int = 4, start: Callable[[Config], Awaitable[Any]] | None = None):
        self.max_engines = max_engines
        self._start = start or self._start_ray_pool  # a unit test's fake pools instead
        self._pools: dict[bytes, Any] = {}  # key -> pool, least recently used first
        self._leased: set[bytes] = set()
        self._spoiled: set[int] = set()  # ids of engines whose tests failed
        self._started_ray = False

    @contextlib.asynccontextmanager
    async def engine(self, cfg: Config, fresh: bool = False, **kwargs: Any) -> AsyncIterator[RolloutEngine]:
        """A RolloutEngine of `cfg` (and RolloutEngine's keyword arguments) over the shared pool of
        its kind, at the epoch the pool's engines serve (the model's own weights). `fresh`: the
        pool is started now, an idle one of the kind stopped first (for a test of what a start
        does; the kind's first user costs nothing more)."""
        if cfg.engines.max_inflight_per_engine > POOL_INFLIGHT:
            raise ValueError(f"a shared pool runs at most {POOL_INFLIGHT} requests per engine")
        key = pool_key(cfg)
        if key in self._leased:
            raise RuntimeError("this kind of pool is already in use by another engine of the test")
        if fresh:
            await self._stop(key)
        pool = await self._pool(key, cfg)
        starts.append("lease", label=kind(cfg), count=cfg.engines.count, test=current_test())
        epoch = (await pool.engines[0].stats()).epoch
        actors = getattr(pool, "actors", [])  # Ray's engine actors (a fake pool has none)
        await asyncio.gather(*(a.__ray_call__.remote(_set_weight_sync, cfg.weight_sync) for a in actors))
        self._leased.add(key)
        why: str | None = "the test failed"
        try:
            async with RolloutEngine(cfg, pool=Lease(pool), start_epoch=epoch, **kwargs) as engine:
                yield engine
                spoiled = id(engine) in self._spoiled
                self._spoiled.discard(id(engine))
                why = "a test of its engine failed" if spoiled else await _hand_back(engine, epoch)
        finally:
            self._leased.discard(key)
            if why is not None:  # engines not as a fresh pool's: the next test starts anew
                test = current_test()
                why = f"{why} (after {test})" if test else why
                log.warning("shared pool dropped", reason=why)
                starts.append("dropped", reason=why)
                await self._stop(key)

    def spoil(self, engine: RolloutEngine) -> None:
        """A test of `engine` failed: its pool is shut down when the engine exits, not handed on
        (for an engine shared by several tests, whose context did not see the failure)."""
        self._spoiled.add(id(engine))

    async def _pool(self, key: bytes, cfg: Config) -> Any:
        if (pool := self._pools.pop(key, None)) is not None:
            self._pools[key] = pool  # most recently used last
            return pool
        alive = sum(len(p.engines) for p in self._pools.values())
        for old in [k for k in self._pools if k not in self._leased]:
            if alive + cfg.engines.count <= self.max_engines:
                break
            alive -= len(self._pools[old].engines)
            await self._stop(old)
        started = msgspec.structs.replace(
            cfg, engines=msgspec.structs.replace(cfg.engines, max_inflight_per_engine=POOL_INFLIGHT)
        )
        self._pools[key] = pool = await self._start(started)
        return pool

    async def _start_ray_pool(self, cfg: Config) -> Any:
        from actors.cluster import connect
        from actors.pool import RayEnginePool
        from rollout.tiny import resolve_model_path

        # The start's own lines (what it removed of a killed run) go where the test's RolloutEngine
        # would send them, had it started its pool itself: its __aenter__ configures this first.
        configure(cfg.logging.level, cfg.logging.json)
        self._started_ray |= connect(cfg)  # the session's cluster (a no-op once it is up): no pool owns it
        path = await asyncio.to_thread(resolve_model_path, cfg.model.path, cfg.model.seed)
        return await RayEnginePool.start(cfg, str(path))

    async def _stop(self, key: bytes) -> None:
        if (pool := self._pools.pop(key, None)) is not None:
            await pool.shutdown()

    async def close(self) -> None:
        for key in list(self._pools):
            await self._stop(key)
        if self._started_ray:
            import ray

            ray.shutdown()


def current_test() -> str:
    """The test running now (pytest names it during its setup, call and teardown), or ""."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]


async def _hand_back(engine: RolloutEngine, epoch: int) -> str | None:
    """Put a leased pool back as a fresh one: generation resumed, the model's own weights loaded
    where an update changed them, prefix caches empty (requests of the next engine reuse ids and
    cache salts). None when it is; else why not (it failed, or an engine is out of rotation)."""
    from tests.support.oracle_runs import ungate

    ungate(engine)  # a test's hold on commits (`commit_when`) must not hold the hand-back's update
    runner = engine._scheduler.runner
    try:
        async with asyncio.timeout(300):
            for i, load in enumerate(runner.loads):  # a killed engine the health watch has not seen yet
                if load.healthy:
                    await runner._check(i)  # ... is seen now, and restarts
            while any(load.restarting for load in runner.loads):  # a killed engine's restart ends first
                await asyncio.sleep(0.1)
            if await engine.is_paused():
                await engine.resume_generation()
            stats = await engine.stats()
            if engine.epoch != epoch or any(s.epoch != engine.epoch for s in stats):
                await engine.update_weights(engine.model_path)
            for e in engine.pool.engines:
                await e.reset_prefix_cache()
            stats = await engine.stats()
    except Exception as e:  # noqa: BLE001 -- any failure: the pool is dropped, the reason recorded
        return f"handing it back failed: {type(e).__name__}: {e}"[:300]
    if out := [i for i, load in enumerate(runner.loads) if not load.healthy]:
        return f"engines {out} out of rotation"
    if any(s.epoch != engine.epoch for s in stats):
        return f"engines at epochs {[s.epoch for s in stats]}, the driver at {engine.epoch}"
    return None


async def held(enter: Callable[[], Any]) -> AsyncIterator[Any]:
    """What the async context manager `enter()` yields, for an async fixture: pytest-asyncio sets
    up and tears down a fixture in different tasks, but a RolloutEngine's task group must be
    entered and exited by one task, so the context is held open in a task of its own."""
    ready, stop = asyncio.Event(), asyncio.Event()
    holder: list[Any] = []

    async def hold() -> None:
        async with enter() as value:
            holder.append(value)
            ready.set()
            await stop.wait()

    task = asyncio.ensure_future(hold())
    await asyncio.wait([task, asyncio.ensure_future(ready.wait())], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()  # start failed: raise its error
    yield holder[0]
    stop.set()
    await task


def engine_processes() -> set[int]:
    """PIDs of processes that belong to vLLM engines or Ray workers."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    pids = set()
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if re.search(r"EngineCore|VllmWorker|ray::|raylet|gcs_server", args) and int(pid) != os.getpid():
            pids.add(int(pid))
    return pids


def shm_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(("psm_", "sem.mp-"))}


def leaked_shm(before: set[str]) -> set[str]:
    """Segments made since `before` that no live process maps any more."""
    return (shm_segments() - before) - mapped()


def run_python(code: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
