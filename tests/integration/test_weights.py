"""Exact per-token epochs under in-flight weight updates, checked by the float32 HF oracle.

For each `weight_sync.mode`: 2 real engines, 128 requests of 160-200 tokens sampled at temperature
0.7, top_p 0.9, top_k 50, 3 updates with distinct random weights while they stream (through vLLM's
trainer API, its factory's trainer engines of ours: 1 through `shm`, 3 through `gloo`, the engines
started with `shm` serving both; 2 through Ray's object store), and a KV cache
of ~3k tokens per engine for the ~5k its 16 running requests need, so vLLM preempts (and each
preemption is recorded as an eviction and a KV recompute); every behaviour logprob (processed:
of the distribution sampled from) must match the oracle's replay (same tokens, the weights each
position was computed with, the same processing) within 1e-3, and a replay of raw logprobs must not.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec
import pytest
import torch
from safetensors.torch import load_file

from policies.oracle import Oracle, compare
from policies.processing import Processing
from policies.weights import save_dir
from rollout import Prompt, RolloutEngine
from rollout.epochs import kv_runs
from rollout.errors import InvalidWeightsError
from rollout.types import Trajectory

from .conftest import integration_config

MODES = ["keep", "recompute", "abort_resume", "drain"]
UPDATES = 3
SAMPLING = ("sampling.temperature=0.7", "sampling.top_p=0.9", "sampling.top_k=50")
SMALL_KV = "engines.vllm={kv_cache_gib: 0.003}"  # ~3k float32 tokens of the tiny model


def random_weights(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(v.shape, generator=g) * 0.08 if v.dim() > 1 else 1.0 + 0.1 * torch.randn(v.shape, generator=g)
        for k, v in base.items()
    }


def prompts(count: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    return [
        Prompt(token_ids=[rng.randrange(4, 260) for _ in range(rng.randrange(8, 160))], id=f"q{i}",
               sampling={"max_tokens": 200, "min_tokens": 160, "n": 4})
        for i in range(count)
    ]  # fmt: skip


def shifted_boundary(t: Trajectory) -> Trajectory | None:
    """`t` with its first epoch boundary one token later (a recompute there moved with it), or None
    where that leaves no token to the run (updates landed on consecutive tokens)."""
    if len(t.policy_epochs) < 2:
        return None
    (s0, e0), (s1, e1) = t.policy_epochs[:2]
    end = t.policy_epochs[2][0] if len(t.policy_epochs) > 2 else len(t.token_ids)
    if s1 + 1 >= end:
        return None
    return msgspec.structs.replace(t, policy_epochs=[(s0, e0), (s1 + 1, e1), *t.policy_epochs[2:]],
                                   kv_recomputes=[(s + 1, e) if s == s1 else (s, e) for s, e in t.kv_recomputes])  # fmt: skip


def commit_when(engine: RolloutEngine, ready: Callable[[int], Awaitable[Any]]) -> None:
    """Hold each weight update's commit (phase 2: engines pause and load) until `ready(epoch)`,
    after its transfer (phase 1, seconds on a busy machine) is done. The commit then lands at a
    point the test chose, not wherever the clock put it."""
    commit = engine._updates._commit

    async def gated(epoch: int, *args: Any, **kwargs: Any) -> Any:
        await ready(epoch)
        return await commit(epoch, *args, **kwargs)

    engine._updates._commit = gated  # type: ignore[method-assign]
    transfer = engine.weight_transfer()  # vLLM's trainer API: its engines pause and start here
    start = transfer._start_engines

    async def gated_start(rnd: Any) -> Any:
        await ready(rnd.epoch)
        return await start(rnd)

    transfer._start_engines = gated_start  # type: ignore[method-assign]


def _generate_then_pause(policy: Any, seconds: float) -> None:
    """Inside an engine actor (Ray runs `__ray_call__` on a thread of its own): let vLLM generate
    for `seconds` (0: not at all), then pause it the way a commit does (keep: requests stay)."""
    vllm = policy.inner._vllm  # the actor is a shell over the policy (`actors.shell`)

    async def run() -> None:
        if seconds:
            await vllm.resume()
            await asyncio.sleep(seconds)
        await vllm.pause("keep", clear_cache=False)

    asyncio.run_coroutine_threadsafe(run(), vllm.llm.output_handler.get_loop()).result(timeout=120)


def land_inside(engine: RolloutEngine, before: Callable[[int], Awaitable[Any]], count: int, accept: Callable[[Trajectory, int], bool],
                staged: list[asyncio.Event]) -> None:  # fmt: skip
    """Land each update's commit inside running requests however fast or slow the machine (a
    progress report or a commit can take seconds on a busy 2-core machine, longer than a request).
    Once `before(epoch)` is done the engines' generation is paused, then `staged[epoch]` is set:
    the requests the update must land in start now, held. The engines then generate ~50 ms at a
    time until fresh progress reports show `count` samples `accept(t, epoch)` takes generating
    (tokens out, not finished); the commit pauses them again (a no-op), loads and resumes."""
    runner = engine._scheduler.runner

    async def step(seconds: float) -> list[int]:
        live = [i for i, load in enumerate(runner.loads) if load.healthy]
        await asyncio.gather(
            *(runner.engines[i].actor.__ray_call__.remote(_generate_then_pause, seconds) for i in live)
        )
        return live

    async def ready(epoch: int) -> None:
        await before(epoch)
        await step(0)
        staged[epoch].set()
        best = 0
        try:
            async with asyncio.timeout(300):
                while best < count:
                    live = await step(0.05)
                    await asyncio.gather(*(runner._check(i) for i in live))
                    reports = [t for i in live for t in runner.reports[i].values()]
                    best = max(best, sum(accept(t, epoch) and bool(t.token_ids) and not t.finished_at for t in reports))
        except TimeoutError:
            raise AssertionError(f"never {count} samples generating at once (at most {best} seen)") from None

    commit_when(engine, ready)


async def run_with_updates(
    engine: RolloutEngine, parts: list[list[Prompt]], update: Any, weights: dict[int, dict]
) -> list[Trajectory]:
    """Feed `parts` in order, an update between consecutive ones. Update k+1 goes out as soon as
    update k is in; part k is fed once update k+1's transfer is done and part k-1 is all done,
    and update k+1 commits once 12 of part k's samples are generating (`land_inside`). So every
    epoch has requests started under it (drain too), and in-place modes see every update land
    mid-request however long its transfer took: the run never races a clock."""
    base = weights[0]
    part_of = {p.id: k for k, part in enumerate(parts) for p in part}
    left = [len(part) for part in parts]
    finished = [asyncio.Event() for _ in parts]
    updated = [asyncio.Event() for _ in range(len(parts) + 1)]
    staged = [asyncio.Event() for _ in range(len(parts) + 1)]
    staged[len(parts)].set()  # no update after the last part
    trajectories: list[Trajectory] = []

    async def source():
        for k, part in enumerate(parts):
            await staged[k + 1].wait()
            if k:
                await finished[k - 1].wait()
            for p in part:
                yield p
            await updated[k + 1].wait()

    async def consume() -> None:
        async for group in engine.groups():
            assert group.ok, group.error or [t.error for t in group.trajectories]
            trajectories.extend(group.trajectories)
            k = part_of[group.prompt_id]
            left[k] -= 1
            if not left[k]:
                finished[k].set()

    async def before(epoch: int) -> None:  # part epoch-1 runs under this update: the one before it is done
        if epoch >= 2:
            await finished[epoch - 2].wait()

    land_inside(engine, before, 12, lambda t, epoch: part_of.get(t.prompt_id) == epoch - 1, staged)
    engine.feed(source())
    consumer = asyncio.ensure_future(consume())
    try:
        for k in range(1, len(parts)):
            weights[k] = random_weights(base, seed=1000 * k)
            assert await update(weights[k]) == k
            updated[k].set()
    finally:
        updated[len(parts)].set()
    await consumer
    return trajectories


async def vllm_trainer_update(
    engine: RolloutEngine, weights: dict, backend: str = "gloo"
) -> Callable[[dict], Awaitable[int]]:
    """An update through vLLM's trainer API: its factory's trainer engine of `backend` (ours, gloo
    or shm) + our client."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from policies.gloo_transfer import GlooTrainerInitInfo, StateDictSource
    from policies.shm_transfer import ShmTrainerInitInfo

    client, source = engine.weight_sync_client(), StateDictSource(weights)
    info = {"gloo": GlooTrainerInitInfo, "shm": ShmTrainerInitInfo}[backend]
    init = info(world_size=1 + client.world_size(), rank=0, timeout_s=600)
    trainer = await anyio.to_thread.run_sync(
        lambda: WeightTransferTrainerFactory.trainer_init(init, client=client, source=source)
    )

    async def update(w: dict) -> int:
        source.update(w)
        await anyio.to_thread.run_sync(trainer.send_weights)
        return engine.epoch

    return update


