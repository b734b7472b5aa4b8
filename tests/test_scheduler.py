"""The scheduler and the public API end to end, on fake engines (no vLLM, no Ray).

Every wait is on an event or a condition, bounded by `anyio.fail_after`. Where a test must show that
something does *not* happen (no more admissions), it waits until every task is blocked
(`tests.support.fake_engine_runs.settled`): the fakes have no timers, so nothing could wake them later.
"""

from __future__ import annotations

import functools

import anyio
import msgspec
import pytest

from rollout.engine import RolloutEngine
from rollout.errors import EngineDeadError
from rollout.sync_engine import SyncRolloutEngine
from rollout.types import Prompt
from tests.support.fake_engine_runs import TIMEOUT, all_groups, prompts, rollout, settled, total_requests
from tests.support.fakes import FakePool, fake_logprob, fake_token

# Small engines: 3 requests running and 1 queued on each (the room tests below count with it).
ROOM = ("engines.max_inflight_per_engine=3", "engines.queued_per_engine=1")


@pytest.fixture
def small_cfg(make_cfg):
    """`make_cfg` with ROOM: 4 requests per engine, so a few prompts fill both engines."""
    return functools.partial(make_cfg, *ROOM)


async def test_every_sample_completes_exactly_once(small_cfg):
    pool = FakePool(2)
    seen = []
    cfg = small_cfg("sampling.n=3", "engines.max_inflight_per_engine=6")
    async with rollout(cfg, pool, on_trajectory=seen.append) as engine:
        engine.feed(prompts(10))
        groups = await all_groups(engine)
    assert sorted(g.prompt_id for g in groups) == [f"q{i}" for i in range(10)]
    assert total_requests(pool) == 30
    request_ids = [r.request_id for e in pool.engines for r in e.requests]
    assert len(set(request_ids)) == 30
    assert len(seen) == 30 and {t.request_id for t in seen} == set(request_ids)
    for g in groups:
        assert g.ok and g.error is None
        assert [t.sample_index for t in g.trajectories] == [0, 1, 2]
        assert len({t.engine_id for t in g.trajectories}) == 1  # a group runs on one engine
        for t in g.trajectories:
            assert t.prompt_id == g.prompt_id
            assert t.prompt_token_ids == g.prompt.token_ids
            assert t.token_ids == [fake_token(t.prompt_token_ids, t.sample_index, i) for i in range(6)]
            assert t.logprobs == [fake_logprob(tok, i) for i, tok in enumerate(t.token_ids)]
            assert t.finish_reason == "length"
            assert t.queued_at > 0
    assert pool.shutdown_calls == 1


async def test_load_is_spread_and_capped_per_engine(small_cfg):
    pool = FakePool(2)
    gate = anyio.Event()
    for e in pool.engines:
        e.gate = gate
    async with rollout(small_cfg(), pool) as engine:  # n=2, 4 in flight per engine
        engine.feed(prompts(6))
        for e in pool.engines:
            await e.wait_until(lambda e: e.inflight == 4)
        await settled()
        # 2 groups per engine; the other 2 prompts wait for room
        assert [len(e.prompt_ids) for e in pool.engines] == [2, 2]
        assert [e.max_inflight for e in pool.engines] == [4, 4]
        gate.set()
        groups = await all_groups(engine)
    assert len(groups) == 6 and all(g.ok for g in groups)
    assert total_requests(pool) == 12
    assert all(e.max_inflight <= 4 for e in pool.engines)
    assert all(e.cancelled == 0 for e in pool.engines)


async def test_queued_requests_add_room_per_engine(small_cfg):
    pool = FakePool(2)
    gate = anyio.Event()
    for e in pool.engines:
        e.gate = gate
    async with rollout(small_cfg("engines.queued_per_engine=3"), pool) as engine:  # 3 + 3 per engine
        engine.feed(prompts(8))
        for e in pool.engines:
            await e.wait_until(lambda e: e.inflight == 6)
        await settled()
        assert [len(e.prompt_ids) for e in pool.engines] == [3, 3]  # the other 2 prompts wait for room
        gate.set()
        groups = await all_groups(engine)
    assert len(groups) == 8 and all(g.ok for g in groups)
    assert all(e.max_inflight == 6 for e in pool.engines)


