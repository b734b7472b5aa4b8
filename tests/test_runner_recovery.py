"""Nothing lost when an engine dies or hangs (`rollout.scheduling.runner`): samples resume elsewhere
from the last progress report, hung engines are killed by the health check, dead ones restart at the
current epoch."""

from __future__ import annotations

import functools

import anyio
import pytest
import torch
from safetensors.torch import save_file

from rollout.engine import RolloutEngine
from rollout.errors import EngineDeadError
from rollout.types import Prompt
from tests.support.fakes import FakeEngine, FakePool
from tests.support.model import STATE

TIMEOUT = 5


@pytest.fixture
def recovery_cfg(make_cfg):
    """`make_cfg` with samples of 8 tokens, a health check every 10 ms and restarts without backoff."""
    return functools.partial(
        make_cfg, "sampling.max_tokens=8", "engines.health_interval_s=0.01", "engines.restart_backoff_s=0"
    )


PROMPT = Prompt(token_ids=[7, 8, 9], id="p")


async def reference(recovery_cfg) -> list[list[int]]:
    """The group's tokens when nothing goes wrong."""
    async with RolloutEngine(recovery_cfg(), pool=FakePool(2)) as engine:
        engine.feed([PROMPT])
        return [t.token_ids for t in (await engine.next_group()).trajectories]


async def test_samples_continue_on_another_engine_from_the_last_report(recovery_cfg):
    want = await reference(recovery_cfg)
    pool = FakePool(2)
    doomed = pool.engines[0]
    doomed.reported_tokens = 3
    doomed.block()
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(recovery_cfg("engines.max_restarts=0"), pool=pool) as engine:
            engine.feed([PROMPT])
            await doomed.wait_until(lambda e: e.inflight == 2)
            while sum(len(r) for r in engine._scheduler.runner.reports) < 2:  # both samples reported at least once
                await anyio.sleep(0.01)
            await doomed.kill()
            group = await engine.next_group()
    assert group.ok and [t.token_ids for t in group.trajectories] == want  # nothing lost, nothing doubled
    for t in group.trajectories:
        assert t.engine_id == 1
        assert t.kv_recomputes == [(3, 0)] and t.num_preemptions == 1  # the KV before token 3 was recomputed
        assert t.policy_epochs == [(0, 0)] and len(t.logprobs) == len(t.token_ids)
    assert [len(r.resume.token_ids) for r in pool.engines[1].requests] == [3, 3]


async def test_a_hung_engine_is_killed_by_the_health_check(recovery_cfg):
    pool = FakePool(2)
    hung = pool.engines[0]
    hung.block()
    hung.hang_progress = True
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(
            recovery_cfg("engines.health_timeout_s=0.05", "engines.max_restarts=0"), pool=pool
        ) as engine:
            engine.feed([PROMPT])
            group = await engine.next_group()
    assert hung.killed and group.ok and all(t.engine_id == 1 for t in group.trajectories)


async def test_an_engine_slow_to_report_holds_back_no_other_engines_report(recovery_cfg):
    """Each engine reports on its own beat: while engine 0's report hangs (not yet past the health
    timeout), engine 1's requests that started meanwhile are still reported, so a crash of engine 1
    would keep their tokens."""
    pool = FakePool(2)
    slow, other = pool.engines
    slow.hang_progress = True
    for e in pool.engines:
        e.block()
    other.reported_tokens = 3
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(recovery_cfg("engines.health_timeout_s=60"), pool=pool) as engine:
            runner = engine._scheduler.runner
            await anyio.sleep(0.05)  # both engines' first reports are asked for (engine 0's never comes)
            engine.feed([Prompt(token_ids=[7, 8, i], id=f"p{i}") for i in range(4)])
            await other.wait_until(lambda e: e.inflight > 0)
            while not any(t.token_ids for t in runner.reports[1].values()):
                await anyio.sleep(0.01)
            assert set(runner.reports[1]) == set(other.held)
            for e in pool.engines:
                e.gate.set()


