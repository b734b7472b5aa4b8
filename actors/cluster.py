"""The Ray cluster: joined (`ray.address`) or started locally, checked before any engine starts.

Owns: connecting (a local cluster bound to loopback with Ray's default token authentication, its
processes out of the driver's process group; an address where nothing answers fails within
seconds; the driver's SIGTERM handler kept through `ray.init`), and whether the cluster has the resources
the engines' placement group needs (else the placement group would wait for
`engines.start_timeout_s`). Does not own: the engines (`actors.pool`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import ray

from rollout.config import Config
from rollout.errors import InvalidConfigError


def connect(cfg: Config) -> bool:
    """Join `ray.address` or start a local cluster. Returns True if this call started Ray.

    A local cluster is this driver's alone: its processes listen on loopback only (`_loopback`),
    with Ray's own default for a new cluster, token authentication (a token in ~/.ray/auth_token,
    made on first use); nothing here switches it off. Joining a cluster leaves its security to
    it. An address where nothing answers fails within seconds, naming it (Ray would retry for
    minutes). Raises InvalidConfigError.
    """
    if ray.is_initialized():
        return False
    # What the engines print reaches the driver's stderr: their own log lines, and vLLM's and
    # torch's output only with `-v` or logging.level debug; otherwise that goes to the run's
    # engine logs before Ray sees it (`rollout.log.output_to_file`).
    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=True)
    if cfg.ray.address is None:
        kwargs["address"] = "local"  # a new cluster, even if another one runs on this machine
        need = cfg.engines.count * cfg.engines.cpus_per_engine
        kwargs["num_cpus"] = cfg.ray.num_cpus or max(os.cpu_count() or 1, need)
        if cfg.engines.gpus_per_engine == 0:
            kwargs["num_gpus"] = 0
        with _loopback(), _own_session(), _keep_sigterm():
            ray.init(**kwargs)
        return True
    check_reachable(cfg.ray.address)
    try:
        with _keep_sigterm():
            ray.init(address=cfg.ray.address, **kwargs)
    except Exception as e:
        raise InvalidConfigError(
            f"ray.address: cannot join the Ray cluster at {cfg.ray.address!r}: {type(e).__name__}: {e}"
        ) from e
    return True


@contextlib.contextmanager
def _loopback() -> Iterator[None]:
    """While a local cluster starts: its node address is 127.0.0.1, so every Ray process binds
    loopback (GCS, raylet, workers' gRPC servers, the runtime-env agent, the autoscaler's metrics).

    Ray turns a loopback `_node_ip_address` into the machine's address, unless clusters are off
    (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, Ray's switch for single-machine use on macOS and
    Windows): then the node address is loopback. Ray reads the switch once, at import, into
    `ray_constants.ENABLE_RAY_CLUSTER`, and the processes it starts read it from the environment;
    both are set here and restored after, so a later join of a real cluster is unaffected.
    """
    from ray._private import ray_constants

    old_env, old_flag = os.environ.get(_CLUSTER_SWITCH), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_CLUSTER_SWITCH], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old_flag
        if old_env is None:
            os.environ.pop(_CLUSTER_SWITCH, None)
        else:
            os.environ[_CLUSTER_SWITCH] = old_env


@contextlib.contextmanager
def _own_session() -> Iterator[None]:
    """While a local cluster starts: Ray's processes (GCS, raylet, log monitor, autoscaler monitor,
    and through the raylet the agents and workers) start in a session of their own.

    `timeout`, systemd and Slurm stop a job by signalling its whole process group: Ray's processes
    in the driver's group would die with the driver, before it could shut the engines down (their
    vLLM processes and shared memory left behind). Out of the group, only the driver gets the
    signal and stops them itself (`RolloutEngine.__aexit__`); Ray's fate-sharing still kills them
    if the driver dies without that. Ray starts them through `ray._private.services.ConsolePopen`
    (a `subprocess.Popen`); if that ever changes this fails, naming it, rather than start a cluster
    a group signal would tear apart.
    """
    from ray._private import services

    popen = getattr(services, "ConsolePopen", None)
    if not (isinstance(popen, type) and issubclass(popen, subprocess.Popen)):
        raise RuntimeError(f"ray {ray.__version__}: ray._private.services.ConsolePopen is no longer a Popen; "
                           "rollout cannot start Ray's processes out of the driver's process group")  # fmt: skip

    class OwnSession(popen):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any):
            kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnSession
    try:
        yield
    finally:
        services.ConsolePopen = popen


@contextlib.contextmanager
def _keep_sigterm() -> Iterator[None]:
    """Around `ray.init`: the SIGTERM handler the driver had before is its handler after.

    `ray.init` installs two of its own: a Python one (`sys.exit(15)`), and then, under it, the
    core worker's C++ failure-signal handler, which prints a stack and aborts the driver (SIGABRT,
    nothing shut down, the engines' processes and /dev/shm left). Python still reports its own
    handler after that, so installing it again is what puts it back in force. A driver whose
    handler was the default keeps Ray's Python one (Ray's atexit shutdown then runs), never the
    abort. Only the main thread can set handlers: elsewhere nothing changes.
    """
    main = threading.current_thread() is threading.main_thread()
    old = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main:
            keep = old if old not in (signal.SIG_DFL, None) else signal.getsignal(signal.SIGTERM)
            if keep is not None:
                signal.signal(signal.SIGTERM, keep)


_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
CONNECT_TIMEOUT_S = 5.0


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Something must answer at `ray.address` (`host:port`, `ray://host:port`; `auto` reads
    RAY_ADDRESS, else Ray looks up the latest cluster on this machine itself). Raises
    InvalidConfigError naming the address within `timeout` seconds."""
    target = os.environ.get("RAY_ADDRESS", "") if address == "auto" else address
    target = target.removeprefix("ray://")
    if not target or target in ("auto", "local"):
        return
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidConfigError(f"ray.address: expected 'auto', 'host:port' or 'ray://host:port', got {address!r}")
    host = host.strip("[]")
    hosts = [host]
    if host in ("localhost", "127.0.0.1", "::1"):  # Ray itself dials the machine's address instead
        from ray._private.services import resolve_ip_for_localhost

        hosts.append(resolve_ip_for_localhost(host))
    for h in hosts:
        try:
            socket.create_connection((h, int(port)), timeout=timeout).close()
            return
        except OSError as e:
            why = "no answer" if isinstance(e, TimeoutError) else (e.strerror or str(e))
    raise InvalidConfigError(f"ray.address: no Ray cluster answers at {target} ({why} within {timeout:g} s)")


def missing_resources(cfg: Config, cluster: dict[str, float]) -> str | None:
    """What the engines' placement group needs and the cluster does not have, in words naming the
    keys; None when it fits (in total: how bundles fit on nodes is left to Ray)."""
    e = cfg.engines
    need = {"CPU": e.count * e.cpus_per_engine, "GPU": e.count * e.gpus_per_engine}
    keys = {"CPU": "engines.cpus_per_engine", "GPU": "engines.gpus_per_engine"}
    for resource, amount in need.items():
        have = cluster.get(resource, 0.0)
        if amount > have:
            hint = " (or ray.num_cpus for a local cluster)" if resource == "CPU" else ""
            return (f"engines.count={e.count} x {keys[resource]}={getattr(e, keys[resource].split('.')[1])} "
                    f"need {amount:g} {resource}, the Ray cluster has {have:g}{hint}")  # fmt: skip
    return None
