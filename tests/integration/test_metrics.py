"""`engine.metrics()` on real vLLM engines in Ray actors (the session's engine pair)."""

from __future__ import annotations

import anyio

from rollout import RolloutEngine
from rollout.config import PromptsConfig
from rollout.inputs.prompts import synthetic_prompts


async def test_a_window_counts_what_the_engines_did_in_it(engine: RolloutEngine):
    await engine.metrics()  # start a window here: earlier tests' work is not in it
    engine.feed(synthetic_prompts(PromptsConfig(count=32, min_len=4, max_len=32, seed=3), engine.limits.vocab_size))
    with anyio.fail_after(300):
        groups = [g async for g in engine.groups()]
    m = await engine.metrics()
    again = await engine.metrics()

    assert all(g.ok for g in groups)
    assert m["rollout/tokens"] == sum(len(t.token_ids) for g in groups for t in g.trajectories)
    assert (m["rollout/groups"], m["rollout/trajectories"], m["rollout/failed_trajectories"]) == (32, 32 * 4, 0)
    assert (m["rollout/lag_mean"], m["rollout/lag_p99"], m["rollout/preemptions"], m["rollout/queue_depth"]) == (
        0,
        0,
        0,
        0,
    )
    assert m["rollout/tokens_per_s"] > 0 and 0 < m["rollout/engine_busy_fraction/e0"] <= 1
    assert (again["rollout/tokens"], again["rollout/groups"]) == (0, 0)
