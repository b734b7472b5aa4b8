"""Durable hand-off through the engine, on fake engines: the learner's commit (not taking a group)
acknowledges it; a new run resumes at the logged epoch and puts recovered groups through the
staleness filter; one run per directory; a log that fails stops hand-out loudly, and the pool is
shut down whatever raised."""

from __future__ import annotations

import functools

import anyio
import pytest

from rollout.engine import RolloutEngine
from rollout.errors import InvalidPromptError
from rollout.handout.durable import DurableLog, DurableLogError
from rollout.sync_engine import SyncRolloutEngine
from rollout.types import Prompt
from tests.support.durable_log import fill_the_disk, offsets, read_only, write_log
from tests.support.fake_engine_runs import settled
from tests.support.fakes import FakeEngine, FakePool
from tests.support.metrics import scrape
from tests.support.model import STATE

TIMEOUT = 5  # seconds; only reached when a test is about to fail


@pytest.fixture
def log_dir(tmp_path):
    return tmp_path / "log"


@pytest.fixture
def durable_cfg(make_cfg, log_dir):
    """`make_cfg` with samples of 4 tokens and the durable log in `log_dir`."""
    return functools.partial(make_cfg, "sampling.max_tokens=4", f"queue.durable_dir={log_dir}")


def prompts(count: int, start: int = 0) -> list[Prompt]:
    return [Prompt(token_ids=[10 + i], id=f"q{i}") for i in range(start, start + count)]


async def everything_left(cfg, **kwargs) -> list[str]:
    """What a new run on the directory hands out (and, exiting cleanly, commits)."""
    async with RolloutEngine(cfg, pool=FakePool(2), **kwargs) as engine:
        return [g.prompt_id async for g in engine.groups()]


async def logged(engine: RolloutEngine, groups: int) -> None:
    """Wait until `groups` finished groups wait for the learner, each there once the durable log's
    append returned. That runs in a worker thread, which `wait_all_tasks_blocked` does not wait for:
    an exit before it ends keeps nothing of the group (`DurableLog.close`)."""
    queue = engine._live_scheduler().queue
    while len(queue) < groups:
        await anyio.sleep(0.001)


# -- acknowledged on the learner's commit, not on take ----------------------------------------


async def test_a_new_run_hands_out_exactly_the_groups_the_last_one_did_not_take(durable_cfg):
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(durable_cfg(), pool=FakePool(2)) as engine:
            engine.feed(prompts(5))
            taken = [(await engine.next_group()).prompt_id for _ in range(2)]
            await logged(engine, 3)  # the other 3 finished, never taken
        # a clean exit committed the 2 taken
        async with RolloutEngine(durable_cfg(), pool=FakePool(2)) as engine:
            engine.feed([Prompt(token_ids=[99], id="new")])
            second = [g async for g in engine.groups()]
        assert await everything_left(durable_cfg()) == []
    ids = [g.prompt_id for g in second]
    assert sorted(taken + ids[:3]) == [f"q{i}" for i in range(5)]  # untaken ones first, none twice
    assert ids[3:] == ["new"]
    assert all(len(g.trajectories) == 2 and g.ok for g in second)


async def test_a_learner_that_crashes_mid_step_gets_that_batch_again(durable_cfg):
    trained: list[str] = []
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(RuntimeError, match="learner crashed"):
            async with RolloutEngine(durable_cfg(), pool=FakePool(2)) as engine:
                engine.feed(prompts(6))
                async for batch in engine.batches(groups=2):
                    if trained:  # the second step
                        crashed = [g.prompt_id for g in batch.groups]
                        await logged(engine, 2)  # every group finished
                        raise RuntimeError("learner crashed")
                    trained += [g.prompt_id for g in batch.groups]
        again = await everything_left(durable_cfg())
    assert set(crashed) <= set(again)  # the batch it was on comes back
    assert sorted(again) == sorted({f"q{i}" for i in range(6)} - set(trained))  # the one it finished does not


