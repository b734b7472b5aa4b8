"""Progress of a long command (`rollout bench`, `rollout run`) on stderr, readable wherever it goes.

Owns how progress looks: on a terminal, a live tqdm bar redrawn in place; anywhere else (CI, a
log file, `nohup`), one short line every `interval_s` seconds and one when a phase starts,
never a carriage return (a redrawn bar in a log file is one line of tens of thousands of
characters):

    bench: round 2/4, engine side, 512/1024 trajectories, 38 s

Does not own timing of what it reports: callers say when a phase starts and count items; `poll`
(called on every update, and by a caller's ticker while nothing is counted) decides when to print.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO


class Progress:
    """`start(phase, total)` per phase, `update(n)` per item, `close()` at the end.

    `enabled=False` prints nothing (`--no-progress`); `tty` overrides `stream.isatty()`;
    `clock` is for tests (monotonic seconds).
    """

    def __init__(
        self,
        label: str,
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        interval_s: float = 5.0,
        tty: bool | None = None,
        unit: str = "trajectories",
        clock: Callable[[], float] = time.monotonic,
    ):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.interval_s = interval_s
        self.unit = unit
        self._clock = clock
        self._tty = self.stream.isatty() if tty is None else tty
        self._bar: Any = None
        self._phase = ""
        self._total: int | None = None
        self._done = 0
        self._started = self._printed = clock()

    def start(self, phase: str, total: int | None = None) -> None:
        """A new phase (`round 2/4, engine side`), counting from zero up to `total` (None: unknown)."""
        self._phase, self._total, self._done = phase, total, 0
        self._started = self._clock()
        if not self.enabled:
            return
        if self._tty:
            desc = f"{self.label}: {phase}" if phase else self.label
            if self._bar is None:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, file=self.stream, unit="traj", dynamic_ncols=True, leave=False)
            else:
                self._bar.reset(total=total)
                self._bar.set_description(desc, refresh=True)
        else:
            self._line()

    def update(self, n: int = 1) -> None:
        self._done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
        else:
            self.poll()

    def poll(self) -> None:
        """Print a line if `interval_s` passed since the last one; on a terminal, redraw the bar
        (its elapsed time moves on while nothing is counted)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.refresh()
        elif not self._tty and self._clock() - self._printed >= self.interval_s:
            self._line()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _line(self) -> None:
        now = self._clock()
        self._printed = now
        count = f"{self._done}/{self._total} {self.unit}" if self._total is not None else f"{self._done} {self.unit}"
        counted = self._total is not None or self._done  # a phase that counts nothing shows its time alone
        parts = [self._phase, count if counted else "", f"{now - self._started:.0f} s"]
        print(f"{self.label}: " + ", ".join(p for p in parts if p), file=self.stream, flush=True)
