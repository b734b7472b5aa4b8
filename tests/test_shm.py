"""What a killed engine process leaves in /dev/shm is swept, and nothing anyone still uses."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from policies.shm import SHM, alive, snapshot, staging_dir, sweep, sweep_when_gone

pytestmark = pytest.mark.skipif(
    not SHM.is_dir() or not Path("/proc/self/maps").exists(), reason="needs /dev/shm and /proc"
)

CHILD = """
import mmap, sys, time
from policies.shm import staging_dir
with open(sys.argv[1], "w+b") as f:
    f.truncate(4096)
    m = mmap.mmap(f.fileno(), 4096)
print(staging_dir(7), flush=True)
time.sleep(600)
"""


@pytest.fixture
def segment():
    paths: list[Path] = []

    def make() -> Path:
        paths.append(SHM / f"psm_test{uuid.uuid4().hex[:8]}")
        return paths[-1]

    yield make
    for p in paths:
        p.unlink(missing_ok=True)


def start_child(segment: Path) -> tuple[subprocess.Popen, Path]:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(segment)], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).parent.parent)  # fmt: skip
    staged = Path(child.stdout.readline().strip())
    (staged / "model.safetensors").write_bytes(b"x" * 100)
    return child, staged


async def test_a_killed_process_s_segments_and_staged_weights_are_swept(segment):
    seg = segment()
    child, staged = start_child(seg)
    snap = snapshot(child.pid)
    assert seg.name in snap.names and child.pid in snap.pids
    assert sweep(snap) == [] and seg.exists() and staged.exists(), "nothing goes while its process runs"

    os.kill(child.pid, signal.SIGKILL)
    while os.path.exists(f"/proc/{child.pid}") and alive(child.pid):
        time.sleep(0.01)
    assert not alive(child.pid), "a zombie (killed, not yet reaped) has let go of its memory"
    removed = await sweep_when_gone(snap, timeout=5)
    child.wait()
    assert set(removed) == {seg.name, staged.name}
    assert not seg.exists() and not staged.exists()


async def test_a_segment_another_process_maps_stays(segment):
    seg, shared = segment(), segment()
    child, staged = start_child(seg)
    snap = snapshot(child.pid)
    with open(shared, "w+b") as f:  # this test's process maps `shared`; pretend the child did too
        f.truncate(4096)
        held = mmap.mmap(f.fileno(), 4096)
    snap.names.add(shared.name)
    child.kill()
    child.wait()
    assert set(await sweep_when_gone(snap, timeout=5)) == {seg.name, staged.name}
    assert shared.exists()
    held.close()


def test_a_semaphore_is_found_under_its_name():
    # glibc creates a named semaphore under a temporary name and renames it: the process maps
    # "sem.XXXXXX (deleted)", the file is "sem.mp-...". The snapshot must name the file.
    code = (
        "import multiprocessing as mp, time; lock = mp.get_context('spawn').Lock(); "
        "print(lock._semlock.name, flush=True); time.sleep(600)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        name = "sem." + child.stdout.readline().strip().lstrip("/")
        assert (SHM / name).exists()
        assert name in snapshot(child.pid).names
    finally:
        child.kill()
        child.wait()


def test_staged_weights_of_a_live_process_stay():
    d = Path(staging_dir(3))
    try:
        assert str(os.getpid()) in d.name
        assert sweep(snapshot()) == [] and d.exists()
    finally:
        d.rmdir()
