"""What a SIGKILLed driver left is removed by the next start, and nothing of a live run (no Ray,
no engine: stand-in processes holding a stand-in segment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from actors.leftovers import Record, reap, started
from policies.shm import SHM, alive

pytestmark = pytest.mark.skipif(
    not SHM.is_dir() or not Path("/proc/self/maps").exists(), reason="needs /dev/shm and /proc"
)

# A stand-in for an engine process: maps a segment, says so, and runs until ended.
HOLDER = """
import mmap, sys, time
with open(sys.argv[1], "w+b") as f:
    f.truncate(4096)
    m = mmap.mmap(f.fileno(), 4096)
print("holding", flush=True)
time.sleep(600)
"""


@pytest.fixture
def segment():
    path = SHM / f"psm_test{uuid.uuid4().hex[:8]}"
    yield path
    path.unlink(missing_ok=True)


def hold(segment: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(segment)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


def dead_pid() -> tuple[int, int]:
    """A driver that was killed: its pid and start time (it has exited and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    start = started(proc.pid)
    proc.kill()
    proc.wait()
    return proc.pid, start


def record_of(
    tmp_path: Path, driver: tuple[int, int | None], procs: list[int], names: list[str], pids: list[int]
) -> Path:
    path = tmp_path / f"{driver[0]}.json"
    body = {
        "pid": driver[0],
        "start": driver[1],
        "processes": [[p, started(p)] for p in procs],
        "engines": {"0": [names, pids]},
    }
    path.write_text(json.dumps(body))
    return path


def test_a_killed_driver_s_processes_and_segments_are_removed_with_a_log_line(tmp_path, segment):
    engine = hold(segment)
    path = record_of(tmp_path, dead_pid(), [engine.pid], [segment.name], [engine.pid])
    try:
        with capture_logs() as logged:
            removed = reap(tmp_path, grace_s=5)
    finally:
        engine.kill()
    engine.wait()
    assert not alive(engine.pid) and not segment.exists() and not path.exists()
    assert removed and str(engine.pid) in removed[0] and segment.name in removed[0]
    assert [e["event"] for e in logged] == ["removed what a killed run left"] and logged[0]["shm"] == [segment.name]


def test_a_live_driver_s_record_and_everything_in_it_stay(tmp_path, segment):
    engine = hold(segment)
    try:
        path = record_of(tmp_path, (os.getpid(), started(os.getpid())), [engine.pid], [segment.name], [engine.pid])
        assert reap(tmp_path, grace_s=5) == []
        assert alive(engine.pid) and segment.exists() and path.exists()
    finally:
        engine.kill()
        engine.wait()


def test_a_reused_pid_is_not_ended_and_a_mapped_segment_stays(tmp_path, segment):
    other = hold(segment)  # not the recorded process: same pid, another start time
    try:
        path = tmp_path / "r.json"
        body = {
            "pid": dead_pid()[0],
            "start": 1,
            "processes": [[other.pid, started(other.pid) - 1]],
            "engines": {"0": [[segment.name], [other.pid]]},
        }
        path.write_text(json.dumps(body))
        reap(tmp_path, grace_s=5)
        assert alive(other.pid) and segment.exists() and not path.exists()
    finally:
        other.kill()
        other.wait()


def test_a_record_is_written_as_the_run_goes_and_deleted_at_close(tmp_path):
    rec = Record(tmp_path)
    rec.cluster([os.getpid()])
    rec.engine(0, ["psm_x"], [os.getpid()], local_cluster=False)
    body = json.loads(rec.path.read_text())
    assert body["pid"] == os.getpid() and body["engines"] == {"0": [["psm_x"], [os.getpid()]]}
    assert Record(tmp_path).path != rec.path  # two pools in one process keep a record each
    rec.close()
    assert not list(tmp_path.iterdir())
