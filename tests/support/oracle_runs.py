"""The oracle runs' harness: weight updates landing inside running requests at points the test
chooses (never where a clock puts them), random weights, prompts, and a planted fault (an epoch
boundary moved by one token) the oracle must catch."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec
import torch

from policies.shm import descendants
from rollout import Prompt, RolloutEngine
from rollout.types import Trajectory

MODES = ["keep", "recompute", "abort_resume", "drain"]
UPDATES = 3
SAMPLING = ("sampling.temperature=0.7", "sampling.top_p=0.9", "sampling.top_k=50")
MAX_TOKENS, MIN_TOKENS = 100, 80  # each sample of `prompts`
# ~3k float32 tokens of the tiny model per engine, 24 blocks of vLLM's 128 on CPU: 16 running
# samples of `prompts` take 2 blocks each, so vLLM preempts, and the 12 that `land_inside` waits
# for fit at once. The oracle runs' engines (shm: our weight-transfer backend on CPU, which serves
# gloo learners too).
SMALL_KV = "engines.vllm={kv_cache_gib: 0.003, weight_transfer_config: {backend: shm}}"


def random_weights(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(v.shape, generator=g) * 0.08 if v.dim() > 1 else 1.0 + 0.1 * torch.randn(v.shape, generator=g)
        for k, v in base.items()
    }


def prompts(count: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    return [
        Prompt(token_ids=[rng.randrange(4, 260) for _ in range(rng.randrange(8, 80))], id=f"q{i}",
               sampling={"max_tokens": MAX_TOKENS, "min_tokens": MIN_TOKENS, "n": 4})
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
    return msgspec.structs.replace(
        t,
        policy_epochs=[(s0, e0), (s1 + 1, e1), *t.policy_epochs[2:]],
        kv_recomputes=[(s + 1, e) if s == s1 else (s, e) for s, e in t.kv_recomputes],
    )


def ungate(engine: RolloutEngine) -> None:
    """Undo `commit_when`: updates commit as soon as every engine received them, as they do
    untouched (the shared pools' hand-back updates the weights once more)."""
    engine._updates.__dict__.pop("_commit", None)
    if engine._transfer is not None:
        engine._transfer.__dict__.pop("_start_engines", None)


def commit_when(engine: RolloutEngine, ready: Callable[[int], Awaitable[Any]]) -> None:
    """Hold each weight update's commit (phase 2: engines pause and load) until `ready(epoch)`,
    after its transfer (phase 1, seconds on a busy machine) is done. The commit then lands at a
    point the test chose, not wherever the clock put it. `ungate` undoes it."""
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


def land_inside(
    engine: RolloutEngine,
    before: Callable[[int], Awaitable[Any]],
    count: int,
    accept: Callable[[Trajectory, int], bool],
    staged: list[asyncio.Event],
) -> None:
    """Land each update's commit inside running requests however fast or slow the machine (a
    progress report or a commit can take seconds on a busy 2-core machine, longer than a request).
    Once `before(epoch)` is done the engines' generation is paused, then `staged[epoch]` is set:
    the requests the update must land in start now, held. The engines then generate ~50 ms at a
    time until fresh progress reports show `count` samples `accept(t, epoch)` takes generating
    (tokens out, not finished); the commit pauses them again (a no-op), loads and resumes.
    `before`, `accept` and `staged` count epochs from the engine's epoch now (update 1 is its first)."""
    runner, start = engine._scheduler.runner, engine.epoch

    async def step(seconds: float) -> list[int]:
        live = [i for i, load in enumerate(runner.loads) if load.healthy]
        await asyncio.gather(
            *(runner.engines[i].actor.__ray_call__.remote(_generate_then_pause, seconds) for i in live)
        )
        return live

    async def ready(epoch: int) -> None:
        epoch -= start  # the callbacks count updates from the run's start
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
    start = engine.epoch  # update k makes epoch start + k; `weights` holds the weights by epoch
    base = weights[start]
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
            weights[start + k] = random_weights(base, seed=1000 * k)
            assert await update(weights[start + k]) == start + k
            updated[k].set()
    finally:
        updated[len(parts)].set()
        ungate(engine)
    await consumer
    return trajectories


async def vllm_trainer_update(
    engine: RolloutEngine, weights: dict, backend: str = "gloo"
) -> Callable[[dict], Awaitable[int]]:
    """An update through vLLM's trainer API: its factory's trainer engine of `backend` (ours, gloo
    or shm) + our client."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from rollout.weights.trainer import GlooTrainerInitInfo, ShmTrainerInitInfo, StateDictSource

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


async def actor_pid(engine: Any) -> int:
    return await asyncio.wait_for(engine.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)


async def kill(engine: Any, how: str) -> None:
    """SIGKILL engine handle `engine`'s Ray actor (`how="actor"`), or vLLM's engine-core process
    under it (the actor lives on and finds its engine dead)."""
    if how == "actor":
        await engine.kill()
    else:
        pid = await actor_pid(engine)
        for child in descendants(pid):
            os.kill(child, signal.SIGKILL)


GREEDY_PROMPTS = [
    Prompt(token_ids=[5 + i, 17, 80 + 3 * i, 9], id=f"wt{i}", sampling={"temperature": 0.0, "max_tokens": 12, "n": 1})
    for i in range(6)
]


async def greedy(engine: RolloutEngine) -> list[tuple[list[int], list[float], int]]:
    """Greedy answers to 6 short prompts (not for training): token ids, logprobs, first epoch."""
    out = []
    for group in await engine.submit(GREEDY_PROMPTS, train=False).result():
        t = group.trajectories[0]
        assert t.ok, t.error
        out.append((t.token_ids, t.logprobs, t.token_epochs()[0]))
    return out
