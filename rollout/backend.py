"""The small interface `rollout/` uses to talk to generation engines, so it never imports ray or vllm.

`Engine` is one engine (a Ray actor in production, a small fake in unit tests); `EnginePool` owns a
set of them. `start_pool` builds the real one (Ray actors running vLLM) on demand.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

from rollout.types import EngineStats, Request, Trajectory

if TYPE_CHECKING:
    from rollout.config import Config


class Engine(Protocol):
    engine_id: int

    async def generate(self, request: Request) -> Trajectory:
        """Run one request to its end. Cancelling the call aborts the request in the engine.

        A bad request returns a trajectory with finish_reason "error"; raises EngineDeadError.
        """
        ...

    async def stats(self) -> EngineStats: ...

    async def reset_prefix_cache(self) -> None: ...

    async def run_raw(self, requests: list[Request]) -> dict:
        """Benchmark baseline: every request straight into the engine at once, no scheduler.

        Returns {"tokens", "trajectories", "start", "end"} (unix times).
        """
        ...


class EnginePool(Protocol):
    engines: Sequence[Engine]

    async def shutdown(self) -> None: ...


async def start_pool(cfg: Config, model_path: str) -> EnginePool:
    """Start `cfg.engines.count` vLLM engines as Ray actors and wait until all serve."""
    from actors.pool import RayEnginePool  # the only way in to ray, taken lazily

    return await RayEnginePool.start(cfg, model_path)
