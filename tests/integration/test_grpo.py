"""A small real async GRPO run: the learner's reward rises while its weights reach the engine in flight.

`benchmarks/async_grpo.py` at test size, on the suite's shared pool of the default kind (2
engines): 20 learner steps of 4 groups x 8 samples, the float32 tiny Llama learning to emit digits
(reward = digit tokens / max_tokens), `weight_sync.mode: keep` with `staleness.max_lag: 2`. The
reward starts near 10/260 ~ 0.04 and its per-step mean over 32 samples of 16 tokens moves by ~0.01
from noise alone, so a rise of 0.3 is learning (seeds 0-3 go from ~0.03 to ~0.98).
"""

from __future__ import annotations

import asyncio

import msgspec

from benchmarks.async_grpo import BASE, MODES, run, window_means
from policies.oracle import Oracle, compare
from tests.support.engines import integration_config

STEPS, WINDOW = 20, 4


async def test_async_grpo_learns_while_weights_update_in_flight(pools):
    cfg = integration_config(*BASE, *MODES["async"])
    result = await run(cfg, steps=STEPS, groups=4, lr=2e-3, seed=0, record=True, start=pools.engine)
    curve = result["curve"]
    first, last = window_means(curve, WINDOW)
    assert last > first + 0.3, [round(r["reward"], 3) for r in curve]

    # Updates landed in flight: trajectories straddle epochs, batches mix epochs, lag stays bounded.
    e0 = result["start_epoch"]
    assert [r["epoch"] for r in curve] == list(range(e0 + 1, e0 + STEPS + 1))
    assert result["straddling_trajectories"] > 0
    assert any(len(r["epochs_in_batch"]) > 1 for r in curve)
    assert max(r["lag_max"] for r in curve) <= 2

    # Every behaviour logprob trained on is what the learner's own weights of that token's epoch
    # give (float32 replay with the KV history the engine had), and after the last update the
    # engine serves exactly the learner's weights.
    trajectories, weights = result["trajectories"], result["weights"]
    assert sorted(weights) == list(range(e0, e0 + STEPS + 1))
    oracle = Oracle(result["model_path"], weights)
    report = await asyncio.to_thread(compare, oracle, trajectories, 1e-3)
    assert report.tokens == sum(len(t.token_ids) for t in trajectories)
    assert report.ok, msgspec.json.encode(report).decode()[:2000]
    assert result["final_gap"] < 1e-4, result["final_gap"]
