"""Start-up fails fast and says why: an address where no Ray cluster answers, resources the
cluster does not have, an engine whose vLLM engine core dies while starting. No cluster starts here."""

from __future__ import annotations

import os
import socket
import time
import uuid

import pytest
import ray

from actors.cluster import check_reachable, connect, missing_resources
from policies.shm import SHM
from policies.startup import cause_from_stderr, shm_names, start_failure
from rollout.config import load_config
from rollout.errors import InvalidConfigError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_where_nothing_answers_fails_within_seconds_naming_it(monkeypatch):
    # The integration tier's session engine may hold Ray open in this process; `connect` must
    # check the address as it would in a fresh driver.
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    address = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(InvalidConfigError, match=f"ray.address: no Ray cluster answers at {address}"):
        connect(load_config(None, [f"ray.address={address}"]))  # before: Ray retried for minutes
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("address", ["ray://127.0.0.1:{port}", "localhost:{port}"])
def test_other_address_forms_are_checked_too(address):
    address = address.format(port=free_port())
    with pytest.raises(InvalidConfigError, match="no Ray cluster answers"):
        check_reachable(address)


def test_a_malformed_address_names_the_key():
    with pytest.raises(InvalidConfigError, match="ray.address: expected 'auto', 'host:port'"):
        check_reachable("not an address")


def test_an_address_that_answers_passes():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_reachable(f"127.0.0.1:{server.getsockname()[1]}")


@pytest.mark.parametrize(
    "overrides, cluster, words",
    [
        (
            ["engines.gpus_per_engine=1"],
            {"CPU": 8.0},
            "engines.count=2 x engines.gpus_per_engine=1.0 need 2 GPU, the Ray cluster has 0",
        ),
        (
            ["engines.cpus_per_engine=3"],
            {"CPU": 4.0},
            "engines.count=2 x engines.cpus_per_engine=3 need 6 CPU, the Ray cluster has 4 (or ray.num_cpus",
        ),
        (
            ["engines.count=3", "engines.gpus_per_engine=0.5"],
            {"CPU": 8.0, "GPU": 1.0},
            "need 1.5 GPU, the Ray cluster has 1",
        ),
    ],
)
def test_resources_the_cluster_lacks_are_named_with_their_keys(overrides, cluster, words):
    assert words in missing_resources(load_config(None, overrides), cluster)


def test_resources_that_fit_pass():
    assert missing_resources(load_config(None, ["engines.gpus_per_engine=0.5"]), {"CPU": 2.0, "GPU": 1.0}) is None


VLLM_LOG = """\
INFO 11-23 22:40:01 [core.py:93] Initializing a V1 LLM engine (v0.32.0) with config: ...
ERROR 11-23 22:40:05 [core.py:1510] EngineCore failed to start.
Traceback (most recent call last):
  File "/venv/vllm/v1/engine/core.py", line 1500, in run_engine_core
    engine_core = EngineCoreProc(*args, **kwargs)
  File "/venv/vllm/v1/core/kv_cache_utils.py", line 700, in check_enough_kv_cache_memory
    raise ValueError(
ValueError: To serve at least one request with the models's max seq len (2048), (0.03 GiB KV cache is needed, \
which is larger than the available KV cache memory (0.0 GiB).
Process EngineCore_DP0:
Traceback (most recent call last):
ValueError: To serve at least one request with the models's max seq len (2048), (0.03 GiB KV cache is needed, \
which is larger than the available KV cache memory (0.0 GiB).
Traceback (most recent call last):
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore_DP0': 1}
"""


def test_the_cause_of_a_failed_start_is_the_engine_cores_last_exception(tmp_path):
    log = tmp_path / "worker.err"
    log.write_text(VLLM_LOG)
    assert cause_from_stderr(str(log)).startswith(
        "ValueError: To serve at least one request with the models's max seq len (2048)"
    )
    log.write_text("nothing but chatter\n")
    assert cause_from_stderr(str(log)) is None


def test_a_failed_start_removes_the_shared_memory_it_left_and_only_that():
    before = shm_names()
    mine = SHM / f"psm_rollout_test_{uuid.uuid4().hex[:8]}"
    mine.write_bytes(b"x")  # what a dead engine core's ring buffer looks like: nobody maps it
    try:
        message = start_failure(RuntimeError("Engine core initialization failed"), before, engine_id=3)
        assert not mine.exists()
        assert message.startswith("engine 3 failed to start: ")
        assert shm_names() >= before - {n for n in before if not (SHM / n).exists()}  # the others' names stay
    finally:
        if mine.exists():
            os.unlink(mine)


@pytest.mark.parametrize("before", ["a driver's handler", "the default"])
def test_the_driver_s_sigterm_handler_is_its_handler_after_ray_init(before):
    """`ray.init` replaces SIGTERM's handler (a Python one, then the core worker's C++ one that
    aborts); `_keep_sigterm` installs the driver's again, or Ray's Python one where the driver had none."""
    import signal

    from actors.cluster import _keep_sigterm

    def driver(signum, frame):
        raise SystemExit(128 + signum)

    def rays(signum, frame):
        raise SystemExit(signum)

    old = signal.signal(signal.SIGTERM, driver if before == "a driver's handler" else signal.SIG_DFL)
    try:
        with _keep_sigterm():
            signal.signal(signal.SIGTERM, rays)  # what ray.init does
        assert signal.getsignal(signal.SIGTERM) is (driver if before == "a driver's handler" else rays)
    finally:
        signal.signal(signal.SIGTERM, old)
