"""Integration tier: the real vLLM engine on the embedded tiny model, inside real Ray actors.

One engine pair serves the whole session (engine start is the expensive part); tests vary the
sampling per prompt through `Prompt.sampling` overrides instead of restarting engines.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from policies.shm import mapped
from rollout import RolloutEngine, load_config

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 512
RERUNS = int(os.environ.get("ROLLOUT_INTEGRATION_RERUNS", "1"))


def pytest_collection_modifyitems(items):
    """Every test here is `integration`, and gets one rerun when it fails (`R` in the progress
    line, "rerun" in the summary): these run real engines on whatever the machine's two shared
    cores give them, and a test that fails twice fails the suite. A hang (pytest-timeout) is not
    rerun."""
    for item in items:
        if "tests/integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
            if item.get_closest_marker("flaky") is None:
                item.add_marker(pytest.mark.flaky(reruns=RERUNS, rerun_except="Timeout >"))


def integration_config(*overrides: str):
    return load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            "model.dtype=float32",
            f"model.max_model_len={MAX_MODEL_LEN}",
            "sampling.max_tokens=16",
            "engines.max_inflight_per_engine=64",
            "logging.level=warning",
            # Logical CPUs for the local cluster: the session engines and a test's own pool
            # (test_weights) must both fit; OpenMP threads stay pinned to the real cores.
            "ray.num_cpus=8",
            *overrides,
        ],
    )


async def held_engine(cfg):
    """An engine for an async fixture: yields it, then closes it. pytest-asyncio sets up and tears
    down an async fixture in different tasks, but a task group must be entered and exited by one
    task: the engine is held open in a task of its own."""
    ready, stop = asyncio.Event(), asyncio.Event()
    holder: list[RolloutEngine] = []

    async def hold() -> None:
        async with RolloutEngine(cfg) as e:
            holder.append(e)
            ready.set()
            await stop.wait()

    task = asyncio.ensure_future(hold())
    await asyncio.wait([task, asyncio.ensure_future(ready.wait())], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()  # start failed: raise its error
    yield holder[0]
    stop.set()
    await task


@pytest.fixture(scope="session")
async def engine():
    async for e in held_engine(integration_config()):
        yield e


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
