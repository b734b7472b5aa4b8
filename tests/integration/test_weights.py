"""Exact per-token epochs under in-flight weight updates, checked by the float32 HF oracle.

For each `weight_sync.mode`: 2 real engines, 128 requests of 160-200 tokens, 3 updates with
distinct random weights while they stream; every behaviour logprob must match the oracle's replay
(same tokens, the weights each position was computed with) within 1e-3.
"""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from policies.oracle import Oracle, compare
from rollout import Prompt, RolloutEngine
from rollout.errors import InvalidWeightsError
from rollout.types import Trajectory, kv_runs

from .conftest import integration_config

MODES = ["keep", "recompute", "abort_resume", "drain"]
UPDATES = 3


def random_weights(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.08 if v.dim() > 1 else 1.0 + 0.1 * torch.randn(v.shape, generator=g) for k, v in base.items()}


def prompts(count: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    return [
        Prompt(token_ids=[rng.randrange(4, 260) for _ in range(rng.randrange(8, 160))], id=f"q{i}",
               sampling={"max_tokens": 200, "min_tokens": 160, "n": 4})
        for i in range(count)
    ]  # fmt: skip


async def stream_with_updates(mode: str) -> tuple[list[Trajectory], dict[int, dict], RolloutEngine]:
    # 16 running per engine, 32 groups of 4: requests come in waves. Updates go out as the run
    # progresses (not on a clock, which a faster engine outruns) and the last 8 groups wait for
    # the last update, so even `drain` has requests to start under every epoch.
    cfg = integration_config(f"weight_sync.mode={mode}", "engines.count=2", "engines.max_inflight_per_engine=16")
    async with RolloutEngine(cfg) as engine:
        base = load_file(f"{engine.model_path}/model.safetensors")
        weights = {0: base}
        batch = prompts(32, seed=len(mode))
        updated = asyncio.Event()

        async def source():
            for p in batch[:24]:
                yield p
            await updated.wait()
            for p in batch[24:]:
                yield p

        engine.feed(source())
        trajectories: list[Trajectory] = []

        async def consume() -> None:
            async for group in engine.groups():
                assert group.ok, group.error or [t.error for t in group.trajectories]
                trajectories.extend(group.trajectories)

        consumer = asyncio.ensure_future(consume())
        await asyncio.sleep(0.6)  # update 1 while the first wave streams
        for k in range(1, UPDATES + 1):
            while len(trajectories) < 4 * 8 * (k - 1) and not consumer.done():  # updates 2, 3 after 8, 16 groups
                await asyncio.sleep(0.02)
            weights[k] = random_weights(base, seed=1000 * k)
            assert await engine.update_weights(weights[k]) == k
        updated.set()
        await consumer
        return trajectories, weights, engine


@pytest.mark.parametrize("mode", MODES)
async def test_epochs_match_the_oracle(mode: str):
    trajectories, weights, engine = await stream_with_updates(mode)
    assert len(trajectories) == 128
    assert [u.epoch for u in engine.weight_updates] == [1, 2, 3] and not any(u.failed for u in engine.weight_updates)
    for u in engine.weight_updates:
        assert u.bytes > 0 and u.bytes_received == 2 * u.bytes and set(u.stall_s) == {0, 1}

    tokens = sum(len(t.token_ids) for t in trajectories)
    seen = {e for t in trajectories for e in t.token_epochs()}
    straddling = [t for t in trajectories if len(t.policy_epochs) > 1]
    for t in trajectories:
        epochs = [e for _, e in t.policy_epochs]
        assert epochs == sorted(epochs), t.policy_epochs
        assert t.kv_epochs == kv_runs(len(t.prompt_token_ids), len(t.token_ids), t.policy_epochs, t.kv_recomputes)
        assert t.num_preemptions == len(t.kv_recomputes)
    assert seen == {0, 1, 2, 3}, "every update must land while requests stream"
    if mode == "drain":
        assert not straddling and all(t.num_preemptions == 0 for t in trajectories)
    else:
        assert len(straddling) >= 8, f"only {len(straddling)} trajectories saw an update mid-stream"
    if mode == "keep":
        assert all(t.num_preemptions == 0 for t in trajectories)
    if mode in ("recompute", "abort_resume"):
        assert all(t.kv_recomputes == [(s, e) for s, e in t.policy_epochs[1:]] for t in trajectories)

    oracle = Oracle(engine.model_path, weights)
    report = await asyncio.to_thread(compare, oracle, trajectories, 1e-3)
    assert report.tokens == tokens
    assert report.ok, msgspec.json.encode(report).decode()[:2000]

    # The oracle is sharp: move one epoch boundary by one token and it fails.
    t = straddling[0] if straddling else max(trajectories, key=lambda t: len(t.token_ids))
    if straddling:
        (s0, e0), (s1, e1) = t.policy_epochs[0], t.policy_epochs[1]
        shifted = [(s0, e0), (s1 + 1, e1), *t.policy_epochs[2:]]
        recomputes = [(s + 1, e) if s == s1 else (s, e) for s, e in t.kv_recomputes]
    else:  # drain: claim the last 10 tokens came from the next epoch
        last = t.policy_epochs[-1][1]
        shifted, recomputes = [*t.policy_epochs, (len(t.token_ids) - 10, (last + 1) % 4)], []
    bad = msgspec.structs.replace(t, policy_epochs=shifted, kv_recomputes=recomputes)
    assert not (await asyncio.to_thread(compare, oracle, [bad], 1e-3)).ok


async def test_bad_weights_are_rejected_before_any_engine_changes(engine):
    base = load_file(f"{engine.model_path}/model.safetensors")
    name = "model.norm.weight"
    cases = {
        "shape": {**base, name: torch.ones(3)},
        "dtype": {**base, name: base[name].to(torch.bfloat16)},
        "unknown": {**base, "model.extra.weight": torch.ones(1)},
        "missing": {k: v for k, v in base.items() if k != name},
        "nan": {**base, name: torch.full_like(base[name], float("nan"))},
    }
    before = [s.epoch for s in await engine.stats()]
    for what, sd in cases.items():
        with pytest.raises(InvalidWeightsError) as e:
            await engine.update_weights(sd)
        assert (name if what != "unknown" else "model.extra.weight") in str(e.value), what
    with pytest.raises(InvalidWeightsError, match="not a directory"):
        await engine.update_weights("/nonexistent/weights")
    assert [s.epoch for s in await engine.stats()] == before and engine.epoch == before[0]
