"""`rollout serve --api-servers 2` for real: the CLI in a session of its own, a real CPU engine in a
Ray actor, two front-end processes on one port, the real `openai` client. A conversation's turns
continue one session on one engine whichever process took them, an episode served over them is
rewarded, and a SIGTERM to the process group leaves no process behind (front ends included)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx
import openai

from tests.integration.conftest import ROOT
from tests.integration.test_shutdown import alive, descendants, wait_gone


def test_two_front_end_processes_serve_one_engine_and_unwind_on_sigterm():
    args = ["engines.count=1", "sampling.max_tokens=8", "logging.level=warning", "ray.num_cpus=4"]
    proc = subprocess.Popen([sys.executable, "-m", "rollout.cli", "serve", "configs/tiny.yaml", "--port", "0", "--api-servers", "2",
                             *sum((["-o", o] for o in args), [])],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    pids: set[int] = set()
    try:
        match = None
        for line in proc.stdout:  # Ray's actor logs, then "rollout: serving MODEL at URL/v1"; EOF when it failed
            if match := re.match(r"rollout: serving (\S+) at (\S+)", line):
                break
        assert match, f"no URL: {proc.stderr.read()[-3000:]}"
        model, url = match.groups()
        pids = descendants(proc.pid) | {proc.pid}
        front_ends = [p for p in pids if _cmdline(p).endswith("-m rollout.serve")]
        assert len(front_ends) == 2, [_cmdline(p) for p in pids]

        messages, turns = [{"role": "user", "content": "hello " * 60}], []  # a prefix over a KV block
        for k in range(3):  # a new connection each turn: either process may take it
            with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300) as client:
                r = client.chat.completions.create(model=model, messages=messages, max_tokens=4, extra_body={"episode_id": "e1"})
            m = r.choices[0].message.model_dump()
            turns.append(m)
            messages = [*messages, m, {"role": "user", "content": f"and {k}"}]
        for a, b in zip(turns, turns[1:]):
            before = a["prompt_token_ids"] + a["generation_token_ids"]
            assert b["prompt_token_ids"][: len(before)] == before and b["rollout"]["kv_reused"] > 0
        reward = httpx.post(f"{url.removesuffix('/v1')}/v1/episodes/e1/reward", json={"reward": 1.0}, timeout=60)
        assert reward.status_code == 200 and reward.json()["turns"] == 3, reward.text

        pids = descendants(proc.pid) | {proc.pid}
        os.killpg(os.getpgid(proc.pid), signal.SIGTERM)
        proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
            proc.wait()
        for pid in alive(pids):
            os.kill(pid, signal.SIGKILL)
    assert not wait_gone(pids), f"processes outlived the server: {[_cmdline(p) for p in alive(pids)]}"


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""
