"""The learner's side of vLLM's weight-transfer calls on this engine: `WeightSyncClient`, the blocking
`VLLMWeightSyncClient` a learner hands to vLLM's `TrainerWeightTransferEngine`, and `loop_caller`,
which runs its calls on the engine's event loop from the learner's thread.

Owns: turning each blocking client call into a call of `rollout.weights.transfer.WeightTransfer` on
the engine's loop. Does not own: what the calls do (`rollout.weights.transfer`).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout.weights.transfer import WeightTransfer


class WeightSyncClient:
    """vLLM's `VLLMWeightSyncClient` over this engine: blocking calls, made from a learner thread
    (not the engine's event loop: `await anyio.to_thread.run_sync(trainer.send_weights)`)."""

    def __init__(self, transfer: WeightTransfer, call: Callable[..., Any], wait: bool = True):
        self.transfer, self._call, self.wait = transfer, call, wait

    def world_size(self) -> int:
        """Model workers over every engine: the learner's group is 1 + this (one sending rank)."""
        return self._call(self.transfer.world_size)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call(self.transfer.init, init_info)

    def start_weight_update(self) -> None:
        self._call(self.transfer.start)

    def update_weights(self, update_info: Any) -> None:
        self._call(self.transfer.update, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> int:
        """Returns the round's epoch: every healthy engine serves it now, or (`wait=False`) once
        the engines finish in the background (`RolloutEngine.weights_loaded`)."""
        return self._call(self.transfer.finish, weight_version, self.wait)

    def update_weight_version(self, new_version: str) -> int:
        """Labels the current epoch `new_version` (`versions`); returns the epoch."""
        return self._call(self.transfer.label, new_version)

    @property
    def versions(self) -> dict[str, int]:
        return dict(self.transfer.versions)

    def shutdown_weight_transfer_engine(self) -> None:
        self.transfer.members = None  # a restarted trainer inits again; the workers' groups go with that


def loop_caller(loop: asyncio.AbstractEventLoop) -> Callable[..., Any]:
    """Run a function on `loop` (the running one, whose thread this is) from another thread and
    wait for it; a plain (non-blocking) function runs at once on the loop's own thread too."""
    home = threading.get_ident()

    def call(fn: Callable[..., Any], *args: Any) -> Any:
        if not inspect.iscoroutinefunction(fn):
            return fn(*args) if threading.get_ident() == home else _on(loop, fn, *args)
        if threading.get_ident() == home:
            raise RuntimeError(
                "the weight-sync client blocks: call it from a thread, "
                "e.g. await anyio.to_thread.run_sync(trainer.send_weights)"
            )
        return asyncio.run_coroutine_threadsafe(fn(*args), loop).result()

    return call


def _on(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> Any:
    async def run() -> Any:
        return fn(*args)

    return asyncio.run_coroutine_threadsafe(run(), loop).result()
