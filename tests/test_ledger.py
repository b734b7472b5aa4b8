"""The epoch ledger under random timing: `VLLMPolicy` (its pieces, reruns, recompute points,
eviction records and progress reports) against a fake vLLM engine (`tests.support.fake_vllm`).

Each case draws prompts (shared within a group, so prefix-cache blocks are reused), chunk sizes,
step interleavings, eviction rates, and weight updates fired at random moments in one
`weight_sync.mode`. Every finished trajectory's logprobs must be reproduced by a replay of its
own `policy_epochs` and `kv_recomputes` (`fake_vllm.replay`), and so must every progress report
taken mid-run (what a crash keeps). Hundreds of cases in a few seconds.
"""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from policies.vllm_policy import VLLMPolicy
from rollout.config import load_config
from rollout.epochs import kv_runs
from rollout.errors import EngineDeadError
from rollout.types import ProgressReport, Request, Sampling, Trajectory
from tests.support.fake_vllm import FakeVllm, replay, replay_episode

MODES = ["keep", "recompute", "abort_resume", "drain"]
CASES = 60  # per mode


def check(t: Trajectory, where: str) -> None:
    check_record(t, where)
    assert replay(t) == t.logprobs, (where, t.request_id, t.policy_epochs, t.kv_recomputes)


def check_record(t: Trajectory, where: str) -> None:
    assert t.finish_reason != "error", (where, t.error)
    assert len(t.logprobs) == len(t.token_ids), where
    if t.token_ids:
        starts = [s for s, _ in t.policy_epochs]
        assert starts[0] == 0 and starts == sorted(set(starts)), (where, t.policy_epochs)
        epochs = [e for _, e in t.policy_epochs]
        assert epochs == sorted(epochs), (where, t.policy_epochs)


async def run_case(seed: int, mode: str) -> tuple[list[Trajectory], FakeVllm, VLLMPolicy]:
    rng = random.Random(seed)
    fake = FakeVllm(
        rng, evict_p=rng.choice([0.0, 0.01, 0.05]), chunk=rng.randrange(2, 12), capacity=rng.randrange(2, 12)
    )
    cfg = load_config(
        None, [f"weight_sync.mode={mode}", "engines.queued_per_engine=4", "engines.max_inflight_per_engine=8"]
    )
    policy = VLLMPolicy(cfg, "", 0, frontend=fake)
    await policy.ready()
    groups = []
    for g in range(rng.randrange(2, 6)):
        prompt = [rng.randrange(4, 200) for _ in range(rng.randrange(1, 24))]
        sampling = Sampling(n=rng.randrange(1, 4), max_tokens=rng.randrange(1, 40), stop_token_ids=[])
        groups.append([Request(f"r{g}-{k}", f"p{g}", k, sampling, token_ids=prompt) for k in range(sampling.n)])
    tasks = [asyncio.ensure_future(policy.finish_group(reqs)) for reqs in groups]
    reports: list[Trajectory] = []
    epoch = 0
    while not all(t.done() for t in tasks):
        for _ in range(rng.randrange(1, 30)):
            await asyncio.sleep(0)
        if rng.random() < 0.5:
            reports.extend(ProgressReport(policy.progress()).values())
        if rng.random() < 0.3 and epoch < 6:
            epoch += 1
            await policy.stage_weights(epoch, "weights-dir")
            await policy.commit_weights(epoch)
    trajectories = [t for task in tasks for t in task.result()]
    fake.shutdown()
    return trajectories, fake, policy


