"""A driver that is stopped: SIGINT (Ctrl-C) leaves nothing behind, SIGTERM neither mid start-up;
after SIGKILL, the next start (the suite's shared pool of the default kind, started there) removes
what it left (Ray processes, /dev/shm segments) and a new run on the same `queue.durable_dir`
hands out exactly the groups that were finished but not taken. Two engines one after the other in
one process each start and leave nothing (the SIGINT driver's engine is its second: its first ran
an update and a group to the end). A SIGTERM to a running driver's whole process group is
`tests/integration/test_robust.py`'s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import anyio

from policies.shm import descendants, mapped
from rollout.handout.durable import LOG_NAME
from rollout.handout.durable_format import AckRecord, GroupRecord, LogReader
from tests.support.drivers import start_python
from tests.support.engines import engine_processes, integration_config, leaked_shm, shm_segments
from tests.support.processes import alive, kill_orphans, wait_gone

DRIVER = """
import json, os, sys, anyio
from safetensors.torch import load_file
from policies.shm import descendants
from rollout import RolloutEngine, Prompt
from tests.support.engines import integration_config

TAKE = 3
FIRST = sys.argv[1:2] == ["--after-a-first-run"]
async def main():
    finished = []
    cfg = integration_config("engines.count=1", "sampling.n=2", *sys.argv[1 + FIRST:])
    if FIRST:  # an engine run to the end, still referenced while the second one starts
        async with RolloutEngine(cfg) as first:
            assert await first.update_weights(load_file(f"{first.model_path}/model.safetensors")) == 1
            first.feed([Prompt(token_ids=[5] * 8, id="first")])
            groups = [g async for g in first.groups()]
            assert len(groups) == 1 and groups[0].ok, groups
            print(json.dumps({"first": sorted(descendants(os.getpid()))}), flush=True)
    async with RolloutEngine(cfg, on_trajectory=finished.append) as engine:
        engine.feed(Prompt(token_ids=[5 + i % 200] * 8, id=f"q{i}") for i in range(100000))
        taken = [(await engine.next_group()).prompt_id for _ in range(TAKE)]
        await engine.commit()  # the learner is done with them (else the last would come back)
        while len(finished) < 2 * (TAKE + 3):  # at least 3 more groups finished and not taken
            await anyio.sleep(0.05)
        print(json.dumps({"taken": taken}), flush=True)
        await anyio.sleep_forever()

try:
    anyio.run(main)
except KeyboardInterrupt:  # as the rollout command does: CPython's own exit by SIGINT is not
    sys.exit(130)          # reliable once Ray and vLLM have registered their exit handlers
