"""Wire types: msgspec round trips, epoch runs, and the learner's tensor layout."""

from __future__ import annotations

import msgspec
import pytest
import torch

from rollout.batch import Batch
from rollout.epochs import append_run, expand_runs
from rollout.types import Group, ProgressReport, Prompt, Sampling, Trajectory


def make_trajectory(prompt, tokens, epochs=None, **kw) -> Trajectory:
    return Trajectory(
        request_id=kw.pop("request_id", "r1-0"),
        prompt_id=kw.pop("prompt_id", "p1"),
        prompt_token_ids=list(prompt),
        token_ids=list(tokens),
        logprobs=[-(i + 1) / 10 for i in range(len(tokens))],
        policy_epochs=epochs if epochs is not None else ([(0, 0)] if tokens else []),
        **kw,
    )


def sample_batch() -> Batch:
    prompt = Prompt(token_ids=[5, 6, 7], id="p1", sampling={"max_tokens": 4}, metadata={"answer": 42, "tags": ["a"]})
    t0 = make_trajectory([5, 6, 7], [10, 11, 12], epochs=[(0, 3), (2, 4)], sample_index=0, engine_id=1, reward=1.5)
    t1 = make_trajectory([5, 6, 7], [20], sample_index=1, finish_reason="length", first_token_at=1.25)
    bad = Group(prompt_id="p2", prompt=Prompt(text="hi", id="p2"), error="prompt 'p2': nope")
    return Batch(groups=[Group(prompt_id="p1", prompt=prompt, trajectories=[t0, t1]), bad])


@pytest.mark.parametrize("codec", [msgspec.json, msgspec.msgpack], ids=["json", "msgpack"])
@pytest.mark.parametrize(
    "value",
    [
        Prompt(token_ids=[1, 2, 3], id="a", sampling={"n": 2, "temperature": 0.5}, metadata={"k": [1, "x"]}),
        Prompt(text="hello", id="b"),
        Prompt(),
        make_trajectory([1, 2], [3, 4, 5], epochs=[(0, 1), (2, 2)], reward=-0.5, error=None),
        Trajectory(finish_reason="error", error="boom"),
        sample_batch().groups[0],
        sample_batch().groups[1],
        sample_batch(),
        Batch(),
    ],
    ids=[
        "prompt-ids",
        "prompt-text",
        "prompt-empty",
        "trajectory",
        "trajectory-error",
        "group",
        "group-error",
        "batch",
        "batch-empty",
    ],
)
def test_round_trip(codec, value):
    decoded = codec.decode(codec.encode(value), type=type(value))
    assert decoded == value
    assert type(decoded) is type(value)


def test_round_trip_keeps_epoch_runs_as_tuples():
    t = make_trajectory([1], [2, 3], epochs=[(0, 1), (1, 2)])
    decoded = msgspec.json.decode(msgspec.json.encode(t), type=Trajectory)
    assert decoded.policy_epochs == [(0, 1), (1, 2)]
    assert decoded.token_epochs() == [1, 2]


def test_prompt_rejects_unknown_fields():
    with pytest.raises(msgspec.ValidationError, match="unknown field `tokens`"):
        msgspec.json.decode(b'{"tokens": [1]}', type=Prompt)


def test_old_readers_decode_new_data_with_defaults():
    t = msgspec.json.decode(b'{"request_id": "r", "token_ids": [4]}', type=Trajectory)
    assert t.request_id == "r" and t.token_ids == [4]
    assert t.finish_reason == "stop" and t.ok and t.policy_epochs == [] and t.reward is None


def test_ok_flags():
    assert Trajectory().ok
    assert not Trajectory(finish_reason="error").ok
    good = Group(prompt_id="p", prompt=Prompt(), trajectories=[Trajectory(), Trajectory(finish_reason="length")])
    assert good.ok
    assert not Group(prompt_id="p", prompt=Prompt(), trajectories=[Trajectory(), Trajectory(finish_reason="error")]).ok
    assert not Group(prompt_id="p", prompt=Prompt(), error="bad").ok


@pytest.mark.parametrize(
    "runs, length, expected",
    [
        ([], 0, []),
        ([(0, 7)], 0, []),
        ([(0, 7)], 3, [7, 7, 7]),
        ([(0, 1), (2, 2)], 5, [1, 1, 2, 2, 2]),
        ([(0, 1), (1, 2), (2, 3)], 3, [1, 2, 3]),
    ],
)
def test_expand_runs(runs, length, expected):
    assert expand_runs(runs, length) == expected


@pytest.mark.parametrize(
    "runs, length, message",
    [
        ([], 2, "must start at index 0"),
        ([(1, 0)], 2, "must start at index 0"),
        ([(0, 1), (0, 2)], 3, "increasing starts"),
        ([(0, 1), (2, 2), (1, 3)], 4, "increasing starts"),
        ([(0, 1), (5, 2)], 3, "increasing starts"),
    ],
)
def test_expand_runs_errors(runs, length, message):
    with pytest.raises(ValueError, match=message):
        expand_runs(runs, length)


def test_append_run():
    runs: list[tuple[int, int]] = []
    append_run(runs, 0, 3)
    append_run(runs, 2, 3)  # unchanged epoch: the run goes on
    append_run(runs, 4, 5)
    append_run(runs, 6, 5)
    append_run(runs, 7, 3)  # epochs are values, not a counter: going back starts a run too
    assert runs == [(0, 3), (4, 5), (7, 3)]
    assert expand_runs(runs, 9) == [3, 3, 3, 3, 5, 5, 5, 3, 3]