@pytest.mark.parametrize("mode", MODES)
async def test_random_updates_aborts_and_evictions_keep_every_logprob_replayable(mode: str) -> None:
    totals = {"tokens": 0, "straddling": 0, "evictions": 0, "recomputes": 0, "reruns": 0}
    for seed in range(CASES):
        trajectories, fake, policy = await run_case(seed * 7919 + len(mode), mode)
        for t in trajectories:
            check(t, f"seed {seed}")
            assert t.kv_epochs == kv_runs(len(t.prompt_token_ids), len(t.token_ids), t.policy_epochs, t.kv_recomputes)
            assert t.num_preemptions == len(t.kv_recomputes)
            if mode == "drain":  # no update inside a request: an epoch changes only where an evicted one resumed
                assert {s for s, _ in t.policy_epochs[1:]} <= {j for j, _ in t.kv_recomputes}, t
            if mode == "keep" and not fake.evictions:
                assert not t.kv_recomputes, t
        stats = await policy.stats()
        assert stats.preemptions == fake.evictions
        totals["tokens"] += sum(len(t.token_ids) for t in trajectories)
        totals["straddling"] += sum(len(t.policy_epochs) > 1 for t in trajectories)
        totals["evictions"] += fake.evictions
        totals["recomputes"] += sum(len(t.kv_recomputes) for t in trajectories)
        totals["reruns"] += stats.reruns
    # the cases must exercise what they are about
    assert totals["tokens"] > 1000 and totals["evictions"] > 20, totals
    if mode != "drain":
        assert totals["straddling"] > 20 and totals["recomputes"] > 20, totals


async def test_progress_reports_taken_mid_run_replay_exactly() -> None:
    seen = 0
    for seed in range(40):
        mode = MODES[seed % 3]
        rng = random.Random(seed)
        fake = FakeVllm(rng, evict_p=0.02, chunk=4, capacity=6)
        policy = VLLMPolicy(load_config(None, [f"weight_sync.mode={mode}"]), "", 0, frontend=fake)
        await policy.ready()
        reqs = [
            Request(f"r{k}", "p", k, Sampling(n=3, max_tokens=30, stop_token_ids=[]), token_ids=[5, 6, 7, 8, 9])
            for k in range(3)
        ]
        task = asyncio.ensure_future(policy.finish_group(reqs))
        epoch = 0
        while not task.done():
            for _ in range(rng.randrange(1, 20)):
                await asyncio.sleep(0)
            for t in ProgressReport(policy.progress()).values():
                check(t, f"report, seed {seed}")
                seen += len(t.token_ids)
            if rng.random() < 0.3:
                epoch += 1
                await policy.stage_weights(epoch, "d")
                await policy.commit_weights(epoch)
        fake.shutdown()
    assert seen > 500


@pytest.mark.parametrize("mode", MODES)
async def test_streamed_tokens_are_the_finished_trajectorys_with_the_same_epochs(mode: str) -> None:
    """What a streamed sample sends after each step (`VLLMPolicy.deltas`) under random updates,
    aborts, reruns and evictions: every token once, in order, each delta a prefix of the finished
    trajectory, whose epoch records, so far, replay exactly (a token its trajectory later drops,
    a rerun piece's, is never sent)."""
    sent_tokens = 0
    for seed in range(30):
        rng = random.Random(seed * 31 + len(mode))
        fake = FakeVllm(rng, evict_p=rng.choice([0.0, 0.03]), chunk=rng.randrange(2, 8), capacity=rng.randrange(2, 6))
        policy = VLLMPolicy(load_config(None, [f"weight_sync.mode={mode}"]), "", 0, frontend=fake)
        await policy.ready()
        sampling = Sampling(n=3, max_tokens=rng.randrange(5, 30), stop_token_ids=[])
        reqs = [Request(f"r{k}", "p", k, sampling, token_ids=[5, 6, 7, 8, 9], stream=True) for k in range(3)]
        task = asyncio.ensure_future(policy.finish_group(reqs))
        streamed: dict[str, Trajectory] = {}
        epoch = 0

        def take() -> None:
            for rid, start, part in policy.deltas():
                so_far = streamed.setdefault(rid, Trajectory(request_id=rid, prompt_token_ids=[5, 6, 7, 8, 9]))
                assert start == len(so_far.token_ids), (seed, rid, start, len(so_far.token_ids))
                so_far.token_ids = list(so_far.token_ids) + list(part.token_ids)
                so_far.logprobs = list(so_far.logprobs) + list(part.logprobs)
                so_far.policy_epochs, so_far.kv_recomputes = part.policy_epochs, part.kv_recomputes
                check(so_far, f"stream, seed {seed}")

        while not task.done():
            for _ in range(rng.randrange(1, 10)):
                await asyncio.sleep(0)
            take()
            if rng.random() < 0.3:
                epoch += 1
                await policy.stage_weights(epoch, "d")
                await policy.commit_weights(epoch)
        for t in task.result():
            so_far = streamed.get(t.request_id)
            n = len(so_far.token_ids) if so_far else 0
            sent_tokens += n
            assert list(t.token_ids[:n]) == (so_far.token_ids if so_far else []), (seed, t.request_id)
            assert list(t.logprobs[:n]) == (so_far.logprobs if so_far else [])
            if so_far:
                assert [(s, e) for s, e in t.policy_epochs if s < n] == [tuple(r) for r in so_far.policy_epochs]
        assert not policy._sent  # nothing kept for a finished sample
        fake.shutdown()
    assert sent_tokens > 300, sent_tokens


