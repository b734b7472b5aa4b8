"""Multi-turn episodes on real engines, checked by the float32 oracle across every turn.

For each `weight_sync.mode`: 2 engines, 8 prompts x 2 episodes of 5 turns (text observations
rendered by the tiny model's chat template), 3 updates of distinct random weights, update k landing
inside turn k (turn k starts on paused engines, stepped until it is mid-generation) and before
turn k+1 (which waits for it); turns 0 and 1 start in the run's first epoch: no clock to race. The oracle
replays each whole episode, the KV carried from turn to turn (a turn's `kv_reused` positions as
the turns before computed them), and must reproduce every model token's processed logprob within
1e-3; moving one epoch boundary by one token must fail. In `keep` mode one engine is killed
mid-episode and its episodes go on elsewhere: the kill lands once a turn has finished on that
engine and while every episode has turns to go (an episode's step after its second turn waits
for it), whatever the engines' speed.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from safetensors.torch import load_file

from policies.oracle import Oracle, compare
from policies.processing import Processing
from rollout import Prompt, RolloutEngine
from rollout.episodes.env import Step
from rollout.types import Trajectory
from tests.support.engines import SharedPools, integration_config
from tests.support.oracle_runs import MODES, SAMPLING, kill, land_inside, random_weights, shifted_boundary, ungate

TURNS = 5


PROMPTS = 8
EPISODES = PROMPTS * 2  # prompts x sampling.n


class Talk:
    """Five turns; every observation is a short user message. Turns 0 and 1 start in the first epoch (turn
    1 reuses turn 0's KV in every mode); from then on turn k+1 starts only once update k is in
    (`landed`), so each update lands between turns. Every episode starts turn k together: once
    all have finished turn k-1 (`ended`) and update k's transfer is done (`staged`, set by
    `land_inside` once the engines are paused): update k commits once 6 turns k are generating,
    inside them, however long its transfer took and however fast or slow the machine. With
    `hold` set up, the step after turn 1 also waits for it."""

    landed: list[asyncio.Event]
    staged: list[asyncio.Event]
    ended: list[asyncio.Event]
    turns_ended: list[int]
    hold: asyncio.Event | None = None

    async def reset(self, prompt: Prompt) -> None:
        pass

    async def step(self, action) -> Step:
        k = action.turn
        Talk.turns_ended[k] += 1
        if Talk.turns_ended[k] == EPISODES:
            Talk.ended[k].set()
        if k == 1 and Talk.hold is not None:
            await Talk.hold.wait()
        done = k + 1 >= TURNS
        if not done:
            await Talk.ended[k].wait()
            await Talk.staged[k + 1].wait()
            if k >= 1:
                await Talk.landed[k].wait()
        return Step(None if done else f"observation {k} " + "x" * (k * 7), 1.0, done)


async def run(pools: SharedPools, mode: str, kill_one: bool) -> tuple[list[Trajectory], dict[int, dict], RolloutEngine]:
    Talk.landed, Talk.staged, Talk.ended = ([asyncio.Event() for _ in range(TURNS)] for _ in range(3))
    Talk.staged[TURNS - 1].set()  # no update after the last turn
    Talk.turns_ended, Talk.hold = [0] * TURNS, asyncio.Event() if kill_one else None
    cfg = integration_config(
        f"weight_sync.mode={mode}", "engines.count=2", "engines.max_inflight_per_engine=16", "sampling.n=2",
        "sampling.max_tokens=64", "sampling.min_tokens=48", "model.max_model_len=1024", f"episode.max_turns={TURNS}",
        "engines.health_interval_s=0.5", "engines.restart_backoff_s=0.5",
        "episode.step_timeout_s=600", *SAMPLING,
        # the killed engine stays dead: no restart for the exit to wait for (the pool is then dropped)
        *(["engines.max_restarts=0"] if kill_one else []),
    )  # fmt: skip
    async with pools.engine(cfg, env=Talk) as engine:
        start = engine.epoch  # the shared engines' epoch: update k makes start + k
        finished = (await engine.stats())[0].requests_finished  # engine 0's, before this run (shared)
        base = load_file(f"{engine.model_path}/model.safetensors")
        weights = {start: base}
        engine.feed([Prompt(text=f"episode {i}: " + "y" * (20 + i * 3), id=f"e{i}") for i in range(PROMPTS)])
        episodes: list[Trajectory] = []

        async def consume() -> None:
            async for group in engine.groups():
                assert group.ok, group.error or [t.error for t in group.trajectories]
                episodes.extend(group.trajectories)

        consumer = asyncio.ensure_future(consume())
        land_inside(engine, lambda epoch: Talk.ended[epoch - 1].wait(), 6, lambda t, epoch: True, Talk.staged)
        try:
            for k in range(1, TURNS - 1):
                weights[start + k] = random_weights(base, seed=500 + k)
                assert await engine.update_weights(weights[start + k]) == start + k
                Talk.landed[k].set()
                if kill_one and k == 1:
                    await kill_mid_episode(engine, finished)
        finally:
            ungate(engine)
            for event in (*Talk.landed, *Talk.staged, *Talk.ended, Talk.hold):
                if event is not None:
                    event.set()
        await consumer
        return episodes, weights, engine


async def kill_mid_episode(engine: RolloutEngine, finished_before: int) -> None:
    """Kill engine 0 once a turn has finished on it (its episode has turns to go: no episode passes
    its second turn before `Talk.hold`), then let the episodes go on once it is out of rotation."""
    runner = engine._scheduler.runner
    async with asyncio.timeout(120):
        while (await engine.stats())[0].requests_finished <= finished_before:
            await asyncio.sleep(0.05)
        await kill(runner.engines[0], "actor")
        while runner.loads[0].healthy:
            await asyncio.sleep(0.05)
    Talk.hold.set()


# keep kills an engine for good (no restarts): last, so the shared pool it leaves behind is not needed again
@pytest.mark.parametrize("mode", sorted(MODES, key=lambda m: m == "keep"))
async def test_every_turn_of_every_episode_matches_the_oracle(pools, mode: str):
    episodes, weights, engine = await run(pools, mode, kill_one=mode == "keep")
    assert len(episodes) == EPISODES and all(len(e.turns) == TURNS and e.reward == TURNS for e in episodes)
    turns = [t for e in episodes for t in e.turns]
    seen = {epoch for t in turns for epoch in t.token_epochs()}
    assert seen == set(weights), seen
    between = [e for e in episodes if len({t.policy_epochs[0][1] for t in e.turns}) > 1]  # updates between its turns
    within = [t for t in turns if len(t.policy_epochs) > 1]  # ... and inside a turn
    assert len(between) >= 4 and (mode == "drain" or len(within) >= 4), (len(between), len(within))
    reused = [t for t in turns if t.kv_reused]
    # keep reuses across updates; recompute and abort_resume only within an epoch; drain clears the cache
    assert len(reused) >= (8 if mode == "keep" else 1), "turns must reuse the KV of the turns before"
    if mode == "keep":  # across an update: reused KV of older weights, recorded as such
        assert any(t.kv_epochs[0][1] < t.policy_epochs[0][1] for t in reused)
        killed = [
            e for e in episodes if any(t.engine_id == 0 for t in e.turns)
        ]  # engine 0 ran a turn of theirs, then died
        assert killed and all(len({t.engine_id for t in e.turns}) > 1 for e in killed), (
            "episodes of the killed engine went on elsewhere"
        )
    for e in episodes:
        for a, b in zip(e.turns, e.turns[1:]):  # token-exact: each prompt extends the one before
            assert b.prompt_token_ids[: len(a.prompt_token_ids) + len(a.token_ids)] == a.prompt_token_ids + a.token_ids

    oracle = Oracle(engine.model_path, weights)
    processing = Processing.of(engine.cfg.sampling, stop_ids=[2])
    report = await asyncio.to_thread(compare, oracle, episodes, 1e-3, 20, processing)
    assert report.tokens == sum(len(t.token_ids) for t in turns)
    assert report.ok, msgspec.json.encode(report).decode()[:2000]

    # Sharp: move the first epoch boundary inside a turn by one token, or (drain: no update inside a
    # turn) claim that a turn after an update reused one position of the KV its episode had before.
    if mode != "drain":
        e, k = next((e, k) for e in episodes for k, t in enumerate(e.turns) if shifted_boundary(t))
        bad_turn = shifted_boundary(e.turns[k])
    else:
        e, k = next(
            (e, k)
            for e in episodes
            for k in range(1, TURNS)
            if e.turns[k].policy_epochs[0][1] != e.turns[k - 1].policy_epochs[-1][1]
        )
        t = e.turns[k]
        assert t.kv_reused == 0  # drain clears the cache at an update: nothing of the old KV survives
        bad_turn = msgspec.structs.replace(t, kv_reused=1)
    bad = msgspec.structs.replace(e, turns=[*e.turns[:k], bad_turn, *e.turns[k + 1 :]])
    assert not (await asyncio.to_thread(compare, oracle, [bad], 1e-3, 20, processing)).ok
