"""SIGTERM and SIGINT of a driver unwind through `RolloutEngine.__aexit__` (fake engines, own process),
whether the signal finds the driver waiting or running code on its loop."""

from __future__ import annotations

import os
import signal

import pytest

from tests.support.drivers import start_python

DRIVER = """
import os, sys, anyio, msgspec
from rollout.config import load_config
from rollout.engine import RolloutEngine
from tests.support.fakes import FakePool

class Pool(FakePool):
    async def shutdown(self):
        await anyio.sleep(0.2)  # a shutdown that takes a while must still complete
        print("pool shut down", flush=True)

SIG = int(sys.argv[3])  # 0: the test signals a waiting driver; else the signal comes as a sample is counted

def counted(traj):  # the learner's `on_trajectory`, on the loop: `os.kill` runs the Python handler here
    os.kill(os.getpid(), SIG)

async def main():
    cfg = load_config(None, ["sampling.max_tokens=4", "logging.level=error", "model.path=" + sys.argv[1]])
    async with RolloutEngine(cfg, pool=Pool(1), on_trajectory=counted if SIG else None) as engine:
        if not SIG:
            gate = engine.pool.engines[0].block()  # requests hang: the driver is mid-rollout
        engine.feed([[5, 6, 7]])
        print("running", flush=True)
        await engine.next_group()
        await anyio.sleep_forever()

def sync_main():
    from rollout.sync_engine import SyncRolloutEngine
    cfg = load_config(None, ["sampling.max_tokens=4", "logging.level=error", "model.path=" + sys.argv[1]])
    with SyncRolloutEngine(cfg, pool=Pool(1), on_trajectory=counted if SIG else None) as engine:
        if not SIG:
            engine._engine.pool.engines[0].block()
        engine.feed([[5, 6, 7]])
        print("running", flush=True)
        list(engine.groups())

sync_main() if sys.argv[2] == "sync" else anyio.run(main)
"""


@pytest.mark.parametrize("api", ["async", "sync"])
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 128 + 15), (signal.SIGINT, -signal.SIGINT)])
def test_signal_shuts_the_engines_down(tmp_path, sig, code, api):
    (tmp_path / "config.json").write_text('{"vocab_size": 260}')
    proc = start_python(DRIVER, str(tmp_path), api, "0")
    try:
        assert proc.stdout.readline().strip() == "running"
        os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "pool shut down" in out, err[-2000:]
    assert proc.returncode == code, err[-2000:]  # SIGINT: Python re-raises it after KeyboardInterrupt unwinds


@pytest.mark.parametrize("api", ["async", "sync"])
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 128 + 15), (signal.SIGINT, -signal.SIGINT)])
def test_a_signal_that_lands_in_code_on_the_loop_still_shuts_the_engines_down(tmp_path, sig, code, api):
    """A busy driver is mostly running code when a signal comes, not waiting. A SystemExit raised
    there by the handler was taken for that code's own (`passes_through`): a group failed with it as
    the reason, the signal was lost, and a second SIGTERM was ignored, so the driver never stopped."""
    (tmp_path / "config.json").write_text('{"vocab_size": 260}')
    proc = start_python(DRIVER, str(tmp_path), api, str(int(sig)))
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "pool shut down" in out, err[-2000:]
    assert proc.returncode == code, err[-2000:]


SERVER = """
import os, sys, anyio, httpx
from rollout.config import load_config
from rollout.engine import RolloutEngine
from tests.support.fakes import FakePool

class Pool(FakePool):
    async def shutdown(self):
        print("pool shut down", flush=True)

async def main():
    cfg = load_config(None, ["model.path=tiny", "logging.level=error"])
    async with RolloutEngine(cfg, pool=Pool(1)) as engine:
        server = await engine.serve(port=0)

        async def signalled():  # runs in the HTTP server's request task, as its handlers do
            os.kill(os.getpid(), int(sys.argv[1]))
            return {}

        server.app.add_api_route("/signalled", signalled)
        async with httpx.AsyncClient() as client:
            print("answered", (await client.get(server.url + "/signalled")).status_code, flush=True)
        await anyio.sleep_forever()

anyio.run(main)
"""


def test_a_sigterm_that_lands_in_the_http_server_s_code_still_shuts_the_engines_down():
    """A busy `rollout serve` runs request handlers most of the time; a SystemExit raised in one
    was the ASGI server's to catch: the request answered 500, the signal lost. (Ctrl-C is asyncio's
    runner's: it cancels the main task, whatever code runs.)"""
    proc = start_python(SERVER, str(int(signal.SIGTERM)))
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "pool shut down" in out, err[-2000:]
    assert "answered 500" not in out, out
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