async def stream_with_updates(mode: str) -> tuple[list[Trajectory], dict[int, dict], RolloutEngine]:
    # 16 running per engine; 4 parts of 8 groups of 4 (one wave of 32 each), an update between parts.
    # Update 1 goes through vLLM's trainer API with our shm backend, 2 through Ray's object store,
    # 3 through vLLM's trainer API with our gloo backend (its learner joins then, as one off the
    # node would, the engines started with shm): every path lands inside running requests in every
    # mode, on one pair of engines.
    shm = "engines.vllm={kv_cache_gib: 0.003, weight_transfer_config: {backend: shm}}"  # SMALL_KV's cache
    cfg = integration_config(
        f"weight_sync.mode={mode}", "engines.count=2", "engines.max_inflight_per_engine=16", shm, *SAMPLING
    )
    async with RolloutEngine(cfg) as engine:
        weights = {0: load_file(f"{engine.model_path}/model.safetensors")}
        batch = prompts(32, seed=len(mode))
        trainers: dict[str, Callable[[dict], Awaitable[int]]] = {}

        async def via(backend: str, w: dict) -> int:
            if backend not in trainers:  # its learner joins at its first update
                trainers[backend] = await vllm_trainer_update(engine, weights[0], backend)
            return await trainers[backend](w)

        paths = [functools.partial(via, "shm"), engine.update_weights, functools.partial(via, "gloo")]
        calls = itertools.count()

        async def update(w: dict) -> int:
            return await paths[next(calls)](w)

        trajectories = await run_with_updates(
            engine, [batch[8 * k : 8 * (k + 1)] for k in range(UPDATES + 1)], update, weights
        )
        engine.final_stats = await engine.stats()  # type: ignore[attr-defined]
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
    evictions = sum(s.preemptions for s in engine.final_stats)
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
    sampling = msgspec.structs.replace(engine.cfg.sampling, max_tokens=200, min_tokens=160)  # as the prompts ask
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
            t, policy_epochs=[*t.policy_epochs, (len(t.token_ids) - 10, (last + 1) % 4)], kv_recomputes=[]
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
        engine.feed([Prompt(token_ids=[10 + i, 11, 12, 13], id=f"nan-dir-{i}", sampling={"n": 1, "temperature": 0.0, "max_tokens": 8})
                     for i in range(8)])  # fmt: skip
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
