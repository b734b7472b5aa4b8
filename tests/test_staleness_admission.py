"""Admission by AReaL's capacity rule, on fake engines: what counts against `staleness.max_lag`'s
budget (groups accepted by the learner + groups running), what gives a slot back (a group dropped at
hand-out, a group with nothing to train on), whose batch size it uses, when it warns, and the NeMo
RL facade, whose calls must finish whatever `max_lag` is.

Where a test shows that something does *not* happen, it waits until every task is blocked
(`tests.support.fake_engine_runs.settled`): the fakes have no timers, so nothing could wake them later.
"""

from __future__ import annotations

import functools

import anyio
import pytest
import torch
from structlog.testing import capture_logs

from rollout.config import load_config
from rollout.engine import RolloutEngine
from rollout.episodes.env import Step
from rollout.nemo_rl import GenerationError, RolloutGeneration
from rollout.types import Prompt, Trajectory
from tests.support.fake_engine_runs import settled
from tests.support.fakes import FakeEngine, FakePool, HeldEngine
from tests.support.model import STATE

TIMEOUT = 30  # a hang guard, only reached by a test about to fail; fake engines have no timers, so
# a verdict never waits on the clock, but on a busy 2-core machine startup alone can take seconds


@pytest.fixture
def admission_cfg(make_cfg):
    """`make_cfg` logging warnings too: when admission warns, and when it must not, is tested here."""
    return functools.partial(make_cfg, "logging.level=warning")


def prompts(count: int) -> list[Prompt]:
    return [Prompt(token_ids=[10 + i] * 3, id=f"q{i}") for i in range(count)]


def started_ids(pool: FakePool) -> set[str]:
    return {p for e in pool.engines for p in e.prompt_ids}


class FailingEngine(FakeEngine):
    """Every sample of a prompt starting with token 99 fails, as the engine reports a bad request."""

    def _trajectory(self, request):
        traj = super()._trajectory(request)
        if request.token_ids and request.token_ids[0] == 99:
            return Trajectory(prompt_token_ids=traj.prompt_token_ids, sample_index=request.sample_index,
                              finish_reason="error", error="boom")  # fmt: skip
        return traj


# -- what counts against the budget ---------------------------------------------------------------
async def test_dropped_groups_give_their_admission_slot_back(admission_cfg):
    """The issue's reproduction: max_lag=1, k=2, two slow groups dropped at hand-out. They must not
    count against the budget afterwards, or the run turns synchronous (no group generated ahead)."""
    release = anyio.Event()
    pool = FakePool([HeldEngine(i, {"q0", "q1"}, release) for i in range(2)])
    ahead = []  # per learner step: groups of its batch that had started before the previous update
    with anyio.fail_after(TIMEOUT):
        cfg = admission_cfg("staleness.max_lag=1", "staleness.batch_groups=2", "staleness.stale=drop")
        async with RolloutEngine(cfg, pool=pool) as engine:
            engine.feed(prompts(20))
            before: set[str] = set()
            for step in range(6):
                batch = await engine.batches(groups=2)
                assert batch is not None and len(batch.groups) == 2
                ahead.append(sum(g.prompt_id in before for g in batch.groups))
                if step == 1:  # the slow groups finish now, with epoch-0 tokens: dropped at step 2
                    release.set()
                    await pool.engines[0].wait_until(lambda e: not e.held)
                    await pool.engines[1].wait_until(lambda e: not e.held)
                await settled()
                before = started_ids(pool)
                await engine.update_weights(STATE)
                await settled()
    assert engine.staleness.dropped_groups == 2
    # steps 1-2: the slow groups hold the budget while they run; from step 3 on, every batch was
    # generated during the learner's previous step, as max_lag=1 allows
    assert ahead[1:] == [0, 0, 2, 2, 2]


@pytest.mark.parametrize("kind", ["every sample failed", "prompt rejected"])
async def test_a_group_with_nothing_to_train_on_gives_its_slot_back(admission_cfg, kind):
    """A failed group never reaches the loss: it frees its admission slot when it finishes, and a
    batch counts only groups with a sample to train on (failed ones come along, for their errors)."""

    bad = Prompt(token_ids=[99], id="bad") if kind == "every sample failed" else Prompt(token_ids=[999], id="bad")
    pool = FakePool([FailingEngine(0), FailingEngine(1)])
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(admission_cfg("staleness.max_lag=0", "staleness.batch_groups=2"), pool=pool) as engine:
            engine.feed(iter([bad, *prompts(4)]))  # an iterator: a bad item becomes a failed group
            batch = await engine.batches(groups=2)
            await settled()
            assert batch is not None
            assert [g.prompt_id for g in batch.groups if g.ok] == ["q0", "q1"]
            assert [g.prompt_id for g in batch.groups if not g.ok] == ["bad"]
            assert started_ids(pool) == ({"q0", "q1"} if kind == "prompt rejected" else {"bad", "q0", "q1"})