async def test_asking_for_the_next_group_commits_the_ones_before(durable_cfg):
    taken: list[str] = []
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(RuntimeError, match="learner crashed"):
            async with RolloutEngine(durable_cfg(), pool=FakePool(2)) as engine:
                engine.feed(prompts(4))
                async for group in engine.groups():
                    taken.append(group.prompt_id)
                    if len(taken) == 3:
                        await logged(engine, 1)
                        raise RuntimeError("learner crashed")
        again = await everything_left(durable_cfg())
    assert sorted(again) == sorted({taken[2], *{f"q{i}" for i in range(4)} - set(taken)})


async def test_with_explicit_commits_only_commit_acknowledges(durable_cfg):
    cfg = durable_cfg("queue.durable_commit=explicit")
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=FakePool(2)) as engine:
            engine.feed(prompts(4))
            batch = await engine.batches(groups=2)
            await engine.commit(batch)
            kept = await engine.next_group()  # a learner fetching ahead: this commits nothing
            last = await engine.next_group()
            await engine.commit(last)
            await engine.commit(last)  # twice is harmless
        # a clean exit commits nothing either
        assert await everything_left(cfg) == [kept.prompt_id]


def test_the_sync_facade_commits(durable_cfg):
    cfg = durable_cfg("queue.durable_commit=explicit")
    with pytest.raises(RuntimeError, match="learner crashed"), SyncRolloutEngine(cfg, pool=FakePool(2)) as engine:
        engine.feed(prompts(2))
        groups = engine.groups()
        engine.commit(next(groups))
        second = next(groups)
        raise RuntimeError("learner crashed")
    with SyncRolloutEngine(cfg, pool=FakePool(2)) as engine:
        assert [g.prompt_id for g in engine.groups()] == [second.prompt_id]


async def test_the_log_stays_bounded_over_a_long_run(durable_cfg, log_dir):
    cfg = durable_cfg("queue.durable_compact_bytes=4096", "queue.max_groups=8")
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=FakePool(2)) as engine:
            engine.feed(prompts(80))
            sizes = []
            async for _ in engine.batches(groups=4):
                sizes.append(engine._durable.size)
    assert engine._durable.compactions > 0
    # the threshold, and at most 8 queued + 4 taken + 1 arriving groups of ~800 bytes; the 80 groups
    # logged in all took over 60 kB
    assert max(sizes) < 4096 + 13 * 1000


# -- resuming at an epoch ------------------------------------------------------------------------


async def test_a_new_run_resumes_at_the_logged_epoch_and_updates_from_there(durable_cfg):
    cfg = durable_cfg()
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=FakePool(2)) as engine:
            assert engine.epoch == 0
            await engine.update_weights(STATE)
            await engine.update_weights(STATE)
        pool = FakePool(2)
        async with RolloutEngine(cfg, pool=pool) as engine:
            assert engine.epoch == 2
            assert await engine.update_weights(STATE) == 3
        assert [e.commits for e in pool.engines] == [[3], [3]]  # the engines are told 3, never 1
        async with RolloutEngine(cfg, pool=FakePool(2), start_epoch=10) as engine:  # the learner restored other weights
            assert engine.epoch == 10
        async with RolloutEngine(cfg, pool=FakePool(2)) as engine:
            assert engine.epoch == 10
    with pytest.raises(ValueError, match="start_epoch: expected >= 0, got -1"):
        RolloutEngine(cfg, start_epoch=-1)


@pytest.mark.parametrize("stale", ["drop", "mask"])
async def test_recovered_groups_go_through_the_staleness_filter(durable_cfg, stale):
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(durable_cfg(), pool=FakePool(2)) as engine:
            engine.feed(prompts(2))
            await logged(engine, 2)  # both finished at epoch 0, none taken
            await engine.update_weights(STATE)
            await engine.update_weights(STATE)
        async with RolloutEngine(
            durable_cfg("staleness.max_lag=1", f"staleness.stale={stale}"), pool=FakePool(2)
        ) as engine:
            out = [g async for g in engine.groups()]
        assert await everything_left(durable_cfg()) == []  # dropped ones are acknowledged at once
    s = engine.staleness
    assert s.lag_tokens == {2: 2 * 2 * 4}  # handed out at the resumed epoch 2, not at 0
    if stale == "drop":
        assert out == [] and s.dropped_groups == 2
    else:
        assert len(out) == 2 and all(t.stale_tokens == 4 for g in out for t in g.trajectories)


