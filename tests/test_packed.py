"""Packed per-token data (rollout/packed.py): typed arrays that read as the lists they replace, cross
the engines' data path as msgpack bins and reach the learner's tensors without a Python object per token."""

from __future__ import annotations

import asyncio
import gc
import pickle

import msgspec
import pytest
import torch

from policies.group_calls import GroupCalls
from rollout.batch import Batch
from rollout.packed import Logprobs, TokenIds, encode, json_hook, to_json, wire_hook
from rollout.types import Group, GroupResult, ProgressReport, Prompt, Request, Sampling, Trajectory
from rollout.wire import RESULTS


def packed(prompt, tokens, epochs) -> Trajectory:
    return Trajectory(request_id="r0", prompt_token_ids=TokenIds(prompt), token_ids=TokenIds(tokens),
                      logprobs=Logprobs(-(i + 1) / 10 for i in range(len(tokens))), policy_epochs=epochs)  # fmt: skip


def as_lists(t: Trajectory) -> Trajectory:
    return msgspec.structs.replace(
        t, prompt_token_ids=list(t.prompt_token_ids), token_ids=list(t.token_ids), logprobs=list(t.logprobs)
    )


def test_token_ids_read_as_the_lists_they_replace():
    ids = TokenIds([5, 6, 7])
    assert ids == [5, 6, 7] and [5, 6, 7] == ids and ids == (5, 6, 7) and ids != [5, 6] and ids != [5, 6, 8]
    assert len(ids) == 3 and ids[0] == 5 and ids[-1] == 7 and list(ids) == [5, 6, 7] and 6 in ids
    assert ids[1:] == [6, 7] and type(ids[1:]) is list  # a slice is a plain list, as it was
    assert ids + [8] == [5, 6, 7, 8] and type(ids + [8]) is list
    assert [4] + ids == [4, 5, 6, 7] and type([4] + ids) is list
    assert ids + ids == [5, 6, 7, 5, 6, 7] and type(ids + ids) is list
    same = ids
    ids += [8]
    ids.extend((9,))
    ids.append(10)
    assert same is ids and ids == [5, 6, 7, 8, 9, 10] and type(ids) is TokenIds
    assert repr(TokenIds([1, 2])) == "TokenIds([1, 2])" and repr(Logprobs([-0.5])) == "Logprobs([-0.5])"
    assert Logprobs([-0.1, -0.25]) == [-0.1, -0.25]  # float64: every value as given
    with pytest.raises(TypeError):
        hash(ids)
    with pytest.raises(OverflowError):
        TokenIds([2**31])  # int32, as vLLM's ids (and the prompt checks bound them)
    back = pickle.loads(pickle.dumps(ids))  # Ray pickles them
    assert type(back) is TokenIds and back == ids


def test_the_collector_sees_no_per_token_objects():
    """What made the driver's full collections 0.2-0.55 s: a list per trajectory field, an int or a
    float per token, walked in every full collection. Packed, an array refers to nothing per token."""
    t = msgspec.msgpack.decode(encode(packed(range(100, 228), range(1000, 1210), [(0, 1)])), type=Trajectory)
    for field in (t.prompt_token_ids, t.token_ids, t.logprobs):
        assert not [x for x in gc.get_referents(field) if isinstance(x, (int, float))]
    assert sum(len(x) for x in gc.get_referents(t) if isinstance(x, list)) < 10  # the epoch runs, not the tokens


def test_per_token_data_crosses_the_wire_as_bins_and_decodes_packed():
    t = packed([1, 2, 3], [4, 5], [(0, 0), (1, 1)])
    raw = msgspec.msgpack.decode(encode(t))  # untyped: what is on the wire
    assert raw["token_ids"] == (4).to_bytes(4, "little") + (5).to_bytes(4, "little")
    assert type(raw["prompt_token_ids"]) is bytes and type(raw["logprobs"]) is bytes
    back = msgspec.msgpack.decode(encode(t), type=Trajectory)  # msgspec's own decoder needs no hook
    assert back == t and type(back.token_ids) is TokenIds and type(back.logprobs) is Logprobs
    assert back.logprobs.tolist() == t.logprobs.tolist()  # float64: bit for bit
    # lists (a Trajectory built by hand, JSON, data written before) still decode, as lists
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(as_lists(t)), type=Trajectory)
    assert old == t and type(old.token_ids) is list
    assert msgspec.msgpack.encode(t, enc_hook=wire_hook) == encode(t)