async def test_configured_batch_groups_wins_over_the_learners_batch_size(admission_cfg):
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(admission_cfg("staleness.max_lag=0", "staleness.batch_groups=3"), pool=pool) as engine:
            engine.feed(prompts(10))
            batch = await engine.batches(groups=2)
            await settled()
            assert batch is not None and len(started_ids(pool)) == 3  # (0 + 0 + 1) * 3, not * 2
            assert (await engine.next_group()) is not None  # nor does a single-group consumer change it
            await settled()
            assert len(started_ids(pool)) == 3


# -- warnings -------------------------------------------------------------------------------------


def bottleneck_warnings(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["log_level"] == "warning" and "admission" in e["event"]]


async def test_a_learner_step_with_nothing_generated_ahead_is_warned_about(admission_cfg):
    """Admission is the bottleneck when it held every prompt back for a whole learner step: at the
    update, nothing the learner has not taken is running, yet prompts wait."""
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(admission_cfg("staleness.max_lag=1"), pool=pool) as engine:
            engine.feed(prompts(20))
            with capture_logs() as logs:
                await engine.batches(groups=2)  # one batch per update: the next one runs ahead
                await settled()
                await engine.update_weights(STATE)
                await settled()
                assert bottleneck_warnings(logs) == []
                await engine.batches(groups=2)  # two batches per update: the learner takes
                await engine.batches(groups=2)  # everything admission let in
                await settled()
                await engine.update_weights(STATE)
    (warning,) = bottleneck_warnings(logs)
    assert (warning["epoch"], warning["max_lag"], warning["batch_groups"], warning["accepted"]) == (2, 1, 2, 6)


async def test_an_update_before_the_first_batch_ends_no_step(admission_cfg):
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(admission_cfg("staleness.max_lag=1"), pool=pool) as engine:
            engine.feed(prompts(8))
            with capture_logs() as logs:
                await settled()  # admission waits for the learner's batch size
                await engine.update_weights(STATE)  # e.g. the learner's initial weights
    assert bottleneck_warnings(logs) == []


async def test_max_lag_0_holds_back_every_step_without_a_warning(admission_cfg):
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(admission_cfg("staleness.max_lag=0"), pool=pool) as engine:
            engine.feed(prompts(8))
            with capture_logs() as logs:
                for _ in range(3):
                    await engine.batches(groups=2)
                    await settled()
                    await engine.update_weights(STATE)
    assert bottleneck_warnings(logs) == []  # synchronous by request


class ThreeTurns:
    """An environment of three turns with token-id observations (no chat template needed)."""

    async def reset(self, prompt):
        return None

    async def step(self, action):
        return Step(None if action.turn == 2 else [7, 8], 1.0, action.turn == 2)


async def test_admission_counts_episodes_not_turns(admission_cfg):
    """An episode is one group's sample however many turns it plays: admission lets in
    `(epoch + max_lag + 1) * batch_groups` episodes, every turn of those runs, and no more start
    until the learner takes a batch and the epoch moves."""
    # An engine with an environment loads the model's chat template (`rollout.episodes.chat`): the process's
    # first transformers import (10-14 s on a loaded 2-core machine) is paid here, not on the guard.
    from transformers import AutoTokenizer  # noqa: F401

    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(
            admission_cfg("staleness.max_lag=0", "staleness.batch_groups=2"), pool=pool, env=ThreeTurns
        ) as engine:
            engine.feed(prompts(8))
            await settled()
            assert started_ids(pool) == {"q0", "q1"}
            assert len([r for e in pool.engines for r in e.requests]) == 2 * 2 * 3  # 2 episodes x n=2 x 3 turns
            batch = await engine.batches(groups=2)
            assert all(len(t.turns) == 3 for g in batch.groups for t in g.trajectories)
            await settled()
            assert started_ids(pool) == {"q0", "q1"}  # taken, but max_lag 0: the next wait for an update
            await engine.update_weights(STATE)
            await settled()
            assert started_ids(pool) == {"q0", "q1", "q2", "q3"}