async def test_a_progress_report_leaves_out_samples_that_produced_nothing_yet() -> None:
    """A crash keeps what a report has; of a sample still waiting in vLLM's queue there is nothing
    to keep (the driver runs it again from its prompt), so a report does not carry it: at a full
    queue that was ~40% of every report's snapshots and bytes."""
    fake = FakeVllm(random.Random(3), chunk=4, capacity=1)
    policy = VLLMPolicy(load_config(None), "", 0, frontend=fake)
    await policy.ready()
    reqs = [
        Request(f"r{k}", "p", k, Sampling(n=2, max_tokens=400, stop_token_ids=[]), token_ids=[5, 6, 7, 8])
        for k in range(2)
    ]
    task = asyncio.ensure_future(policy.finish_group(reqs))
    while not (report := ProgressReport(policy.progress())):
        await asyncio.sleep(0)
    running = next(iter(report))
    assert list(report) == [running] and report[running].token_ids, "the waiting sample is not in the report"
    assert len(policy._samples) == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    fake.shutdown()


async def test_a_progress_report_leaves_out_samples_that_finished() -> None:
    """A finished sample went to the driver in a results frame (`policies.group_calls`), ahead of
    any later report on the same socket, so a report does not carry it again while the rest of
    its group runs (a copy of every token of it, in every report)."""
    fake = FakeVllm(random.Random(3), chunk=4, capacity=2)
    policy = VLLMPolicy(load_config(None), "", 0, frontend=fake)
    await policy.ready()
    reqs = [
        Request(f"r{k}", "p", k, Sampling(n=2, max_tokens=m, stop_token_ids=[]), token_ids=[5, 6, 7, 8])
        for k, m in enumerate([2, 400])
    ]
    stream = policy.stream_group(reqs)
    first = await anext(stream)
    assert first.request_id == "r0" and first.finished_at
    while not (report := ProgressReport(policy.progress())):
        await asyncio.sleep(0)
    assert list(report) == ["r1"] and not report["r1"].finished_at
    await stream.aclose()
    fake.shutdown()


async def test_once_vllm_died_a_progress_report_fails_instead_of_dropping_the_tokens_it_had() -> None:
    """A crash keeps the engine's last progress report. A report asked for after its engine core
    died (the actor lives on) must fail, not answer with its samples stripped of the running
    pieces' tokens: that would replace the last good report, and the samples would restart from 0."""
    fake = FakeVllm(random.Random(3), chunk=4, capacity=4)
    policy = VLLMPolicy(load_config(None), "", 0, frontend=fake)
    await policy.ready()
    reqs = [
        Request(f"r{k}", "p", k, Sampling(n=2, max_tokens=400, stop_token_ids=[]), token_ids=[5, 6, 7, 8])
        for k in range(2)
    ]
    task = asyncio.ensure_future(policy.finish_group(reqs))
    while sum(len(t.token_ids) >= 3 for t in ProgressReport(policy.progress()).values()) < 2:
        await asyncio.sleep(0)
    fake.die()
    await asyncio.sleep(0)  # the pieces' calls see the death; the group's call has not ended yet
    with pytest.raises(EngineDeadError, match="engine core died"):
        policy.progress()
    with pytest.raises(EngineDeadError):
        await task
    with pytest.raises(EngineDeadError, match="engine core died"):
        policy.progress()


