"""Start-up and stop, for real: a local cluster reachable from this machine's loopback only and by
token, a SIGTERM to the whole process group (what `timeout`, systemd and Slurm send) that unwinds
cleanly, start-up failures that say why at once (each runs `rollout run` in a process of its own);
and the fuzz tier's generated prompts through the real engines."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import sys
import time

import anyio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.shm import descendants
from rollout.errors import InvalidPromptError
from tests.support.engines import ROOT, leaked_shm, shm_segments
from tests.support.processes import alive, wait_gone
from tests.support.strategies import PROMPTS

SMALL = ["engines.count=1", "sampling.n=2", "sampling.max_tokens=8", "logging.level=warning", "ray.num_cpus=4"]


def rollout_run(out, *overrides: str, **kwargs) -> subprocess.Popen:
    """`rollout run` in a session of its own (its own process group, as under `timeout` or Slurm)."""
    return subprocess.Popen(
        [sys.executable, "-m", "rollout.cli", "run", "configs/tiny.yaml", "--out", str(out), "--no-progress",
         *sum((["-o", o] for o in (*SMALL, *overrides)), [])],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs,
    )  # fmt: skip


def listeners(pids: set[int]) -> list[tuple[str, str, int]]:
    """(process name, local address, pid) of every listening TCP socket of `pids`."""
    out = []
    for line in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines():
        fields = line.split()
        for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', line):
            if int(pid) in pids:
                out.append((name, fields[3], int(pid)))
    return out


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host.startswith("::ffff:"):
        host = host[len("::ffff:") :]
    return host not in ("*", "0.0.0.0", "::") and ipaddress.ip_address(host).is_loopback


def join(port: int, **env_vars: str) -> subprocess.CompletedProcess:
    """A driver joining the cluster at loopback `port`, with `env_vars` saying which token it shows."""
    code = f"import ray; ray.init(address='127.0.0.1:{port}'); print('joined', flush=True); ray.shutdown()"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_NUM_REDIS_GET_RETRIES="5", **env_vars
    )  # keep 127.0.0.1 as given
    try:
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd="/"
        )
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(e.cmd, -9, e.stdout or "", e.stderr or "")


def test_a_local_cluster_listens_on_loopback_takes_no_stranger_and_a_group_sigterm_unwinds(tmp_path):
    before_shm = shm_segments()
    out = tmp_path / "t.jsonl"
    proc = rollout_run(out, "prompts.count=100000")
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 420
        while (
            not (out.exists() and out.read_text().count("\n") >= 2)
            and proc.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.5)  # polling a file another process writes; nothing to wait on
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert out.read_text().count("\n") >= 2, "the run wrote nothing within 7 minutes"
        pids = descendants(proc.pid) | {proc.pid}

        # 1) Every socket the driver's processes listen on is on loopback.
        socks = listeners(pids)
        names = {name for name, _, _ in socks}
        assert {"gcs_server", "raylet"} <= names, socks  # the check saw Ray's servers
        assert not [s for s in socks if not is_loopback(s[1])], f"listening beyond loopback: {socks}"

        # 2) Token authentication is on: a driver showing no token, or a wrong one, cannot join; with the token it can.
        gcs = next(int(addr.rsplit(":", 1)[1]) for name, addr, _ in socks if name == "gcs_server")
        assert "joined" not in join(gcs, RAY_AUTH_MODE="disabled", HOME=str(tmp_path)).stdout, (
            "a driver without a token joined"
        )
        assert "joined" not in join(gcs, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 32).stdout, "a wrong token joined"
        assert "joined" in join(gcs, RAY_AUTH_MODE="token").stdout, (
            "the token (~/.ray/auth_token) should let a driver join"
        )

        # 3) SIGTERM to the whole process group: the driver stops the engines, then exits 128+15.
        pids = descendants(proc.pid) | {proc.pid}
        os.killpg(os.getpgid(proc.pid), signal.SIGTERM)
        _, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
            proc.wait()
        for pid in alive(pids):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    written = int(re.search(r"rollout: (\d+) trajectories were written to", stderr).group(1))
    assert written == len(out.read_text().splitlines()) >= 2
    assert not wait_gone(pids), f"processes outlived the driver: {alive(pids)}"
    assert not leaked_shm(before_shm), f"leaked /dev/shm segments: {leaked_shm(before_shm)}"


def test_an_engine_that_cannot_start_says_why_in_one_line_and_leaves_nothing(tmp_path):
    before_shm = shm_segments()
    proc = rollout_run(tmp_path / "t.jsonl", "prompts.count=4", "engines.vllm={kv_cache_gib: 0.0001}")
    try:
        _, stderr = proc.communicate(timeout=600)
        pids = descendants(proc.pid)
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    line = next((x for x in stderr.splitlines() if x.startswith("rollout: EngineDeadError:")), stderr[-3000:])
    assert re.match(r"rollout: EngineDeadError: engine 0 failed to start: \w+Error: \S", line), line
    assert "Engine core initialization failed" not in line and "cache" in line, (
        line
    )  # vLLM's cause, not its pointer to it
    assert not wait_gone(pids)
    assert not leaked_shm(before_shm), f"leaked /dev/shm segments: {leaked_shm(before_shm)}"


def test_missing_gpus_and_an_address_where_nothing_answers_fail_at_once(tmp_path):
    t0 = time.monotonic()
    proc = rollout_run(tmp_path / "t.jsonl", "engines.gpus_per_engine=1")
    _, stderr = proc.communicate(timeout=300)
    assert (
        proc.returncode == 2
        and "engines.count=1 x engines.gpus_per_engine=1.0 need 1 GPU, the Ray cluster has 0" in stderr
    ), stderr[-3000:]
    assert time.monotonic() - t0 < 120, "should fail once Ray is up, not after engines.start_timeout_s"

    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    proc = rollout_run(tmp_path / "t.jsonl", f"ray.address=127.0.0.1:{port}")
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2 and f"ray.address: no Ray cluster answers at 127.0.0.1:{port}" in stderr, stderr[-3000:]
    assert time.monotonic() - t0 < 60


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(prompts=st.lists(PROMPTS, min_size=1, max_size=4))
async def test_generated_prompts_through_the_real_engines(engine, prompts):
    """The fuzz tier's prompts (tests/test_fuzz.py) through real Ray actors and vLLM: each list is
    refused at feed (InvalidPromptError) or served; lazily fed, every prompt comes back, in time."""
    with anyio.fail_after(120):
        try:
            engine.feed(prompts)
            accepted = True
        except InvalidPromptError:
            accepted = False
        if accepted:
            groups = [g async for g in engine.groups()]
            assert len(groups) == len(prompts)
            for g in groups:  # an accepted prompt fails in the engine only as documented
                assert g.ok or all("exceed max_model_len" in (t.error or "") for t in g.trajectories if not t.ok), g
        engine.feed(iter(prompts))
        groups = [g async for g in engine.groups()]
    assert len(groups) == len(prompts)
    assert accepted or not all(g.ok for g in groups), "refused by feed(list), all served from an iterator"
