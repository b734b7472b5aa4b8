"""Durable hand-off: the on-disk group log (torn writes, damage, compaction) and the engine's use of it."""

from __future__ import annotations

import anyio
import msgspec
import pytest
from anyio import wait_all_tasks_blocked

from rollout.config import load_config
from rollout.durable import LOG_NAME, DurableLog, DurableLogError, read_log
from rollout.engine import RolloutEngine
from rollout.types import Group, Prompt, Trajectory
from tests.fakes import FakePool

TIMEOUT = 5


def group(pid: str, tokens: int = 3) -> Group:
    t = Trajectory(prompt_id=pid, prompt_token_ids=[5], token_ids=[9] * tokens, logprobs=[-0.5] * tokens, policy_epochs=[(0, 1)])
    return Group(prompt_id=pid, prompt=Prompt(id=pid, token_ids=[5]), trajectories=[t])


def test_unacknowledged_groups_come_back_in_order_and_the_log_is_compacted(tmp_path):
    d = DurableLog(tmp_path)
    assert d.open() == []
    groups = [group(f"g{i}") for i in range(4)]
    for g in groups:
        d.append(g)
    d.ack(groups[1])
    d.ack(groups[1])  # a second ack of the same group writes nothing
    d.close()
    size_before = (tmp_path / LOG_NAME).stat().st_size
    again = DurableLog(tmp_path)
    recovered = again.open()
    assert [g.prompt_id for g in recovered] == ["g0", "g2", "g3"]
    assert recovered[0] == groups[0]  # every field round-trips
    assert (tmp_path / LOG_NAME).stat().st_size < size_before  # only the unacknowledged ones are left
    again.ack(recovered[0])
    again.append(group("g4"))
    again.close()
    assert [g.prompt_id for g in DurableLog(tmp_path).open()] == ["g2", "g3", "g4"]


@pytest.mark.parametrize("kept", [3, 8, 10, -1])  # of the last record: part of its header, the header, ..., all but a byte
def test_a_torn_last_record_is_skipped(tmp_path, kept):
    d = DurableLog(tmp_path)
    d.open()
    d.append(group("g0"))
    d.append(group("g1"))
    d.close()
    path = tmp_path / LOG_NAME
    data = path.read_bytes()
    last = len(data) - len(DurableLog(tmp_path)._frame(_record("g1")))
    path.write_bytes(data[: last + kept] if kept > 0 else data[:kept])
    again = DurableLog(tmp_path)
    assert [g.prompt_id for g in again.open()] == ["g0"]
    assert again.torn_bytes > 0
    again.append(group("g2"))  # the log goes on after the cut
    again.close()
    assert [g.prompt_id for g in DurableLog(tmp_path).open()] == ["g0", "g2"]


def test_a_flipped_byte_in_the_last_record_counts_as_torn(tmp_path):
    d = DurableLog(tmp_path)
    d.open()
    d.append(group("g0"))
    d.append(group("g1"))
    d.close()
    path = tmp_path / LOG_NAME
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    assert [g.prompt_id for g in DurableLog(tmp_path).open()] == ["g0"]


def test_damage_before_the_last_record_is_an_error_not_a_silent_loss(tmp_path):
    d = DurableLog(tmp_path)
    d.open()
    d.append(group("g0"))
    d.append(group("g1"))
    d.close()
    path = tmp_path / LOG_NAME
    data = bytearray(path.read_bytes())
    data[12] ^= 0xFF  # inside the first record's payload
    path.write_bytes(bytes(data))
    with pytest.raises(DurableLogError, match="damaged record at byte 0"):
        read_log(path)


def test_a_file_where_the_directory_should_be_names_the_key(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(DurableLogError, match="queue.durable_dir: cannot use"):
        DurableLog(tmp_path / "f").open()


def _record(pid: str):
    from rollout.durable import Record

    return Record("group", 1, group(pid))


# -- the engine: a new run on the same directory hands out exactly the untaken groups -----------


@pytest.fixture
def make_cfg(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 260}')

    def make(*overrides: str):
        cfg = load_config(None, ["sampling.n=2", "sampling.max_tokens=4", "engines.count=2", "model.max_model_len=64",
                                 "logging.level=error", f"queue.durable_dir={tmp_path / 'log'}", *overrides])  # fmt: skip
        return msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=str(tmp_path)))

    return make


async def test_a_new_run_hands_out_exactly_the_groups_the_last_one_did_not(make_cfg):
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(make_cfg(), pool=FakePool(2)) as engine:
            engine.feed([Prompt(token_ids=[10 + i], id=f"q{i}") for i in range(5)])
            taken = [(await engine.next_group()).prompt_id for _ in range(2)]
            await wait_all_tasks_blocked()  # the other 3 finished (logged), never taken
        async with RolloutEngine(make_cfg(), pool=FakePool(2)) as engine:
            engine.feed([Prompt(token_ids=[99], id="new")])
            second = [g async for g in engine.groups()]
        async with RolloutEngine(make_cfg(), pool=FakePool(2)) as engine:
            assert await engine.next_group() is None  # everything was taken by now
    ids = [g.prompt_id for g in second]
    assert sorted(taken + ids[:3]) == [f"q{i}" for i in range(5)]  # untaken ones first, none twice
    assert ids[3:] == ["new"]
    assert all(len(g.trajectories) == 2 and g.ok for g in second)
