"""Things that need their own driver process: the CLI (joining an existing cluster too), clean exit."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.support.engines import ROOT, engine_processes, shm_segments

SMALL = [
    "engines.count=1",
    "prompts.count=6",
    "sampling.max_tokens=8",
    "bench.warmup_prompts=2",
    "bench.repeats=2",
    "logging.level=warning",
]


def rollout_cli(command: str, *args: str, overrides: list[str], **kwargs) -> subprocess.Popen:
    """`rollout <command> configs/tiny.yaml <args> -o <override> ...` in the repository root, pipes on."""
    return subprocess.Popen(
        [sys.executable, "-m", "rollout.cli", command, "configs/tiny.yaml", *args,
         *sum((["-o", o] for o in overrides), [])],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs,
    )  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_gone(pids: set[int], timeout: float = 60) -> set[int]:
    deadline = time.monotonic() + timeout
    left = pids
    while left and time.monotonic() < deadline:
        left = pids & engine_processes()
        if left:
            time.sleep(0.5)  # polling the OS process table; nothing to wait on
    return left


def _wait_listening(port: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)  # polling a port; nothing to wait on
    raise TimeoutError(f"no Ray head listening on port {port}")


@contextlib.contextmanager
def ray_head() -> Iterator[tuple[int, str]]:
    """A Ray head of the test's own (no token), as a cluster a driver joins: its port and temp dir.
    In its own process group: `ray stop` would kill every Ray process on the machine, this test
    session's own cluster included."""
    port = _free_port()
    ray_bin = Path(sys.executable).parent / "ray"  # the venv's, which need not be on PATH
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths must fit
    head = subprocess.Popen(
        [
            str(ray_bin) if ray_bin.exists() else "ray",
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    try:
        _wait_listening(port)
        yield port, temp_dir
    finally:
        _kill_head(head, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _head_processes(pgid: int, temp_dir: str) -> set[int]:
    """The test's own Ray head: its process group, and whatever names its temp dir."""
    out = subprocess.run(["ps", "-eo", "pid=,pgid=,args="], capture_output=True, text=True, check=True).stdout
    pids = set()
    for line in out.splitlines():
        pid, group, args = (line.strip().split(None, 2) + [""])[:3]
        if int(group) == pgid or temp_dir in args:
            pids.add(int(pid))
    return pids


def _kill_head(head: subprocess.Popen, temp_dir: str) -> None:
    """SIGKILL the test's own head and all it started, then wait until none of it is left (its
    graceful stop on SIGTERM took ~30 s; nothing of the head is under test here)."""
    os.killpg(head.pid, signal.SIGKILL)
    head.wait(timeout=30)
    deadline = time.monotonic() + 60
    while (left := _head_processes(head.pid, temp_dir)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)  # polling the OS process table; nothing to wait on
    assert not left, f"the test's Ray head left processes: {left}"


def test_cli_run_writes_trajectories_and_leaves_nothing_behind(tmp_path):
    before_pids, before_shm = engine_processes(), shm_segments()
    out = tmp_path / "t.jsonl"
    # A KV cache too small for every request at full length, with preemption avoided: the engine
    # warns that it caps running requests, and that warning, logged inside the engine actor, must
    # reach the driver's stderr at the default log levels.
    small_kv = ["engines.preemption=avoid", "engines.vllm={kv_cache_gib: 0.01}"]
    proc = rollout_cli("run", "--out", str(out), "--no-progress", overrides=SMALL + small_kv)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert "KV cache holds fewer full-length requests" in stderr, stderr[-3000:]
    lines = out.read_text().splitlines()
    assert len(lines) == 6 * 4 and "wrote 24 trajectories" in stdout
    t = json.loads(lines[0])
    assert len(t["token_ids"]) == len(t["logprobs"]) >= 1 and t["policy_epochs"] == [[0, 0]]
    assert not _wait_gone(engine_processes() - before_pids), "engine or Ray processes outlived the driver"
    assert shm_segments() <= before_shm, f"leaked /dev/shm segments: {shm_segments() - before_shm}"


def test_cli_bench_joins_a_running_cluster_and_prints_ratio_against_raw_vllm(tmp_path):
    """`rollout bench` with `ray.address`: the driver joins the running head (its core-worker log
    lands in the head's session), not a cluster of its own, and reports both sides' figures."""
    report = tmp_path / "r.json"
    with ray_head() as (port, temp_dir):
        proc = rollout_cli(
            "bench", "--report", str(report), "--no-progress", overrides=[*SMALL, f"ray.address=127.0.0.1:{port}"],
            env={**os.environ, "RAY_AUTH_MODE": "disabled"},
        )  # fmt: skip
        stdout, stderr = proc.communicate(timeout=600)
        joined = list(Path(temp_dir).glob(f"session_*/logs/python-core-driver-*_{proc.pid}.log"))
    assert proc.returncode == 0, stderr[-3000:]
    assert joined, "the driver must join the running head, not start its own"
    assert "generated tokens/s" in stdout and "raw vLLM" in stdout
    data = json.loads(report.read_text())
    assert data["engine"]["trajectories"] == 24 and data["raw_vllm"]["trajectories"] == 24
    assert data["ratio_tokens_per_s"] > 0 and [r["order"] for r in data["rounds"]] == ["engine first", "raw vLLM first"]
    assert data["ratio_tokens_per_s"] == sum(r["ratio"] for r in data["rounds"]) / 2  # median of two
    assert "this engine / raw vLLM, generated tokens/s: " in stdout


def test_cli_serve_with_two_front_ends_answers_one_conversation_and_stops_cleanly_on_sigterm():
    """`rollout serve --api-servers 2`: two front-end processes on one port over a real engine. Turns
    of a conversation (a new connection each: either process may take it) keep their session and
    KV, the episode is rewarded, and a SIGTERM to the driver alone takes everything down (the front
    ends see the pipe the driver held end)."""
    import httpx
    import openai

    before_pids, before_shm = engine_processes(), shm_segments()
    proc = rollout_cli("serve", "--port", "0", "--api-key", "k", "--api-servers", "2", overrides=SMALL)
    front_ends: set[int] = set()
    try:
        while (line := proc.stdout.readline()) and "serving" not in line:
            pass
        assert "serving" in line, proc.stderr.read()[-3000:] if proc.poll() is not None else line
        url = line.split(" at ")[1].strip()
        front_ends = {p for p in _children(proc.pid) if _cmdline(p).endswith("-m rollout.serve")}
        assert len(front_ends) == 2, [_cmdline(p) for p in _children(proc.pid)]
        messages, turns = [{"role": "user", "content": "hello " * 60}], []  # a prefix over a KV block
        for k in range(3):
            with openai.OpenAI(base_url=url, api_key="k", max_retries=0, timeout=300) as client:
                r = client.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=4, extra_body={"episode_id": "e1"}
                )
            m = r.choices[0].message.model_dump()
            turns.append(m)
            messages = [*messages, m, {"role": "user", "content": f"and {k}"}]
        assert [len(t["generation_token_ids"]) for t in turns] == [4, 4, 4]
        for a, b in zip(turns, turns[1:]):
            before = a["prompt_token_ids"] + a["generation_token_ids"]
            assert b["prompt_token_ids"][: len(before)] == before and b["rollout"]["kv_reused"] > 0
        reward = httpx.post(
            url.removesuffix("/v1") + "/v1/episodes/e1/reward",
            json={"reward": 1.0},
            headers={"Authorization": "Bearer k"},
        )
        assert reward.status_code == 200 and reward.json()["turns"] == 3, reward.text
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert not _wait_gone(engine_processes() - before_pids), "engine or Ray processes outlived the server"
    deadline = time.monotonic() + 60
    while (left := {p for p in front_ends if _running(p)}) and time.monotonic() < deadline:
        time.sleep(0.5)  # polling the OS process table; nothing to wait on
    assert not left, f"front-end processes outlived the server: {left}"
    assert shm_segments() <= before_shm


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def _running(pid: int) -> bool:
    """Not exited (a zombie nobody has reaped yet has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""
