"""Engines die mid-rollout, weights change meanwhile, and nothing is lost or doubled.

Chaos: 3 real engines, at least 96 prompts x n=4 (read lazily, more until 2 kills and 2
restarts have happened, however fast the engines run), an update with distinct random weights
every 2 s (`keep`), and right after it an engine killed while another one serves (its Ray actor,
or vLLM's engine-core process; 2 kills, spread so that no two restarts share a core). Every
prompt comes out exactly once with its whole group, epochs only grow along a trajectory, and the
float32 oracle reproduces every logprob of every sample that moved to another engine.
Then, on the same engines, kill-all: with no restarts left, every engine killed mid-rollout (an
engine core, an actor, and an engine core stopped, which only the health watch's round trip to the
core sees), the fatal error comes within twice the health timeout, the served request
in flight and every new one on every route are answered 503, and nothing of the engines outlives
the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time

import httpx
import msgspec
import openai
import pytest
import ray
from safetensors.torch import load_file

from actors.cluster import connect
from policies.oracle import Oracle, compare
from policies.processing import Processing
from policies.shm import descendants
from policies.vllm_args import engine_env
from rollout import Prompt, RolloutEngine
from rollout.epochs import kv_runs
from rollout.errors import EngineDeadError
from rollout.types import Trajectory
from tests.support.engines import engine_processes, integration_config, leaked_shm, shm_segments
from tests.support.oracle_runs import actor_pid, kill, random_weights

# Every prompt's sampling. The oracle must process logprobs the same way: below min_tokens the
# engine masks the stop tokens, so a processed logprob is renormalised without them.
SAMPLING = {"max_tokens": 160, "min_tokens": 128, "n": 4}


def cores(cfg, i: int) -> set[str]:
    """The CPU cores engine `i` runs on (none for a GPU engine)."""
    e = cfg.engines
    return set(engine_env(i, e.cpus_per_engine, e.gpus_per_engine).get("ROLLOUT_ENGINE_CORES", "").split(",")) - {""}


KILLS = 2  # one of each kind: the actor, then its engine core (a third, another actor, was ~50 s more of the suite)


async def test_engines_die_mid_rollout_and_nothing_is_lost_and_with_none_left_the_fatal_error_comes_in_time():
    cfg = integration_config(
        "engines.count=3", "engines.max_inflight_per_engine=32", "engines.health_interval_s=0.5",
        "engines.health_timeout_s=30", "engines.restart_backoff_s=0.5", "engines.max_restarts=4",
        "weight_sync.mode=keep", "queue.max_groups=400",
    )  # fmt: skip
    rng = random.Random(0)
    prompts: list[Prompt] = []
    kills: list[tuple[int, str]] = []
    # Ray already up (as when the learner started it): the pool must still remove what the dead engines left.
    started_ray = connect(cfg)
    before_shm, before_pids = shm_segments(), engine_processes()
    try:
        await chaos_then_kill_all(cfg, rng, prompts, kills)
        deadline = time.monotonic() + 30  # a killed actor's engine core notices its parent is gone
        while engine_processes() - before_pids and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert not engine_processes() - before_pids, "engine processes outlived the shutdown"
        # vLLM's ring buffers (160 MiB each) and semaphores of killed engines are removed.
        assert not leaked_shm(before_shm), "killed engines left shared memory behind"
    finally:
        if started_ray:
            ray.shutdown()


async def chaos_then_kill_all(cfg, rng: random.Random, prompts: list[Prompt], kills: list[tuple[int, str]]) -> None:
    async with RolloutEngine(cfg) as engine:

        async def source():  # the engines restart in ~30 s: keep feeding until the chaos is done
            while len(prompts) < 96 or (
                len(prompts) < 3000 and (len(kills) < KILLS or sum(engine._updates._restarts.values()) < KILLS)
            ):
                prompts.append(Prompt(
                    token_ids=[rng.randrange(4, 260) for _ in range(rng.randrange(8, 64))], id=f"q{len(prompts)}",
                    sampling=dict(SAMPLING),
                ))  # fmt: skip
                yield prompts[-1]

        base = load_file(f"{engine.model_path}/model.safetensors")
        weights = {0: base}
        engine.feed(source())
        groups = []

        async def consume() -> None:
            async for group in engine.groups():
                groups.append(group)

        stop = asyncio.Event()  # the chaos ends between updates: the engines go on to the kill-all

        async def chaos() -> None:
            k = 0
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 2.0)
                    return
                k += 1
                weights[k] = random_weights(base, seed=77 * k)
                try:
                    await engine.update_weights(weights[k])
                except Exception:  # an engine dying mid-update is fine; the epoch still moved
                    pass
                if len(kills) == KILLS:  # one more is a restart more for the exit to wait for
                    continue
                runner = engine._scheduler.runner
                # Mid-rollout: a victim whose progress report, taken just now, holds samples with tokens
                # (on a slow machine an engine just after a kill or an update may hold only queued ones).
                for i, load in enumerate(runner.loads):
                    if load.healthy:
                        await runner._check(i)
                healthy = [i for i, load in enumerate(runner.loads) if load.healthy]
                busy = [
                    i
                    for i in healthy
                    if sum(bool(t.token_ids) and not t.finished_at for t in runner.reports[i].values()) >= 8
                ]
                if len(healthy) < 2 or not busy:
                    continue
                # A restart is a whole engine start: two on one core (3 engines on 2 here) take twice
                # as long, and the next kill waits for one to end. Spread them over the cores.
                restarting = set().union(*(cores(cfg, i) for i, load in enumerate(runner.loads) if load.restarting))
                victim = rng.choice([i for i in busy if not cores(cfg, i) & restarting] or busy)
                how = "actor" if len(kills) % 2 == 0 else "engine core"
                await kill(runner.engines[victim], how)
                kills.append((victim, how))

        consumer = asyncio.ensure_future(consume())
        chaos_task = asyncio.ensure_future(chaos())
        try:
            await asyncio.wait_for(consumer, timeout=900)
        finally:
            stop.set()
            await chaos_task
        restarts = dict(engine._updates._restarts)
        await kill_all(engine)

    assert len(kills) >= KILLS, kills
    assert sum(restarts.values()) >= KILLS, restarts
    ids = [g.prompt_id for g in groups]
    assert sorted(ids) == sorted(p.id for p in prompts), "every prompt exactly once"
    trajectories: list[Trajectory] = []
    for g in groups:
        assert g.ok, (g.error, [t.error for t in g.trajectories])
        assert [t.sample_index for t in g.trajectories] == [0, 1, 2, 3]
        trajectories.extend(g.trajectories)
    for t in trajectories:
        epochs = [e for _, e in t.policy_epochs]
        assert epochs == sorted(epochs), t.policy_epochs
        assert len(t.logprobs) == len(t.token_ids) >= 128
        assert t.kv_epochs == kv_runs(len(t.prompt_token_ids), len(t.token_ids), t.policy_epochs, t.kv_recomputes)
    moved = [t for t in trajectories if t.kv_recomputes]  # keep mode recomputes only when a sample moves
    assert len(moved) >= 8, f"only {len(moved)} samples moved with partial output"
    oracle = Oracle(engine.model_path, weights)
    processing = Processing.of(msgspec.structs.replace(cfg.sampling, **SAMPLING), stop_ids=[2])
    report = await asyncio.to_thread(compare, oracle, moved, 1e-3, 20, processing)
    assert report.ok, msgspec.json.encode(report).decode()[:2000]


async def kill_all(engine: RolloutEngine) -> None:
    """Every engine back in rotation, none with a restart left (as if each had used its
    `engines.max_restarts`), then each killed mid-rollout: one engine core, one Ray actor, and one
    engine core stopped (SIGSTOP: its actor still answers, its core answers nothing, as a core stuck
    inside a step or a call; the health watch must see it). Each kind of death must be noticed, or
    "every engine is dead" never comes."""
    runner = engine._scheduler.runner
    while not all(load.healthy and not load.restarting for load in runner.loads):
        await asyncio.sleep(0.1)  # the chaos' last restart is still starting its engine
    engine._updates._restarts.update(dict.fromkeys(range(len(runner.loads)), engine.cfg.engines.max_restarts))
    engine.feed([Prompt(token_ids=[5 + i] * 8, sampling={"max_tokens": 400, "min_tokens": 400}) for i in range(32)])
    while not all(any(t.token_ids for t in runner.reports[i].values()) for i in range(len(runner.loads))):
        await asyncio.sleep(0.05)  # mid-rollout: tokens reported by every engine
    server = await engine.serve(port=0)
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 400, "min_tokens": 400}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        in_flight = asyncio.create_task(http.post("/v1/chat/completions", json=chat))
        while not server.inflight:
            await asyncio.sleep(0.05)
        killed_at = time.monotonic()
        stuck = descendants(await actor_pid(runner.engines[2]))  # its engine core and worker
        try:
            for pid in stuck:
                os.kill(pid, signal.SIGSTOP)
            await asyncio.gather(kill(runner.engines[0], "engine core"), kill(runner.engines[1], "actor"))
            with pytest.raises(EngineDeadError, match="every engine is dead"):
                async for _ in engine.groups():
                    pass
            # the stuck core: silent for engines.health_timeout_s, then reported within a health interval
            assert time.monotonic() - killed_at < 2 * engine.cfg.engines.health_timeout_s
        finally:  # a stopped process notices no parent gone: let it run on to exit
            for pid in stuck:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        # Served: the request in flight, and every new one on every route, answered 503 (not a wait).
        assert (await in_flight).status_code == 503
        for path, body in [("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "x"}),
                           ("/inference/v1/generate", {"token_ids": [5, 6]})]:  # fmt: skip
            r = await http.post(path, json=body, timeout=10)
            assert r.status_code == 503 and "every engine is dead" in r.text, (path, r.text)
        assert (await http.get("/health", timeout=10)).status_code == 503
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=10) as sdk:
            with pytest.raises(openai.InternalServerError):
                await sdk.chat.completions.create(model=server.model, messages=chat["messages"])