"""


def start_driver(*overrides: str) -> subprocess.Popen:
    return start_python(DRIVER, *overrides)


def report_line(proc: subprocess.Popen, first: list[int] | None = None) -> str:
    """The driver's JSON line of taken groups (or whatever it printed last before exiting): Ray
    forwards the engines' log lines (vLLM's warnings) to the same stdout, before it or after. The
    processes its first engine ran in, where it ran one, go to `first`."""
    while (line := proc.stdout.readline()) and not (line.startswith("{") and "taken" in line):
        if line.startswith('{"first"') and first is not None:
            first.extend(json.loads(line)["first"])
    return line


def test_a_driver_stopped_by_ctrl_c_leaves_no_process_or_shm():
    sig = signal.SIGINT
    before_shm = shm_segments()
    first: list[int] = []
    proc = start_driver("--after-a-first-run", "queue.max_groups=8")
    _, errors = watch(proc.stderr, "")  # read in a thread: what came before the signal is told apart
    try:
        line = report_line(proc, first)
        assert line.startswith("{"), "".join(errors)[-3000:] if proc.poll() is not None else line
        started = descendants(proc.pid) & engine_processes()
        assert len(started) >= 3, "the driver should have a Ray cluster and an engine by now"
        assert first, "the first engine ran to the end"
        before_signal = "".join(errors)
        watch(proc.stdout, "")  # drained from here on: a full pipe would stall the driver's exit
        os.kill(proc.pid, sig)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    err = "".join(errors)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert "Can't find actor" not in err and "Traceback" not in before_signal, err[-3000:]
    assert not wait_gone(started | set(first)), "engine or Ray processes outlived the driver"
    assert not leaked_shm(before_shm), f"leaked /dev/shm segments: {leaked_shm(before_shm)}"


async def test_after_sigkill_the_next_start_removes_what_was_left_and_hands_out_exactly_the_untaken_groups(
    tmp_path, capsys, pools
):
    durable = tmp_path / "log"
    before_shm = shm_segments()
    proc = start_driver(f"queue.durable_dir={durable}", "queue.max_groups=16")
    orphans: set[int] = set()
    leaked: set[str] = set()
    try:
        line = await anyio.to_thread.run_sync(report_line, proc)
        assert line.startswith("{"), proc.stderr.read()[-3000:] if proc.poll() is not None else line
        taken = json.loads(line)["taken"]
        orphans = descendants(proc.pid)
        proc.kill()  # SIGKILL: no clean-up of any kind
        proc.wait(timeout=30)
        left = alive(orphans)
        leaked = leaked_shm(before_shm) | {n for n in mapped(left) if n.startswith(("psm_", "sem.mp-"))}
        assert left or leaked, "a SIGKILLed driver left nothing: this test would prove nothing"
        with open(durable / LOG_NAME, "rb") as f:
            records = [record for _, _, record in LogReader(f, durable / LOG_NAME)]
        groups = {r.id: r.group for r in records if isinstance(r, GroupRecord)}
        acked = {i for r in records if isinstance(r, AckRecord) for i in r.ids}
        untaken = [g.prompt_id for rid, g in groups.items() if rid not in acked]
        assert sorted(g.prompt_id for rid, g in groups.items() if rid in acked) == sorted(taken)
        assert len(untaken) >= 3 and not set(untaken) & set(taken)
        with open(durable / LOG_NAME, "ab") as f:
            f.write(b"\x40\x00\x00\x00\x12\x34")  # a record torn by the power cut, mid-header

        # The next start is the shared pool of the default kind, started here (`fresh`): the
        # durable queue is the driver's own, and the tests after this one use the pool on.
        async with pools.engine(integration_config(f"queue.durable_dir={durable}"), fresh=True) as engine:
            # The start removed what the killed run left: its Ray processes, its engine's segments.
            assert not alive(left), f"a killed run's processes outlived the next start: {alive(left)}"
            assert not leaked & shm_segments(), (
                f"a killed run's /dev/shm segments outlived the next start: {leaked & shm_segments()}"
            )
            again = [g async for g in engine.groups()]
    finally:
        proc.kill()
        kill_orphans(orphans)
        for name in leaked_shm(before_shm):
            os.unlink(f"/dev/shm/{name}")
    logged = capsys.readouterr()
    assert "removed what a killed run left" in logged.out + logged.err
    assert [g.prompt_id for g in again] == untaken  # exactly those, in the order they finished
    assert all(g.ok and len(g.trajectories) == 2 and all(t.token_ids for t in g.trajectories) for g in again)


def watch(stream, marker: str) -> tuple[threading.Event, list[str]]:
    """Read `stream` line by line in a thread (a full pipe would stall the driver); the event is set
    once a line holds `marker`."""
    seen, lines = threading.Event(), []

    def read() -> None:
        for line in stream:
            lines.append(line)
            if marker in line:
                seen.set()
        seen.set()  # the stream ended: whoever waits looks at the process

    threading.Thread(target=read, daemon=True).start()
    return seen, lines


STARTING = """
import anyio
from rollout import RolloutEngine
from tests.support.engines import integration_config

async def main():
    async with RolloutEngine(integration_config("engines.count=1", "logging.level=info")):
        print("ENGINE UP", flush=True)  # the test signals the driver before this

anyio.run(main)
"""


def test_sigterm_during_start_up_exits_143_and_leaves_nothing():
    before_shm = shm_segments()
    proc = start_python(STARTING)
    started: set[int] = set()
    try:
        starting, err = watch(proc.stderr, "engines starting")
        assert starting.wait(300) and proc.poll() is None, "".join(err)[-3000:]
        deadline = time.monotonic() + 300
        while not any("EngineCore" in _args(p) for p in descendants(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)  # polling the OS process table for the engine core; nothing to wait on
        started = descendants(proc.pid)
        assert proc.poll() is None and any("EngineCore" in _args(p) for p in started), "".join(err)[-3000:]
        os.kill(proc.pid, signal.SIGTERM)
        out = proc.stdout.read()
        proc.wait(timeout=180)
    finally:
        proc.kill()
        if proc.poll() is None or proc.returncode != 128 + signal.SIGTERM:
            kill_orphans(started)
    assert "ENGINE UP" not in out
    assert proc.returncode == 128 + signal.SIGTERM, "".join(err)[-3000:]
    assert not wait_gone(started), f"engine or Ray processes outlived the driver: {alive(started)}"
    assert not leaked_shm(before_shm), f"leaked /dev/shm segments: {leaked_shm(before_shm)}"


def _args(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""
