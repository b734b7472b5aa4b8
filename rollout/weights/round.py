"""One weight-transfer round's state on the driver, and the weight_version labels of epochs
(`rollout.weights.transfer` drives both).

Owns: `Round` (the round's engines, epoch, names, bytes, failures and the events its calls and
its idle timer wait on), `add_label` and `MAX_LABELS`. Does not own: the calls on the engines
(`rollout.weights.transfer`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

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


def add_label(versions: dict[str, int], version: str, epoch: int) -> None:
    """`version` names `epoch`, as the newest label; past MAX_LABELS the oldest is forgotten (a
    learner labelling every step would otherwise grow `versions` without end)."""
    versions.pop(version, None)
    versions[version] = epoch
    while len(versions) > MAX_LABELS:
        del versions[next(iter(versions))]
