"""The durable hand-off log (`rollout.handout.durable`) in tests: groups to log, a log written and
read back record by record, and a directory or disk that refuses writes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from rollout.handout.durable import DurableLog
from rollout.handout.durable_format import LogReader
from rollout.types import Group, Prompt, Trajectory


def group(pid: str, tokens: int = 3, epoch: int = 0, metadata: dict | None = None) -> Group:
    t = Trajectory(prompt_id=pid, prompt_token_ids=[5], token_ids=[9] * tokens, logprobs=[-0.5] * tokens,
                   policy_epochs=[(0, epoch)])  # fmt: skip
    return Group(prompt_id=pid, prompt=Prompt(id=pid, token_ids=[5], metadata=metadata or {}), trajectories=[t])


def write_log(directory: Path, count: int) -> list[Group]:
    """A closed log in `directory` holding `count` groups, g0 to g{count-1}."""
    d = DurableLog(directory)
    d.open()
    groups = [group(f"g{i}") for i in range(count)]
    for g in groups:
        d.append(g)
    d.close()
    return groups


def offsets(path: Path) -> list[int]:
    """Where each record of a readable log starts (the first is the epoch written by the last open)."""
    with open(path, "rb") as f:
        return [offset for offset, _, _ in LogReader(f, path)]


def read_only(directory: Path):
    """Make `directory` refuse new entries; skips where this cannot be done honestly. Returns an undo."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return lambda: directory.chmod(0o755)
    # root ignores a 0o555 mode; the immutable attribute (ext4, CAP_LINUX_IMMUTABLE) stops root too
    if subprocess.run(["chattr", "+i", str(directory)], capture_output=True, check=False).returncode != 0:
        pytest.skip("running as root without `chattr +i`: no honest way to make a directory read-only")
    return lambda: subprocess.run(["chattr", "-i", str(directory)], check=True)


def fill_the_disk(d: DurableLog) -> None:
    """From now on the log's writes go to /dev/full, which refuses every write with ENOSPC, as a full disk does."""
    real, d._file = d._file, open("/dev/full", "wb", buffering=0)  # noqa: SIM115 - the log closes it
    real.close()
