"""Integration tier: the real vLLM engine on the embedded tiny model, inside real Ray actors.

Engines are started once per kind (`tests.support.engines.SharedPools`): `engine` is a module's
RolloutEngine over the shared pool of the default kind; `pools` gives a test an engine of any other
kind. Tests vary sampling per prompt through `Prompt.sampling` overrides instead of restarting
engines.
"""

from __future__ import annotations

import os

import pytest

from tests.support import starts
from tests.support.engines import SharedPools, held, integration_config, kind

RERUNS = int(os.environ.get("ROLLOUT_INTEGRATION_RERUNS", "0"))


# Files in the order they run: those that start (or kill) engines of their own first, while no
# shared pool holds memory; then the shared pools' users, grouped by pool, each pool started once.
# The default kind's pool is started by test_shutdown's SIGKILL test (a start is what it tests),
# then used by test_robust and on; the oracle runs' small-cache kind comes between its users
# (2 + 2 engines: both stay alive); test_episodes' keep run kills an engine for good, so it is last.
ORDER = [
    "test_chaos", "test_parsers", "test_spec_decode", "test_gpu_transfer", "test_processes", "test_shutdown",
    "test_robust", "test_grpo", "test_engine", "test_generation", "test_metrics", "test_weight_transfer",
    "test_docs_blocks", "test_rl_http", "test_update_nowait", "test_weights", "test_serve", "test_episodes",
]  # fmt: skip


def pytest_collection_modifyitems(items):
    """Every test here is `integration`. None is rerun by default: a test whose verdict depends on
    the machine's speed is a defect to fix, not to retry. `ROLLOUT_INTEGRATION_RERUNS=N` reruns a
    failed test N times (`R` in the progress line, "rerun" in the summary), for telling a flake
    from a failure while debugging; a hang (pytest-timeout) is not rerun."""

    def rank(item: pytest.Item) -> int:
        if "tests/integration" not in str(item.fspath):
            return -1
        name = item.module.__name__.rsplit(".", 1)[-1]
        return ORDER.index(name) if name in ORDER else len(ORDER)

    items.sort(key=rank)  # stable: a file's tests keep their order
    for item in items:
        if "tests/integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
            if RERUNS and item.get_closest_marker("flaky") is None:
                item.add_marker(pytest.mark.flaky(reruns=RERUNS, rerun_except="Timeout >"))


@pytest.fixture(scope="session", autouse=True)
def named_starts():
    """Every pool this process starts, shared or a test's own, is named by its kind in the run's
    engine-start record (`tests.support.starts`), and each restart by the test it began in: its
    start and restart are wrapped, nothing else changes."""
    from actors.pool import RayEnginePool

    start, restart = RayEnginePool.start.__func__, RayEnginePool.restart

    async def named(cls, cfg, *args, **kwargs):  # noqa: ANN001 -- RayEnginePool.start's own
        starts.append("label", label=kind(cfg))
        return await start(cls, cfg, *args, **kwargs)

    async def restarting(self, *args, **kwargs):  # noqa: ANN001 -- RayEnginePool.restart's own
        starts.append("restarting")  # a restart is recorded when it ends, maybe in a later test
        return await restart(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RayEnginePool, "start", classmethod(named))
        patch.setattr(RayEnginePool, "restart", restarting)
        yield


@pytest.fixture(scope="session")
async def pools():
    shared = SharedPools(max_engines=int(os.environ.get("ROLLOUT_SHARED_ENGINES", "4")))
    try:
        yield shared
    finally:
        await shared.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.failed:
        item.module.__dict__.setdefault("_failed_tests", []).append(item.name)
    return report


@pytest.fixture(scope="module")
async def engine(pools, request):
    """The module's engine over the shared pool of the default kind (2 engines). Where a test of the
    module failed, the pool is shut down after it, not handed to the next module."""
    async for e in held(lambda: pools.engine(integration_config())):
        yield e
        if getattr(request.module, "_failed_tests", None):
            pools.spoil(e)
