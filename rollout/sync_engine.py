"""`SyncRolloutEngine`: the blocking facade over `RolloutEngine` for plain-script learners."""

from __future__ import annotations

import signal
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import anyio.from_thread

from rollout.batch import Batch
from rollout.config import Config
from rollout.driver_process import catch_sigterm, exit_on_sigterm, restore_sigterm
from rollout.engine import RolloutEngine
from rollout.handout.staleness import StalenessStats
from rollout.types import EngineStats, Group


class SyncRolloutEngine:
    """Blocking facade: the async engine runs on an event loop in a thread this object owns.

    with SyncRolloutEngine("tiny") as engine:
        engine.feed(prompts)
        for group in engine.groups(): ...
    """

    def __init__(self, cfg: Config | str | Path, **kwargs: Any):
        self._engine = RolloutEngine(cfg, **kwargs)
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        self._engine_cm = self._portal.wrap_async_context_manager(self._engine)

    def __enter__(self) -> SyncRolloutEngine:
        self._old_sigterm = catch_sigterm()  # the engine's loop runs in a thread: catch it here
        try:
            self._engine_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            restore_sigterm(self._old_sigterm)
            raise
        if self._old_sigterm is not None:  # take it back from Ray's driver, which aborts on it
            signal.signal(signal.SIGTERM, exit_on_sigterm)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._engine_cm.__exit__(*exc)
        finally:
            # With an exception (a signal in the middle of a call), calls still running are cancelled.
            self._portal_cm.__exit__(*exc)
            restore_sigterm(self._old_sigterm)

    def feed(self, prompts: Any) -> None:
        self._portal.call(self._engine.feed, prompts)

    def groups(self) -> Iterator[Group]:
        while (group := self._portal.call(self._engine.next_group)) is not None:
            yield group

    def batch(self, groups: int) -> Batch | None:
        return self._portal.call(self._engine.next_batch, groups)

    def update_weights(self, weights: Any, *, wait: bool = True) -> int:
        return self._portal.call(lambda: self._engine.update_weights(weights, wait=wait))

    def weights_loaded(self) -> int:
        """`RolloutEngine.weights_loaded`."""
        return self._portal.call(self._engine.weights_loaded)

    def weight_sync_client(self, *, wait: bool = True) -> Any:
        """`RolloutEngine.weight_sync_client`: vLLM's `VLLMWeightSyncClient`, callable from any thread."""
        from rollout.weights.sync_client import WeightSyncClient

        return WeightSyncClient(self._portal.call(self._engine._weight_transfer), self._portal.call, wait)

    def commit(self, handed: Batch | Group | Iterable[Group] | None = None) -> None:
        """See `RolloutEngine.commit`."""
        self._portal.call(self._engine.commit, handed)

    @property
    def epoch(self) -> int:
        return self._engine.epoch

    @property
    def staleness(self) -> StalenessStats:
        return self._engine.staleness

    def stats(self) -> list[EngineStats]:
        return self._portal.call(self._engine.stats)

    def metrics(self) -> dict[str, float]:
        """`RolloutEngine.metrics`: every figure since the previous call, for a tracker."""
        return self._portal.call(self._engine.metrics)