def test_to_tensors_layout():
    # rows: prompt 3 + gen 3 (epochs 3,3,4); prompt 3 + gen 1; prompt 1 + gen 4
    t0 = make_trajectory([5, 6, 7], [10, 11, 12], epochs=[(0, 3), (2, 4)])
    t1 = make_trajectory([5, 6, 7], [20], epochs=[(0, 9)])
    t2 = make_trajectory([8], [30, 31, 32, 33], epochs=[(0, 1)])
    failed = make_trajectory([5, 6, 7], [], finish_reason="error", error="x")
    batch = Batch(
        groups=[
            Group(prompt_id="a", prompt=Prompt(token_ids=[5, 6, 7]), trajectories=[t0, failed, t1]),
            Group(prompt_id="e", prompt=Prompt(), error="rejected"),
            Group(prompt_id="b", prompt=Prompt(token_ids=[8]), trajectories=[t2]),
        ]
    )
    out = batch.to_tensors(pad_id=99)
    assert out["input_ids"].shape == (3, 6)  # the failed trajectory and the rejected group have no row
    assert out["input_ids"].tolist() == [
        [5, 6, 7, 10, 11, 12],
        [5, 6, 7, 20, 99, 99],
        [8, 30, 31, 32, 33, 99],
    ]
    assert out["input_lengths"].tolist() == [3, 3, 1]
    assert out["generation_lengths"].tolist() == [3, 1, 4]
    assert out["unpadded_sequence_lengths"].tolist() == [6, 4, 5]
    assert out["loss_mask"].tolist() == [
        [0, 0, 0, 1, 1, 1],
        [0, 0, 0, 1, 0, 0],
        [0, 1, 1, 1, 1, 0],
    ]
    assert out["token_epochs"].tolist() == [
        [-1, -1, -1, 3, 3, 4],
        [-1, -1, -1, 9, -1, -1],
        [-1, 1, 1, 1, 1, -1],
    ]
    lp = out["logprobs"]
    assert lp.dtype == torch.float32 and out["input_ids"].dtype == torch.long
    expected = [
        [0, 0, 0, -0.1, -0.2, -0.3],
        [0, 0, 0, -0.1, 0, 0],
        [0, -0.1, -0.2, -0.3, -0.4, 0],
    ]
    assert torch.allclose(lp, torch.tensor(expected))
    # logprobs[i] belongs to input_ids[i]: exactly the generated positions carry one
    assert torch.equal(lp != 0, out["loss_mask"].bool())


def test_to_tensors_default_pad_and_zero_generation():
    empty_gen = make_trajectory([4, 5], [], finish_reason="length")
    group = Group(prompt_id="a", prompt=Prompt(), trajectories=[empty_gen, make_trajectory([4], [6])])
    out = Batch(groups=[group]).to_tensors()
    assert out["input_ids"].tolist() == [[4, 5], [4, 6]]
    assert out["loss_mask"].tolist() == [[0, 0], [0, 1]]
    assert out["token_epochs"].tolist() == [[-1, -1], [-1, 0]]


def test_to_tensors_empty_batch():
    out = Batch().to_tensors()
    assert out["input_ids"].shape == (0, 0)
    assert out["logprobs"].shape == (0, 0)
    assert out["input_lengths"].shape == (0,)


def test_sampling_defaults_and_checks():
    s = Sampling()
    assert (s.n, s.max_tokens, s.stop_token_ids) == (4, 128, [2])
    with pytest.raises(ValueError, match="min_tokens: 9 exceeds max_tokens 8"):
        Sampling(max_tokens=8, min_tokens=9)
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=float("nan"))


def test_a_progress_report_reads_as_a_mapping_of_its_trajectories():
    running = make_trajectory([5, 6], [7, 8], request_id="r1-0", epochs=[(0, 0), (1, 1)])
    done = make_trajectory([5, 6], [9], request_id="r1-1", finished_at=3.0)
    report = ProgressReport(msgspec.msgpack.encode([running, done]))
    assert len(report) == 2 and sorted(report) == ["r1-0", "r1-1"]
    assert report["r1-0"] == running and report.get("r1-1") == done
    assert report.get("r9-0") is None
    assert len(ProgressReport(msgspec.msgpack.encode([]))) == 0


def test_an_episode_is_one_row_with_observation_tokens_masked():
    ep = Trajectory(
        prompt_token_ids=[5, 6],
        token_ids=[7, 8, 9, 50, 51, 10, 11],
        logprobs=[-1.0, -1.0, -1.0, 0.0, 0.0, -2.0, -2.0],
        policy_epochs=[(0, 3), (3, -1), (5, 4)],
        loss_mask=[1, 1, 1, 0, 0, 1, 1],
        stale_tokens=2,
    )
    t = Batch(groups=[Group(prompt_id="p", prompt=Prompt(id="p"), trajectories=[ep])]).to_tensors()
    assert t["input_ids"][0].tolist() == [5, 6, 7, 8, 9, 50, 51, 10, 11]
    assert t["loss_mask"][0].tolist() == [0, 0, 0, 0, 1, 0, 0, 1, 1]  # the first 2 model tokens too stale
    assert t["token_epochs"][0].tolist() == [-1, -1, 3, 3, 3, -1, -1, 4, 4]
    assert t["logprobs"][0].tolist() == [0, 0, -1, -1, -1, 0, 0, -2, -2]