async def test_configured_batch_groups_below_the_learners_batches_is_warned_about(admission_cfg):
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(admission_cfg("staleness.max_lag=1", "staleness.batch_groups=1"), pool=pool) as engine:
            engine.feed(prompts(8))
            with capture_logs() as logs:
                assert await engine.batches(groups=2) is not None  # (0 + 1 + 1) * 1 = 2 started
                for _ in range(2):  # two updates per batch of two: the next batch fills
                    await engine.update_weights(STATE)
                assert await engine.batches(groups=2) is not None
    (warning,) = [e for e in logs if e["log_level"] == "warning" and "staleness.batch_groups" in e["event"]]
    assert (warning["batch_groups"], warning["groups"]) == (1, 2)  # once, though asked twice


# -- the NeMo RL facade ---------------------------------------------------------------------------

ROWS = [[10, 11, 12], [13], [14, 15], [16, 17, 18, 19], [20], [21, 22]]


def rows_batch(rows: list[list[int]]) -> dict:
    width = max(len(r) for r in rows)
    return {
        "input_ids": torch.tensor([r + [0] * (width - len(r)) for r in rows]),
        "input_lengths": torch.tensor([len(r) for r in rows]),
    }


@pytest.mark.parametrize("overrides", [["staleness.max_lag=0"], ["staleness.max_lag=1"],
                                       ["staleness.max_lag=0", "staleness.batch_groups=2"]])  # fmt: skip
async def test_a_facade_call_finishes_whatever_max_lag(admission_cfg, overrides):
    """6 rows > max_lag + 1: each call is a step of its own size, also without an update between calls."""
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(admission_cfg(*overrides), pool=pool) as engine:
            gen = RolloutGeneration(engine=engine, pad_value=0)
            for _ in range(2):  # e.g. a training call, then a validation call at the same weights
                assert (await gen.agenerate(rows_batch(ROWS)))["output_ids"].shape[0] == len(ROWS)
            await engine.update_weights(STATE)
            assert sorted([i async for i, _ in gen.generate_async(rows_batch(ROWS))]) == list(range(len(ROWS)))
            out = await anyio.to_thread.run_sync(gen.generate, rows_batch(ROWS))
    assert out["token_epochs"][:, 4:].max().item() == 1


async def test_facade_rows_dropped_as_too_stale_come_back_as_failed_rows(admission_cfg):
    """Weights updated while a call runs: its rows lag 1 > max_lag 0 at hand-out. Dropped, they must
    still come back (as failed rows), or the call waits for them forever."""
    release = anyio.Event()
    pool = FakePool([HeldEngine(i, {"*"}, release) for i in range(2)])
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(admission_cfg("staleness.max_lag=0"), pool=pool) as engine:
            gen = RolloutGeneration(engine=engine, pad_value=0)
            failure: list[GenerationError] = []

            async def call() -> None:
                with pytest.raises(GenerationError) as e:
                    await gen.agenerate(rows_batch(ROWS[:2]))
                failure.append(e.value)

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await settled()
                await engine.update_weights(STATE)
                release.set()
    assert sorted(failure[0].rows) == [0, 1]
    assert "staleness.max_lag=0" in failure[0].rows[0]
    assert engine.staleness.dropped_groups == 2


@pytest.mark.parametrize(
    "override, message",
    [
        ("queue.max_groups=0", "queue.max_groups: expected `int` >= 1"),  # nothing could ever be admitted
        ("queue.max_groups=-2", "queue.max_groups: expected `int` >= 1"),
        ("engines.max_inflight_per_engine=0", "engines.max_inflight_per_engine: expected `int` >= 1"),
        ("engines.queued_per_engine=0", "engines.queued_per_engine: expected `int` >= 1"),
        ("staleness.max_lag=-1", "staleness.max_lag: expected `int` >= 0"),
    ],
)
def test_an_admission_setting_that_cannot_work_is_refused_naming_the_key(override, message):
    """A queue depth or admission setting that cannot work fails at load, naming the key."""
    from rollout.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError, match=message.replace("`", ".")):
        load_config(None, [override])


def test_the_default_queue_admits_twice_what_the_engines_hold():
    """`queue.max_groups` follows the engines' room (running + queued, twice over: a group
    keeps its slot until its last sample ends), so admission never holds back what they could run."""
    assert load_config(None).queue.max_groups == 2 * 2 * (256 + 256) // 4
    more = load_config(None, ["engines.count=3", "sampling.n=8", "engines.queued_per_engine=64"])
    assert more.queue.max_groups == -(-2 * 3 * (256 + 64) // 8) == 240
    assert load_config(None, ["queue.max_groups=7"]).queue.max_groups == 7