async def test_the_replay_is_sharp() -> None:
    """Moving one epoch boundary, or dropping a recompute record, changes the replayed logprobs."""
    trajectories, _, _ = await run_case(11, "recompute")
    moved = [t for t in trajectories if len(t.policy_epochs) > 1 and len(t.token_ids) > t.policy_epochs[1][0] + 1]
    assert moved
    t = moved[0]
    (s0, e0), (s1, e1) = t.policy_epochs[:2]
    shifted = msgspec.structs.replace(t, policy_epochs=[(s0, e0), (s1 + 1, e1), *t.policy_epochs[2:]])
    assert replay(shifted) != t.logprobs
    dropped = msgspec.structs.replace(t, kv_recomputes=t.kv_recomputes[1:])
    assert t.kv_recomputes and replay(dropped) != t.logprobs


async def test_a_retry_on_the_same_engine_does_not_collide_with_its_cancelled_attempt() -> None:
    """The scheduler may send a group's samples to the engine they just left (a request timeout);
    the cancelled attempt's vLLM requests and progress entries must not clash with the new one."""
    rng = random.Random(3)
    fake = FakeVllm(rng, chunk=4, capacity=4)
    policy = VLLMPolicy(load_config(None), "", 0, frontend=fake)
    await policy.ready()
    reqs = [
        Request(f"r1-{k}", "p", k, Sampling(n=2, max_tokens=400, stop_token_ids=[]), token_ids=[5, 6]) for k in range(2)
    ]
    first = asyncio.ensure_future(policy.finish_group(reqs))
    while fake.steps < 5:
        await asyncio.sleep(0)
    second = asyncio.ensure_future(policy.finish_group(reqs))  # the retry arrives before the cancel
    await asyncio.sleep(0)
    first.cancel()
    trajectories = await second
    assert sorted(t.sample_index for t in trajectories) == [0, 1] and all(t.ok for t in trajectories)
    for t in trajectories:
        check(t, "retry")
    fake.shutdown()


async def run_episodes(seed: int, mode: str) -> tuple[list[list[Trajectory]], FakeVllm]:
    """A few episodes of several turns each (observations appended between turns), with updates
    and evictions at random moments; each turn passes on the salt its turn before reported."""
    rng = random.Random(seed)
    fake = FakeVllm(rng, evict_p=rng.choice([0.0, 0.02]), chunk=rng.randrange(2, 10), capacity=rng.randrange(2, 8))
    policy = VLLMPolicy(load_config(None, [f"weight_sync.mode={mode}"]), "", 0, frontend=fake)
    await policy.ready()

    async def episode(e: int) -> list[Trajectory]:
        context, salt, turns = [rng.randrange(4, 200) for _ in range(rng.randrange(1, 12))], f"ep{e}", []
        for k in range(rng.randrange(1, 5)):
            req = Request(f"e{e}t{k}", f"e{e}", 0, Sampling(n=1, max_tokens=rng.randrange(1, 16), stop_token_ids=[]),
                          token_ids=context, cache_salt=salt)  # fmt: skip
            (turn,) = await policy.finish_group([req])
            turns.append(turn)
            context = context + turn.token_ids + [rng.randrange(4, 200) for _ in range(rng.randrange(1, 9))]
            salt = turn.cache_salt
            for _ in range(rng.randrange(0, 10)):  # the environment's step
                await asyncio.sleep(0)
        return turns

    tasks = [asyncio.ensure_future(episode(e)) for e in range(rng.randrange(1, 5))]
    epoch = 0
    while not all(t.done() for t in tasks):
        for _ in range(rng.randrange(1, 30)):
            await asyncio.sleep(0)
        if rng.random() < 0.3 and epoch < 6:
            epoch += 1
            await policy.stage_weights(epoch, "d")
            await policy.commit_weights(epoch)
    fake.shutdown()
    return [t.result() for t in tasks], fake