async def test_a_group_dropped_as_too_stale_is_acknowledged_even_when_reported_in_its_place(durable_cfg):
    """`next_group(keep_dropped=True)` (RolloutGeneration) hands out an error report instead of the
    dropped group: the dropped one is what the log must acknowledge."""
    cfg = durable_cfg("staleness.max_lag=1")
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=FakePool(2)) as engine:
            engine.admit_step(2)
            engine.feed(prompts(2))
            await logged(engine, 2)  # both finished at epoch 0
            await engine.update_weights(STATE)
            await engine.update_weights(STATE)
            reports = [await engine.next_group(keep_dropped=True) for _ in range(2)]
        assert all("lagged more than staleness.max_lag=1" in g.error for g in reports)
        assert await everything_left(durable_cfg()) == []


async def test_admission_after_a_resume_counts_epochs_from_the_runs_start(durable_cfg):
    pool = FakePool(2)

    def started() -> int:
        return sum(len(e.prompt_ids) for e in pool.engines)

    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(
            durable_cfg("staleness.max_lag=0", "staleness.batch_groups=1"), pool=pool, start_epoch=5
        ) as engine:
            engine.feed(prompts(10))
            await settled()
            assert started() == 1  # (0 + max_lag + 1) * 1
            assert await engine.update_weights(STATE) == 6
            await settled()
            assert started() == 2  # not (6 + 0 + 1) * 1 = 7


async def test_an_engine_restarted_before_the_first_update_of_a_resumed_run_keeps_the_model_weights(durable_cfg):
    pool = FakePool([FakeEngine(0)])
    pool.engines[0].dead = True
    cfg = durable_cfg("engines.count=1", "engines.restart_backoff_s=0")
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool, start_epoch=4) as engine:
            engine.feed(prompts(1))
            group = await engine.next_group()
    assert pool.restarts == [0] and group.ok
    # there are no epoch-4 weights to load: it serves the model's, as the others do
    assert pool.engines[0].commits == []


# -- one run per directory; directories and disks that refuse --------------------------------


async def test_a_second_engine_on_the_directory_is_refused_and_the_first_goes_on(durable_cfg, log_dir):
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(durable_cfg(), pool=FakePool(2)) as first:
            with pytest.raises(DurableLogError, match=f"queue.durable_dir={log_dir}: another run holds it"):
                async with RolloutEngine(durable_cfg(), pool=FakePool(2)):
                    pass
            first.feed(prompts(1))
            assert (await first.next_group()).ok


async def test_a_read_only_directory_fails_before_anything_starts(durable_cfg, log_dir):
    log_dir.mkdir()
    undo = read_only(log_dir)
    try:
        with pytest.raises(
            DurableLogError,
            match=f"queue.durable_dir={log_dir}: cannot open its lock file: "
            "(Permission denied|Operation not permitted)",
        ):
            async with RolloutEngine(durable_cfg(), pool=FakePool(2)):
                pass
    finally:
        undo()


async def test_a_full_disk_stops_hand_out_loudly_and_the_pool_is_shut_down(durable_cfg, log_dir):
    pool = FakePool(2)
    message = (
        rf"queue.durable_dir={log_dir}: cannot append a finished group to groups.log: "
        r"No space left on device \(ENOSPC\)"
    )
    with anyio.fail_after(TIMEOUT), pytest.raises(DurableLogError, match=message):  # not an ExceptionGroup
        async with RolloutEngine(durable_cfg(), pool=pool) as engine:
            fill_the_disk(engine._durable)
            engine.feed(prompts(2))
            await engine.next_group()
    assert pool.shutdown_calls == 1