async def test_a_stuck_group_is_retried_elsewhere_then_failed_with_the_reason(recovery_cfg):
    pool = FakePool(2)
    for e in pool.engines:
        e.block()  # alive and healthy, but nothing ever finishes
    with anyio.fail_after(TIMEOUT):
        cfg = recovery_cfg("engines.request_timeout_s=0.05", "engines.max_retries=2")
        async with RolloutEngine(cfg, pool=pool) as engine:
            engine.feed([PROMPT])
            group = await engine.next_group()
    assert not group.ok
    assert all("engines.request_timeout_s=0.05" in t.error and "moved 2 times" in t.error for t in group.trajectories)
    assert sum(len(e.requests) for e in pool.engines) == sum(e.cancelled for e in pool.engines) == 2 * 3
    assert not any(e.killed for e in pool.engines)  # slow is not dead


async def test_a_dead_engine_restarts_at_the_current_epoch_and_serves_again(recovery_cfg):
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(recovery_cfg(), pool=pool) as engine:
            await engine.update_weights(STATE)
            await engine.update_weights(STATE)
            old = pool.engines[0]
            await old.kill()
            engine.feed([PROMPT])  # runs on engine 1 meanwhile, or on 0 once it is back
            assert (await engine.next_group()).ok
            while not engine._scheduler.runner.loads[0].healthy:
                await anyio.sleep(0.01)
            new = pool.engines[0]
            assert new is not old and pool.restarts == [0]
            assert new.commits == [2] and new.epoch == 2  # brought to the current epoch before readmission
            assert engine._scheduler.runner.engines[0] is new
            pool.engines[1].dead = True  # now only the restarted engine can serve
            engine.feed([Prompt(token_ids=[5], id="q")])
            group = await engine.next_group()
    assert group.ok and all(t.engine_id == 0 and t.policy_epochs == [(0, 2)] for t in group.trajectories)


async def test_restarts_are_bounded_then_the_engine_is_given_up(recovery_cfg):
    pool = FakePool(1)
    pool.fail_restart = True
    pool.engines[0].dead = True
    with anyio.fail_after(TIMEOUT):
        cfg = recovery_cfg("engines.count=1", "engines.max_restarts=2")
        async with RolloutEngine(cfg, pool=pool) as engine:
            engine.feed([PROMPT])
            with pytest.raises(EngineDeadError, match="every engine is dead"):
                await engine.next_group()
    assert engine._updates._restarts == {0: 2}


async def test_with_every_engine_restarting_admission_waits_instead_of_failing(recovery_cfg):
    pool = FakePool([FakeEngine(0)])
    pool.engines[0].dead = True
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(recovery_cfg("engines.count=1"), pool=pool) as engine:
            engine.feed([PROMPT, Prompt(token_ids=[5], id="q")])
            groups = [g async for g in engine.groups()]
    assert [g.ok for g in groups] == [True, True] and pool.restarts == [0]


async def test_a_restart_never_loads_other_bytes_under_the_current_epoch(recovery_cfg, tmp_path):
    """Weights given as a directory are loaded by a restarted engine only if the directory still
    holds what epoch N was: a rewrite there must not come back as epoch N."""
    d = tmp_path / "epoch1"
    d.mkdir()
    save_file(STATE, str(d / "model.safetensors"))
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(recovery_cfg("engines.max_restarts=1"), pool=pool) as engine:
            await engine.update_weights(str(d))
            save_file({**STATE, "embed.weight": torch.ones(4, 3)}, str(d / "model.safetensors"))  # the next checkpoint
            await pool.engines[0].kill()
            engine.feed([PROMPT])
            assert (await engine.next_group()).ok  # engine 1 serves
            while engine._scheduler.runner.loads[0].restarting:
                await anyio.sleep(0.01)
            assert not engine._scheduler.runner.loads[0].healthy, "a restart loaded changed bytes as epoch 1"
            assert pool.engines[0].commits == []