@pytest.mark.parametrize("mode", MODES)
async def test_episodes_reuse_the_kv_of_earlier_turns_exactly(mode: str) -> None:
    reused = tokens = 0
    for seed in range(CASES):
        episodes, _ = await run_episodes(seed * 31 + len(mode), mode)
        for turns in episodes:
            for t in turns:
                check_record(t, f"seed {seed}")
            assert replay_episode(turns) == [t.logprobs for t in turns], f"seed {seed}"
            reused += sum(t.kv_reused for t in turns)
            tokens += sum(len(t.token_ids) for t in turns)
    assert tokens > 500 and reused > 200, (tokens, reused)  # turns did reuse KV across updates


def test_a_span_that_covers_no_delivered_token_leaves_no_run():
    """vLLM may label a step whose token never reached us (an evicted piece's last step, or a
    piece that ended with nothing): an epoch run over no token is no run. Before, such a span
    became a run at the very end, `[(0, 0), (200, 1)]` for 200 tokens, which no reader accepts."""
    from policies.ledger import merge_piece

    traj = Trajectory(
        request_id="r",
        prompt_id="p",
        prompt_token_ids=[5, 6],
        token_ids=[7] * 200,
        logprobs=[-1.0] * 200,
        policy_epochs=[(0, 0)],
    )
    merge_piece(traj, [(0, 1)], [], [], "drain")  # a continuation that produced nothing
    merge_piece(traj, [(0, 0), (3, 1)], [8, 9, 10], [-1.0] * 3, "keep")  # its second span starts past its tokens
    assert traj.policy_epochs == [(0, 0)] and traj.kv_recomputes == [(200, 0)]
    assert traj.token_epochs() == [0] * 203


async def test_a_turn_moved_to_another_engine_keeps_the_kv_it_reused() -> None:
    """An episode's turn continued on another engine (its first died mid-turn) resumes from the
    first engine's progress report: the positions it reused there are still the KV of the turns
    before, so its `kv_reused` is the report's (it was 0: the oracle then recomputed the history,
    and every token generated before the move mismatched)."""
    sampling = Sampling(n=1, max_tokens=40, stop_token_ids=[])
    first = VLLMPolicy(load_config(None), "", 0, frontend=FakeVllm(random.Random(7), chunk=2, capacity=4))
    await first.ready()
    context = list(range(4, 40))
    (t0,) = await first.finish_group(
        [Request("t0", "e", 0, msgspec.structs.replace(sampling, max_tokens=8), token_ids=context, cache_salt="ep")]
    )
    context = context + t0.token_ids + [9, 9]
    turn = Request("t1", "e", 0, sampling, token_ids=context, cache_salt=t0.cache_salt)
    running = asyncio.ensure_future(first.finish_group([turn]))
    partial = None
    while partial is None or len(partial.token_ids) < 4:
        await asyncio.sleep(0)
        partial = ProgressReport(first.progress()).get("t1")
    running.cancel()
    assert partial.kv_reused > 0
    second = VLLMPolicy(load_config(None), "", 1, frontend=FakeVllm(random.Random(8), chunk=2, capacity=4))
    await second.ready()
    (t1,) = await second.finish_group([msgspec.structs.replace(turn, resume=partial)])
    assert t1.token_ids[: len(partial.token_ids)] == partial.token_ids and len(t1.token_ids) == 40
    assert t1.kv_reused == partial.kv_reused