def test_json_gives_lists_of_numbers():
    t = packed([1, 2, 3], [4, 5], [(0, 0)])
    assert to_json(t) == msgspec.json.encode(as_lists(t)) == msgspec.json.encode(t, enc_hook=json_hook)
    assert msgspec.json.decode(to_json(t), type=Trajectory) == t
    with pytest.raises(TypeError, match="TokenIds"):  # msgspec's encoders know no arrays without the hook
        msgspec.json.encode(t)


def test_a_request_fed_a_trajectorys_packed_ids_decodes_on_the_engine():
    req = Request("r0", "p", 0, Sampling(), token_ids=TokenIds([7, 8, 9]), resume=packed([7, 8, 9], [1], [(0, 0)]))
    ((key, (back,)),) = msgspec.msgpack.decode(encode([("k", [req])]), type=list[tuple[str, list[Request]]])
    assert key == "k" and type(back.token_ids) is TokenIds and back.token_ids == [7, 8, 9] and back.resume == req.resume


def test_to_tensors_reads_packed_data_as_the_lists_it_replaces():
    rows = [packed([5, 6, 7], [10, 11, 12], [(0, 3), (2, 4)]), packed([5, 6], [20], [(0, 1)]), packed([9], [], [])]
    rows[0].reward, rows[1].reward, rows[2].reward = 1.0, 0.0, 0.5
    rows[1].stale_tokens = 1

    def batch(ts):
        return Batch(groups=[Group(prompt_id="p", prompt=Prompt(token_ids=[5]), trajectories=ts)])

    got, want = batch(rows).to_tensors(), batch([as_lists(t) for t in rows]).to_tensors()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert got["token_epochs"][0].tolist() == [-1, -1, -1, 3, 3, 4]


async def test_an_engines_results_frame_carries_each_trajectory_packed():
    """The engine's end of the data path sends what its policy built: per-token data as bins, which
    the driver's decode turns back into typed arrays with one copy each."""
    sent: list[list[bytes]] = []

    class Sock:
        def send_multipart(self, frames):
            sent.append(frames)

    class Engine(GroupCalls):
        engine_id = 0

        async def finish_group(self, requests):
            return [packed([1, 2], [3, 4, 5], [(0, 0)])]

    engine = Engine()
    engine._sock = Sock()
    engine.submit(encode([("g", [Request("r0", "p", 0, Sampling(), token_ids=[1, 2])])]))
    while not sent:
        await asyncio.sleep(0)
    kind, payload = sent[0]
    assert kind == RESULTS
    (raw,) = msgspec.msgpack.decode(payload)
    assert type(raw["trajectories"][0]["token_ids"]) is bytes
    (result,) = msgspec.msgpack.decode(payload, type=list[GroupResult])
    assert type(result.trajectories[0].token_ids) is TokenIds and result.trajectories[0].token_ids == [3, 4, 5]


def test_a_progress_report_of_packed_trajectories_reads_back():
    report = ProgressReport(encode([packed([1], [2, 3], [(0, 0)])]))
    assert report["r0"].token_ids == [2, 3] and type(report["r0"].token_ids) is TokenIds


def test_rollout_run_out_writes_an_engines_trajectories_as_json_lists(tmp_path):
    from rollout.cli import _Writer

    path = tmp_path / "t.jsonl"
    with open(path, "wb") as f:
        _Writer(f, str(path)).write([packed([1, 2], [3, 4], [(0, 0)])])
    line = msgspec.json.decode(path.read_bytes())
    assert line["prompt_token_ids"] == [1, 2] and line["token_ids"] == [3, 4] and line["logprobs"] == [-0.1, -0.2]


def test_packed_bytes_that_are_not_whole_values_are_refused_naming_the_field():
    bad = msgspec.msgpack.encode({"token_ids": b"12345"})
    with pytest.raises(msgspec.ValidationError, match=r"^token_ids: 5 packed bytes are not whole 4-byte values$"):
        msgspec.msgpack.decode(bad, type=Trajectory)
