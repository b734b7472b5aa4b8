"""One weight-transfer round on the driver: its state, what it needs of the engine's weight
updates, and the weight_version labels of epochs (`rollout.weights.transfer` drives them).

Owns: `Round` (the round's engines, epoch, names, bytes, failures and the events its calls and
its idle timer wait on), `Updates` (the few calls a round makes on the engine's epochs and
engines; `rollout.weights.updates.WeightUpdates` implements them), `failures` and `describe`
(an engine fan-out's failures, named), `add_label` and `MAX_LABELS`. Does not own: the calls on
the engines (`rollout.weights.transfer`), epochs and restarts (`rollout.weights.updates`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import anyio

    from rollout.config import Config
    from rollout.scheduling.protocols import Engine
    from rollout.tensors import Manifest
    from rollout.types import UpdateStats

MAX_LABELS = 256  # weight_version labels kept (`WeightTransfer.versions`), the newest


class Round:
    """One round, from the learner's start_weight_update to its end (finished or called off)."""

    def __init__(self, epoch: int, live: list[int], engines: list[Any]):
        self.epoch, self.live, self.engines = epoch, live, engines
        self.started = False  # engines paused and in vLLM's start_weight_update
        self.finishing = False  # finish_weight_update(wait=False) returned: the engines finish in the background
        self.names: set[str] = set()
        self.nbytes = 0
        self.bad: dict[int, str] = {}
        self.t0 = time.perf_counter()
        self.locked = asyncio.Event()
        self.closed = asyncio.Event()
        self.poke = asyncio.Event()
        self.busy = 0


class Updates(Protocol):
    """What a weight-transfer round uses of the engine's weight updates: its config, the epoch
    every healthy engine serves, the update lock and figures, and the calls below. Nothing else:
    epochs, restarts and parked engines stay theirs (`rollout.weights.updates` says what each does)."""

    cfg: Config
    epoch: int  # the weights every healthy engine serves
    lock: anyio.Lock  # one update at a time: a round holds it from start to end
    history: list[UpdateStats]  # the figures of every update, a round's appended at its finish

    def members(self) -> list[int]: ...  # the engines an update goes to (raises EngineDeadError: none)
    def engines(self, ids: list[int]) -> list[Engine]: ...
    def incarnation(self, i: int) -> int: ...  # +1 per restart or broken transfer group of engine `i`
    async def settled(self) -> int: ...  # an update that did not wait ended; its failure raises once
    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None: ...  # in the engine's task group
    def next_epoch(self) -> int: ...  # the epoch the next update would load (never one used before)
    async def allocate(self, epoch: int) -> None: ...  # an engine may hold `epoch` from now on
    def finish_later(self, epoch: int, work: Callable[[], Awaitable[Any]]) -> None: ...  # `wait=False`
    def failed_transfer(self, i: int) -> None: ...  # engine `i`'s transfer group is broken
    def lost(self, i: int, reason: str) -> None: ...  # engine `i` leaves rotation and restarts
    def model_manifest(self) -> Manifest: ...  # the model's tensors, read once
    def learner_serves(self, epoch: int, live: list[int], bad: dict[int, str]) -> None: ...


def failures(ids: list[int], results: list[Any], timeout_reason: str = "timed out") -> dict[int, str]:
    """Engine id -> reason, for every result that is an exception."""
    out = {}
    for i, r in zip(ids, results):
        if isinstance(r, BaseException):
            out[i] = (
                timeout_reason if isinstance(r, (asyncio.TimeoutError, TimeoutError)) else f"{type(r).__name__}: {r}"
            )
    return out


def describe(failures: dict[int, str]) -> str:
    return "; ".join(f"engine {i}: {reason}" for i, reason in sorted(failures.items()))


def add_label(versions: dict[str, int], version: str, epoch: int) -> None:
    """`version` names `epoch`, as the newest label; past MAX_LABELS the oldest is forgotten (a
    learner labelling every step would otherwise grow `versions` without end)."""
    versions.pop(version, None)
    versions[version] = epoch
    while len(versions) > MAX_LABELS:
        del versions[next(iter(versions))]