async def test_a_commit_the_disk_refuses_raises_and_the_batch_comes_back(durable_cfg):
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(DurableLogError, match=r"cannot acknowledge groups in groups.log: No space left on device"):
            async with RolloutEngine(durable_cfg(), pool=FakePool(2)) as engine:
                engine.feed(prompts(1))
                assert (await engine.next_group()).prompt_id == "q0"
                fill_the_disk(engine._durable)
                await engine.commit()
        assert await everything_left(durable_cfg()) == ["q0"]  # at least once, never lost


async def test_metadata_the_log_cannot_hold_fails_that_group_only(durable_cfg):
    bad = [Prompt(token_ids=[10], id="obj", metadata={"x": object()})]
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(durable_cfg(), pool=FakePool(2)) as engine:
            with pytest.raises(
                InvalidPromptError, match="metadata"
            ):  # not a Prompt's type (dict[str, Any]): refused at feed
                engine.feed([Prompt(token_ids=[11], id="int-key", metadata={1: "x"})])
            engine.feed([*bad, Prompt(token_ids=[12], id="fine")])
            out = {g.prompt_id: g async for g in engine.groups()}
        assert await everything_left(durable_cfg()) == []  # the log still reads
    assert out["fine"].ok
    assert "cannot be logged (TypeError: Encoding objects of type object is unsupported)" in out["obj"].error


def a_file_that_fails_to_close():
    f = open("/dev/full", "wb")  # noqa: SIM115 - the log closes it; buffered: the byte waiting in it is refused when closing flushes it
    f.write(b"x")
    return f


@pytest.mark.parametrize("task_group_raises", [False, True])
async def test_the_pool_is_shut_down_even_when_closing_the_log_raises(durable_cfg, log_dir, task_group_raises):
    pool = FakePool(2)

    with anyio.fail_after(TIMEOUT):
        with pytest.raises(BaseException) as e:  # checked below: it may come in an ExceptionGroup
            async with RolloutEngine(durable_cfg(), pool=pool) as engine:
                real, engine._durable._file = engine._durable._file, a_file_that_fails_to_close()
                real.close()
                if task_group_raises:  # the run unwinds with an error of its own (a raising
                    raise RuntimeError("callback bug")  # on_trajectory only fails its group now)
    assert pool.shutdown_calls == 1

    def leaves(exc: BaseException) -> list[BaseException]:
        if isinstance(exc, BaseExceptionGroup):
            return [leaf for x in exc.exceptions for leaf in leaves(x)]
        return [exc]

    if task_group_raises:  # the close error is logged; it must not hide the error the run unwinds with
        assert [str(x) for x in leaves(e.value)] == ["callback bug"]
    else:
        assert isinstance(e.value, DurableLogError) and "cannot close groups.log: No space left on device" in str(
            e.value
        )
    again = DurableLog(log_dir)
    again.open()  # the lock was released
    again.close()


async def test_a_torn_last_record_is_counted_in_the_metrics_and_the_run_goes_on(durable_cfg, log_dir):
    """A crash's torn (here zero-filled) last record is cut off at open, with a warning, and counted
    where dashboards look: `rollout/durable_torn_records` and `rollout_durable_torn_records_total`."""
    from rollout.handout.durable import LOG_NAME

    write_log(log_dir, 3)
    path = log_dir / LOG_NAME
    data = bytearray(path.read_bytes())
    last = offsets(path)[-1]
    data[last + 20 :] = bytes(len(data) - last - 20)
    path.write_bytes(bytes(data))
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(durable_cfg("metrics.port=0"), pool=FakePool(2)) as engine:
            assert [g.prompt_id async for g in engine.groups()] == ["g0", "g1"]
            first = await engine.metrics()
            assert (first["rollout/durable_torn_records"], first["rollout/durable_torn_bytes"]) == (1, len(data) - last)
            assert (await engine.metrics())["rollout/durable_torn_records"] == 0  # a window: counted once
            assert engine.exporter is not None
            got = await anyio.to_thread.run_sync(scrape, engine.exporter.url)
    assert got["rollout_durable_torn_records_total"] == 1
