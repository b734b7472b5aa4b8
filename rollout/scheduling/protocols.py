"""The small interface `rollout/` uses to talk to generation engines, so it never imports ray or vllm.

`Engine` is one engine (a Ray actor in production, a small fake in unit tests); `EnginePool` owns a
set of them. `RolloutEngine` starts the real one (`actors.pool`: Ray actors running vLLM).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol

from rollout.errors import RolloutError
from rollout.types import Delta, EngineStats, Request, SpecCounters, Trajectory


class Engine(Protocol):
    engine_id: int

    def generate_group(
        self, requests: list[Request], on_delta: Callable[[Delta], None] | None = None
    ) -> AsyncIterator[Trajectory]:
        """Run a group's requests on this engine; yield each trajectory as soon as it finishes.

        Cancelling the iteration aborts the unfinished requests in the engine. A bad request
        yields a trajectory with finish_reason "error"; raises EngineDeadError. `on_delta` gets
        a streamed request's (`Request.stream`) new tokens as they are generated.
        """
        ...

    def start_group(
        self, requests: list[Request], deliver: Callable[[list[Trajectory] | RolloutError], None]
    ) -> Callable[[], None]:
        """`generate_group` without a task (`rollout.scheduling.callback_group`, the learner's plain groups):
        `deliver` gets each results frame's samples of the group as they finish, from a loop
        callback, or the RolloutError that ends the group (EngineDeadError; a bad request is a
        trajectory with finish_reason "error"). Returns the call that aborts what has not finished;
        nothing is delivered after it."""
        ...

    async def stats(self) -> EngineStats: ...

    async def progress(self) -> Mapping[str, Trajectory]:
        """The requests of the running groups as far as known, by request id: running ones with
        the tokens whose epochs are already exact; finished ones whole (`finished_at` set) or, once
        their results went out, not at all (`VLLMPolicy.progress`).
        May decode lazily (`rollout.types.ProgressReport`): it is read only if the engine fails."""
        ...

    async def kill(self) -> None:
        """Stop the engine at once (it hangs or misbehaves); its running calls raise EngineDeadError."""
        ...

    async def reset_prefix_cache(self) -> None: ...

    async def batch(self) -> tuple[float, float, float]:
        """The running batch so far: (running request-seconds, request-seconds waiting in the
        engine's queue, the engine's monotonic clock in seconds), cumulative since it started.
        Two readings give a window's mean running batch: d(running) / d(clock)."""
        ...

    # Weight updates, in two phases so that a failure to receive changes no engine.
    async def stage_weights(self, epoch: int, weights: Any) -> int:
        """Receive weights for `epoch` (a handle from `EnginePool.share`); returns bytes received."""
        ...

    async def drop_weights(self, epoch: int) -> None: ...

    async def commit_weights(self, epoch: int) -> dict[str, float]:
        """Pause per `weight_sync.mode`, load the staged weights, resume at `epoch`.

        Returns {"pause_s", "load_s", "stall_s"}. On failure the engine refuses further work.
        """
        ...

    async def run_raw(self, requests: list[Request], outputs: bool = False) -> dict:
        """Benchmark baseline: every request straight into the engine at once, no scheduler.

        Returns {"tokens", "trajectories", "start", "end"} (unix times), and with `outputs`
        "outputs": each request's (token ids, logprobs, finish reason), in order.
        """
        ...

    async def spec_counters(self) -> SpecCounters:
        """Cumulative speculative decoding counts since the engine started, this engine's only
        (all zero when it does not speculate). `rollout.metrics.specdecode` turns readings into windows."""
        ...


class EnginePool(Protocol):
    engines: Sequence[Engine]

    def share(self, payload: Any) -> Any:
        """Make `payload` readable by every engine, moving it once (Ray: the object store)."""
        ...

    async def restart(self, i: int) -> Engine:
        """Replace engine `i` with a freshly started one (epoch 0) and return it."""
        ...

    async def shutdown(self) -> None: ...
