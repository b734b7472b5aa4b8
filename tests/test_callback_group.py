"""The learner's plain groups run by callbacks, not tasks (`rollout.scheduling.callback_group`), over real
`RayEngine` handles and `VLLMPolicy` objects talking msgpack (`tests.support.wire`): what ends a group in
the data path's reader callback (its engine failed it, its engine died) reaches the learner once,
with the reason, its admission slot given back once, and a dead engine is restarted while its
samples move on. Every wait is bounded by `anyio.fail_after`.
"""

from __future__ import annotations

import random

import anyio
import pytest

from actors.handle import RayEngine
from policies.vllm_policy import VLLMPolicy
from rollout.config import Config
from rollout.engine import RolloutEngine
from rollout.errors import EngineDeadError
from tests.support.wire import LocalActor, TextVllm, WirePool

TIMEOUT = 10  # seconds; reached only by a test about to fail (a hang)


@pytest.fixture
def cfg(make_cfg) -> Config:
    """A dead engine restarts at once."""
    return make_cfg("engines.restart_backoff_s=0")


class RestartingPool(WirePool):
    """Wire engines that can be restarted, as `actors.pool` restarts a dead engine's actor."""

    def __init__(self, policies: list[VLLMPolicy], cfg: Config):
        super().__init__(policies)
        self.cfg, self.restarts = cfg, []

    async def restart(self, i: int) -> RayEngine:
        self.engines[i].close()
        policy = VLLMPolicy(self.cfg, "", i, frontend=TextVllm(random.Random(100 + i), chunk=4, capacity=64))
        await policy.ready()
        self.policies[i], self.actors[i] = policy, LocalActor(policy)
        self.engines[i] = RayEngine(self.actors[i], i, self.channel)
        self.restarts.append(i)
        return self.engines[i]


def failing(policy: VLLMPolicy, prompt: list[int], error: Exception) -> None:
    """`policy` ends the group of `prompt` with `error` (a results frame saying so), runs the rest."""
    real = policy.stream_group

    async def stream_group(requests):
        if list(requests[0].token_ids) == prompt:
            raise error
        async for traj in real(requests):
            yield traj

    policy.stream_group = stream_group


async def test_a_group_its_engine_fails_comes_out_failed_once_and_gives_its_admission_slot_back_once(cfg):
    pool = await WirePool.start(cfg, 2)
    for policy in pool.policies:
        failing(policy, [5, 6], RuntimeError("engine-side bug"))
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            engine.feed(iter([[5, 6], [5, 6, 7]]))
            groups = {g.prompt.token_ids[-1]: g async for g in engine.groups()}
            admission = engine._scheduler.admission
            assert (admission.running, admission.accepted) == (0, 1)  # before: running -1 (released twice)
    bad = groups[6].trajectories
    assert len(groups) == 2 and all(t.ok for t in groups[7].trajectories)
    assert len(bad) == 2 and all(not t.ok and "engine-side bug" in t.error for t in bad), [t.error for t in bad]


async def test_an_engine_that_dies_under_a_group_is_restarted_and_its_samples_move_on(cfg):
    pool = RestartingPool([], cfg)
    started = await WirePool.start(cfg, 2)
    pool.policies, pool.actors, pool.engines = started.policies, started.actors, started.engines
    pool.channel = started.channel
    failing(pool.policies[0], [5, 6], EngineDeadError("vLLM's engine core died"))
    failing(pool.policies[1], [5, 6], EngineDeadError("vLLM's engine core died"))
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            engine.feed(iter([[5, 6, 7], [5, 6], [5, 6, 8]]))
            groups = [g async for g in engine.groups()]
            while not all(load.healthy for load in engine._scheduler.runner.loads):
                await anyio.sleep(0.01)
    assert pool.restarts  # before: the restart was never started (anyio called from the reader callback)
    failed = [t.error for g in groups for t in g.trajectories if not t.ok]
    assert len(groups) == 3 and all(g.error is None for g in groups)
    # the group on a dying engine moves on; on a restarted one it dies again, until max_retries says no more
    assert all("vLLM's engine core died" in e for e in failed), failed