async def test_waiting_groups_start_longest_budget_first(small_cfg):
    """Groups admitted while every engine is full start in the order of their token budget,
    longest first (arrival order among equals), not the order they were read: the long samples of a
    long-tailed set then run alongside the short ones instead of alone at the end."""
    pool = FakePool(2)
    gate = anyio.Event()
    started: list[str] = []  # every request either engine received, in order
    for e in pool.engines:
        e.gate, e.requests = gate, started
    cfg = small_cfg("sampling.max_tokens=16", "model.max_model_len=128", "queue.max_groups=10")  # every prompt admitted
    async with rollout(cfg, pool) as engine:
        engine.feed(prompts(4))  # fill both engines (2 groups of 2 each)
        for e in pool.engines:
            await e.wait_until(lambda e: e.inflight == 4)
        budgets = [2, 2, 16, 2, 8, 16]
        engine.feed([Prompt(token_ids=[40 + i] * 3, id=f"w{i}-{b}", sampling={"max_tokens": b})
                     for i, b in enumerate(budgets)])  # fmt: skip
        await settled()
        gate.set()
        groups = await all_groups(engine)
    assert len(groups) == 10 and all(g.ok for g in groups)
    waited = list(dict.fromkeys(r.prompt_id for r in started if r.prompt_id.startswith("w")))
    assert waited == ["w2-16", "w5-16", "w4-8", "w0-2", "w1-2", "w3-2"]


async def test_a_submission_waits_in_the_lobby_no_deeper_than_max_groups(small_cfg):
    """A caller's submission takes no learner queue slots: its prompts are read into the lobby only
    while fewer than `queue.max_groups` groups wait there, not all at once (a task each)."""
    pool = FakePool(2)
    gate = anyio.Event()
    for e in pool.engines:
        e.gate = gate
    async with rollout(small_cfg("queue.max_groups=3"), pool) as engine:
        sub = engine.submit(prompts(12), train=False)  # 4 start (2 per engine), at most 3 wait
        for e in pool.engines:
            await e.wait_until(lambda e: e.inflight == 4)
        await settled()
        assert len(engine._live_scheduler().lobby) == 3
        gate.set()
        with anyio.fail_after(TIMEOUT):
            done = await sub.result()
    assert len(done) == 12 and all(g.ok for g in done)


async def test_group_members_share_an_engine_under_load(small_cfg):
    pool = FakePool(2)
    async with rollout(small_cfg("sampling.n=4", "engines.max_inflight_per_engine=4"), pool) as engine:
        engine.feed(prompts(8))
        groups = await all_groups(engine)
    by_engine = {e.engine_id: {r.prompt_id for r in e.requests} for e in pool.engines}
    assert by_engine[0] and by_engine[1] and not (by_engine[0] & by_engine[1])
    assert all(len({t.engine_id for t in g.trajectories}) == 1 for g in groups)


async def test_backpressure_stops_admission_when_nobody_consumes(small_cfg):
    pool = FakePool(2)
    async with rollout(small_cfg("queue.max_groups=2"), pool) as engine:
        engine.feed(prompts(5))
        await settled()
        assert sum(len(e.prompt_ids) for e in pool.engines) == 2  # engines had room for 4 groups
        first = await engine.next_group()  # frees one slot
        assert first is not None and first.ok
        await settled()
        assert sum(len(e.prompt_ids) for e in pool.engines) == 3
        rest = await all_groups(engine)
    assert len(rest) == 4
    assert total_requests(pool) == 10


async def test_leaving_the_context_cancels_in_flight_requests(small_cfg):
    pool = FakePool(2)
    for e in pool.engines:
        e.block()
    async with rollout(small_cfg(), pool) as engine:
        engine.feed(prompts(3))
        await pool.engines[0].wait_until(lambda e: e.inflight == 4)
        await pool.engines[1].wait_until(lambda e: e.inflight == 2)
    assert [e.cancelled for e in pool.engines] == [4, 2]
    assert [e.inflight for e in pool.engines] == [0, 0]
    assert [e.finished for e in pool.engines] == [0, 0]
    assert pool.shutdown_calls == 1


async def test_an_error_in_the_body_cancels_and_shuts_down(small_cfg):
    pool = FakePool(1)
    pool.engines[0].block()
    with pytest.raises(RuntimeError, match="learner crashed"):
        async with rollout(small_cfg(), pool) as engine:
            engine.feed(prompts(1))
            await pool.engines[0].wait_until(lambda e: e.inflight == 2)
            raise RuntimeError("learner crashed")
    assert pool.engines[0].cancelled == 2
    assert pool.shutdown_calls == 1


