"""Exact per-token epochs under in-flight weight updates, checked by the float32 HF oracle.

For each `weight_sync.mode`: 2 real engines, 128 requests of 80-100 tokens sampled at temperature
0.7, top_p 0.9, top_k 50, 3 updates with distinct random weights while they stream (through vLLM's
trainer API, its factory's trainer engines of ours: 1 through `shm`, 3 through `gloo`, the engines
started with `shm` serving both; 2 through Ray's object store), and a KV cache
of ~3k tokens (24 blocks) per engine for the 32 blocks its 16 running requests need, so vLLM preempts (and each
preemption is recorded as an eviction and a KV recompute); every behaviour logprob (processed:
of the distribution sampled from) must match the oracle's replay (same tokens, the weights each
position was computed with, the same processing) within 1e-3, and a replay of raw logprobs must not.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Awaitable, Callable

import anyio
import msgspec
import pytest
import torch
from safetensors.torch import load_file

from policies.oracle import Oracle, compare
from policies.processing import Processing
from rollout import Prompt, RolloutEngine
from rollout.epochs import kv_runs
from rollout.errors import InvalidWeightsError
from rollout.tensors import save_dir
from rollout.types import Trajectory
from tests.support.engines import SharedPools, integration_config
from tests.support.oracle_runs import (
    MAX_TOKENS,
    MIN_TOKENS,
    MODES,
    SAMPLING,
    SMALL_KV,
    UPDATES,
    prompts,
    run_with_updates,
    shifted_boundary,
    vllm_trainer_update,
)


async def stream_with_updates(
    pools: SharedPools, mode: str
) -> tuple[list[Trajectory], dict[int, dict], RolloutEngine, int]:
    # 16 running per engine; 4 parts of 8 groups of 4 (one wave of 32 each), an update between parts.
    # Update 1 goes through vLLM's trainer API with our shm backend, 2 through Ray's object store,
    # 3 through vLLM's trainer API with our gloo backend (its learner joins then, as one off the
    # node would, the engines started with shm): every path lands inside running requests in every
    # mode, on one pair of engines. The run starts at the shared engines' epoch, `start`.
    cfg = integration_config(
        f"weight_sync.mode={mode}", "engines.count=2", "engines.max_inflight_per_engine=16", SMALL_KV, *SAMPLING
    )
    async with pools.engine(cfg) as engine:
        start = engine.epoch
        engine.first_stats = await engine.stats()  # type: ignore[attr-defined] # shared engines: counts so far
        weights = {start: load_file(f"{engine.model_path}/model.safetensors")}
        batch = prompts(32, seed=len(mode))
        trainers: dict[str, Callable[[dict], Awaitable[int]]] = {}

        async def via(backend: str, w: dict) -> int:
            if backend not in trainers:  # its learner joins at its first update
                trainers[backend] = await vllm_trainer_update(engine, weights[start], backend)
            return await trainers[backend](w)

        paths = [functools.partial(via, "shm"), engine.update_weights, functools.partial(via, "gloo")]
        calls = itertools.count()

        async def update(w: dict) -> int:
            return await paths[next(calls)](w)

        trajectories = await run_with_updates(
            engine, [batch[8 * k : 8 * (k + 1)] for k in range(UPDATES + 1)], update, weights
        )
        engine.final_stats = await engine.stats()  # type: ignore[attr-defined]
        engine.run_updates = list(engine.weight_updates)  # type: ignore[attr-defined] # not the hand-back's
        return trajectories, weights, engine, start


@pytest.mark.parametrize("mode", MODES)
async def test_epochs_match_the_oracle(pools, mode: str):
    trajectories, weights, engine, start = await stream_with_updates(pools, mode)
    run_epochs = [start + k for k in range(UPDATES + 1)]
    assert len(trajectories) == 128
    assert [u.epoch for u in engine.run_updates] == run_epochs[1:] and not any(u.failed for u in engine.run_updates)
    for u in engine.run_updates:
        assert u.bytes > 0 and u.bytes_received == 2 * u.bytes and set(u.stall_s) == {0, 1}

    tokens = sum(len(t.token_ids) for t in trajectories)
    seen = {e for t in trajectories for e in t.token_epochs()}
    straddling = [t for t in trajectories if len(t.policy_epochs) > 1]
    for t in trajectories:
        epochs = [e for _, e in t.policy_epochs]
        assert epochs == sorted(epochs), t.policy_epochs
        assert t.kv_epochs == kv_runs(len(t.prompt_token_ids), len(t.token_ids), t.policy_epochs, t.kv_recomputes)
        assert t.num_preemptions == len(t.kv_recomputes)
    assert seen == set(run_epochs), "every update must land while requests stream"
    evictions = sum(s.preemptions for s in engine.final_stats) - sum(s.preemptions for s in engine.first_stats)
    recomputed = sum(t.num_preemptions for t in trajectories)
    assert evictions >= 8 and recomputed >= 8, f"vLLM preempted {evictions} requests, {recomputed} recomputes recorded"
    boundaries_recomputed = all(
        {s for s, _ in t.policy_epochs[1:]} <= {j for j, _ in t.kv_recomputes} for t in trajectories
    )
    if mode == "drain":  # no update inside a request: an epoch changes only where an evicted one resumed
        assert boundaries_recomputed
    else:
        assert len(straddling) >= 8, f"only {len(straddling)} trajectories saw an update mid-stream"
    if mode in ("recompute", "abort_resume"):
        assert boundaries_recomputed

    oracle = Oracle(engine.model_path, weights)
    sampling = msgspec.structs.replace(
        engine.cfg.sampling, max_tokens=MAX_TOKENS, min_tokens=MIN_TOKENS
    )  # as the prompts ask
    processed = Processing.of(sampling, stop_ids=[2])
    report = await asyncio.to_thread(compare, oracle, trajectories, 1e-3, 20, processed)
    assert report.tokens == tokens
    assert report.ok, msgspec.json.encode(report).decode()[:2000]
    raw = await asyncio.to_thread(compare, oracle, trajectories[:8], 1e-3, 20, Processing(logprobs="raw"))
    assert raw.mismatched > raw.tokens // 2, "raw logprobs must not match what the engine reported"

    # The oracle is sharp: move one epoch boundary by one token and it fails.
    movable = [t for t in straddling if shifted_boundary(t)]
    if movable:
        bad = shifted_boundary(movable[0])
    else:  # drain: claim the last 10 tokens came from the next epoch
        t = max(trajectories, key=lambda t: len(t.token_ids))
        last = t.policy_epochs[-1][1]
        bad = msgspec.structs.replace(
            t,
            policy_epochs=[*t.policy_epochs, (len(t.token_ids) - 10, start + (last - start + 1) % 4)],
            kv_recomputes=[],
        )
    assert mode == "drain" or movable
    assert not (await asyncio.to_thread(compare, oracle, [bad], 1e-3, 20, processed)).ok


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


async def test_a_weights_directory_holding_nan_loads_nowhere(engine, tmp_path):
    """The directory path gets the state dict's value checks: a NaN tensor in a safetensors file
    is refused naming the file and tensor, no epoch is spent, and greedy answers do not change."""

    async def greedy() -> list[list[int]]:
        sampling = {"n": 1, "temperature": 0.0, "max_tokens": 8}
        engine.feed([Prompt(token_ids=[10 + i, 11, 12, 13], id=f"nan-dir-{i}", sampling=sampling) for i in range(8)])
        with anyio.fail_after(300):
            groups = sorted([g async for g in engine.groups()], key=lambda g: g.prompt_id)
        assert all(g.ok for g in groups), [g.error for g in groups]
        return [g.trajectories[0].token_ids for g in groups]

    before, epoch = await greedy(), engine.epoch
    base = load_file(f"{engine.model_path}/model.safetensors")
    name = "model.norm.weight"
    nan = save_dir({**base, name: torch.full_like(base[name], float("nan"))}, tmp_path / "nan")
    with pytest.raises(InvalidWeightsError, match=rf"model.safetensors: weights\['{name}'\]: contains NaN or inf"):
        await engine.update_weights(str(nan))
    assert engine.epoch == epoch and [s.epoch for s in await engine.stats()] == [epoch] * 2
    assert await greedy() == before
