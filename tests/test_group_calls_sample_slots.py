"""A sample's slot on its engine comes back when the sample ends, not when its group does.

Over the real wire (`tests.support.wire`: `RayEngine` handles over `VLLMPolicy` on the fake vLLM): before,
the engine actor sent a group back only once its last sample ended, so the scheduler could start
nothing in the slots of the samples that had ended, and the engine's batch drained in waves.
"""

from __future__ import annotations

import anyio
import msgspec
import pytest

from rollout.config import Config
from rollout.engine import RolloutEngine
from rollout.types import Request, Sampling
from tests.support.wire import WirePool

TIMEOUT = 30


@pytest.fixture
def cfg(make_cfg) -> Config:
    """One engine with room for 3 requests (2 running, 1 queued); prompts and samples within 512 tokens."""
    return make_cfg(
        "engines.count=1", "model.max_model_len=512", "engines.max_inflight_per_engine=2", "engines.queued_per_engine=1"
    )


async def test_a_finished_sample_comes_back_while_its_group_still_runs(cfg):
    pool = await WirePool.start(cfg)
    policy = pool.policies[0]
    short, long = (
        Request(f"r-{k}", "p", k, Sampling(n=2, max_tokens=m, stop_token_ids=[]), token_ids=[5, 6])
        for k, m in ((0, 2), (1, 400))
    )
    try:
        with anyio.fail_after(TIMEOUT):
            samples = pool.engines[0].generate_group([short, long])
            first = await anext(samples)  # before: only once the 400-token sample had ended too
            assert first.request_id == "r-0" and len(first.token_ids) == 2
            assert policy._running == 1  # the long sample still runs
            second = await anext(samples)
            assert second.request_id == "r-1" and len(second.token_ids) == 400
    finally:
        await pool.shutdown()


async def test_a_freed_sample_slot_is_refilled_before_its_group_completes(cfg):
    """One engine, room for 3 requests (2 running + 1 queued), groups of 2 whose second sample is
    long: the next group starts as soon as the short samples free their slots, while the long
    samples of the groups before still run."""
    pool = await WirePool.start(cfg)
    policy = pool.policies[0]
    prompts = [
        {"id": f"g{i}", "token_ids": [5, 6 + i], "sampling": {"n": 2, "max_tokens": 300, "stop_token_ids": []}}
        for i in range(3)
    ]
    started: list[str] = []
    real = policy.generate

    async def generate(req, owner=None):
        started.append(req.request_id)
        if req.sample_index == 0:  # the short sample of its group
            req = msgspec.structs.replace(req, sampling=Sampling(n=2, max_tokens=2, stop_token_ids=[]))
        return await real(req, owner)

    policy.generate = generate
    try:
        with anyio.fail_after(TIMEOUT):
            async with RolloutEngine(cfg, pool=pool) as engine:
                engine.feed(prompts)
                groups = [g async for g in engine.groups()]
    finally:
        await pool.shutdown()
    assert sorted(g.prompt_id for g in groups) == ["g0", "g1", "g2"] and all(g.ok for g in groups)
    by_id = {g.prompt_id: g for g in groups}
    g0_long = by_id["g0"].trajectories[1]
    assert len(g0_long.token_ids) == 300 and len(by_id["g0"].trajectories[0].token_ids) == 2
    # before: g1 started only after g0's long sample had ended (its group's slots came back together)
    assert min(t.submitted_at for t in by_id["g1"].trajectories) < g0_long.finished_at