async def test_a_dead_engines_samples_move_on_and_it_is_avoided(small_cfg):
    pool = FakePool(2)
    dead, alive = pool.engines
    dead.dead = True
    async with rollout(small_cfg("engines.max_restarts=0"), pool) as engine:
        engine.feed(prompts(1))  # idle engines tie: the lower index takes it
        [first] = await all_groups(engine)
        assert first.ok and [t.sample_index for t in first.trajectories] == [0, 1]
        assert all(t.engine_id == 1 and t.num_preemptions == 0 for t in first.trajectories)  # nothing to resume

        engine.feed([Prompt(token_ids=[5 + i], id=f"after{i}") for i in range(4)])
        later = await all_groups(engine)
    assert len(later) == 4 and all(g.ok for g in later)
    assert all(t.engine_id == 1 for g in later for t in g.trajectories)
    assert len(dead.requests) == 2 and dead.failed == 2
    assert len(alive.requests) == 2 + 8


async def test_samples_fail_with_the_reason_once_retries_run_out(small_cfg):
    pool = FakePool(2)
    for e in pool.engines:
        e.dead = True
    async with rollout(small_cfg("engines.max_restarts=0", "engines.max_retries=1"), pool) as engine:
        engine.feed(prompts(1))
        with pytest.raises(EngineDeadError, match="every engine is dead"):
            await all_groups(engine)


async def test_all_engines_dead_raises_instead_of_hanging(small_cfg):
    pool = FakePool(1)
    pool.engines[0].dead = True
    cfg = small_cfg("engines.count=1", "engines.max_inflight_per_engine=2", "engines.max_restarts=0")
    async with rollout(cfg, pool) as engine:
        engine.feed(prompts(3))  # one group fits at a time; the second waits for the dead engine
        with pytest.raises(EngineDeadError):
            await all_groups(engine)


async def test_prompt_n_above_engine_capacity_fails_the_group(small_cfg):
    def source():
        yield {"token_ids": [5], "id": "too-wide", "sampling": {"n": 5}}  # engines hold 4 each
        yield {"token_ids": [5], "id": "fine"}

    async with rollout(small_cfg(), FakePool(2)) as engine:
        engine.feed(source())
        groups = {g.prompt_id: g for g in await all_groups(engine)}
    assert groups["too-wide"].error and "sampling.n" in groups["too-wide"].error
    assert groups["fine"].ok


async def test_batches_awaited_and_iterated(small_cfg):
    async with rollout(small_cfg(), FakePool(2)) as engine:
        engine.feed(prompts(5))
        first = await engine.batches(groups=2)
        assert first is not None and len(first.groups) == 2
        sizes = [len(b.groups) async for b in engine.batches(groups=2)]
        assert sizes == [2, 1]
        assert await engine.batches(groups=2) is None
    tensors = first.to_tensors()
    assert tensors["input_ids"].shape == (4, 3 + 6)  # 2 groups x n=2 rows, prompt 3 + 6 generated
    assert tensors["loss_mask"].sum().item() == 4 * 6


@pytest.mark.parametrize(
    "size, message", [(0, "groups: expected >= 1, got 0"), (-1, "expected >= 1"), (9, "queue.max_groups is 8")]
)
async def test_batches_of_impossible_size_raise(small_cfg, size, message):
    async with rollout(small_cfg("queue.max_groups=8"), FakePool(1)) as engine:
        with pytest.raises(ValueError, match=message):
            engine.batches(groups=size)
        with pytest.raises(ValueError, match=message):
            await engine.next_batch(size)


async def test_stats_come_from_every_engine(small_cfg):
    pool = FakePool(2)
    async with rollout(small_cfg(), pool) as engine:
        engine.feed(prompts(2))
        await all_groups(engine)
        stats = await engine.stats()
    assert [s.engine_id for s in stats] == [0, 1]
    assert sum(s.requests_finished for s in stats) == 4


async def test_bad_model_path_fails_on_enter(tmp_path, small_cfg):
    cfg = small_cfg()
    cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=str(tmp_path / "nope")))
    with pytest.raises(FileNotFoundError, match="model.path"):
        async with RolloutEngine(cfg, pool=FakePool(1)):
            pass


async def test_feed_outside_the_context_is_an_error(small_cfg):
    engine = RolloutEngine(small_cfg(), pool=FakePool(1))
    with pytest.raises(RuntimeError, match="async with"):
        engine.feed(prompts(1))


def test_sync_engine(small_cfg):
    pool = FakePool(2)
    with SyncRolloutEngine(small_cfg(), pool=pool) as engine:
        engine.feed(prompts(3))
        groups = list(engine.groups())
        assert sorted(g.prompt_id for g in groups) == ["q0", "q1", "q2"]
        assert all(g.ok for g in groups)
        engine.feed(prompts(3))
        batch = engine.batch(groups=2)
        assert batch is not None and len(batch.groups) == 2
        assert len(engine.batch(groups=2).groups) == 1
        assert engine.batch(groups=2) is None
        assert [s.engine_id for s in engine.stats()] == [0, 1]
    assert total_requests(pool) == 12
    assert pool.shutdown_calls == 1
