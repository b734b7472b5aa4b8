"""Progress output: a live bar on a terminal, short lines every few seconds anywhere else."""

from __future__ import annotations

import io
import re

from rollout.bench.progress import Progress
from rollout.bench.run import run_bench
from tests.support.bench import bench_config
from tests.support.fakes import FakePool


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_off_a_terminal_a_line_per_phase_and_then_every_interval():
    stream, clock = io.StringIO(), Clock()  # StringIO.isatty() is False: a log file, CI, nohup
    progress = Progress("bench", stream=stream, interval_s=5.0, clock=clock)
    progress.start("round 2/4, engine side", total=1024)
    for _ in range(100):
        progress.update(1)  # within the interval: no line
    clock.now += 38
    progress.update(412)
    progress.update(1)  # the line just went out: not another
    clock.now += 1
    progress.start("round 2/4, raw vLLM side")  # counts nothing: its time alone
    clock.now += 4.9
    progress.poll()
    clock.now += 0.1
    progress.poll()
    progress.close()

    assert stream.getvalue().splitlines() == [
        "bench: round 2/4, engine side, 0/1024 trajectories, 0 s",
        "bench: round 2/4, engine side, 512/1024 trajectories, 38 s",
        "bench: round 2/4, raw vLLM side, 0 s",
        "bench: round 2/4, raw vLLM side, 5 s",
    ]
    assert "\r" not in stream.getvalue()


def test_no_progress_prints_nothing():
    stream = io.StringIO()
    progress = Progress("bench", stream=stream, enabled=False, interval_s=0.0)
    progress.start("warm-up", 4)
    progress.update(4)
    progress.poll()
    progress.close()
    assert stream.getvalue() == ""


def test_on_a_terminal_a_bar_redrawn_in_place():
    stream = io.StringIO()
    progress = Progress("bench", stream=stream, tty=True)
    progress.start("round 1/4, engine side", total=8)
    progress.update(8)
    progress.poll()  # redraws now (tqdm itself redraws at most every 0.1 s)
    progress.close()
    out = stream.getvalue()
    assert "\r" in out and "bench: round 1/4, engine side" in out and "8/8" in out


async def test_bench_progress_off_a_terminal_names_each_round_and_side():
    stream = io.StringIO()
    progress = Progress("bench", stream=stream, interval_s=0.0)  # every update prints
    await run_bench(bench_config("bench.rounds=2", "bench.warmup_prompts=2"), progress=progress, pool=FakePool(2))
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    phases = list(dict.fromkeys(re.sub(r"(, \d+/\d+ trajectories)?, \d+ s$", "", line) for line in lines))
    assert phases == [
        "bench: warm-up",
        "bench: round 1/2, engine side",
        "bench: round 1/2, raw vLLM side",
        "bench: round 2/2, raw vLLM side",
        "bench: round 2/2, engine side",
    ]
    assert "bench: warm-up, 4/4 trajectories" in stream.getvalue()  # 2 prompts x n=2
    assert sum("round 1/2, engine side, 12/12 trajectories" in line for line in lines) == 1  # 6 prompts x n=2
