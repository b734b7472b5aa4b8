"""The NeMo RL-style generation interface without vLLM or Ray: the pure parts (padding check, rows
in, tensors out, pad id) by hand, and `RolloutGeneration` end to end over the fake engines."""

from __future__ import annotations

import json
from collections import UserDict
from contextlib import aclosing

import anyio
import pytest
import torch

from rollout.engine import RolloutEngine
from rollout.errors import InvalidPromptError
from rollout.nemo_rl import (
    GenerationError,
    RolloutGeneration,
    output_tensors,
    pad_id_from_model_dir,
    prompts_from_batch,
    verify_right_padding,
)
from rollout.types import Prompt, Request, Trajectory
from tests.support.fake_engine_runs import settled
from tests.support.fakes import FakeEngine, FakePool, fake_logprob, fake_token
from tests.support.generation import MAX_TOKENS, WEIGHTS, batch, wrapped


class BatchedDataDict(UserDict):
    """Stands in for NeMo RL's BatchedDataDict (a UserDict of tensors and lists)."""


# -- verify_right_padding ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        batch([[5, 6, 7], [8]]),
        batch([[5, 6, 7], [8]], width=6),
        batch([[5, 6], [7, 8]]),  # no padding at all
        {"input_ids": [[5, 0], [0, 0]], "input_lengths": [1, 0]},  # plain lists; an empty row
        {"output_ids": torch.tensor([[5, 6, 0]]), "unpadded_sequence_lengths": torch.tensor([2])},
        BatchedDataDict(batch([[5, 6, 7], [8]])),
    ],
)
def test_right_padded_batches_pass(data):
    assert verify_right_padding(data) == (True, None)


def test_a_custom_pad_value_is_what_padding_must_hold():
    data = batch([[5, 6, 7], [8]], pad=9)
    assert verify_right_padding(data, pad_value=9) == (True, None)
    ok, message = verify_right_padding(data, pad_value=0, raise_error=False)
    assert not ok and "row 1" in message and "[1, 2]" in message and "pad value 0" in message


def test_input_pair_is_checked_before_output_pair():
    data = {**batch([[5, 6], [7]]), **ids_and([[0, 5]], [1], "output_ids", "unpadded_sequence_lengths")}
    assert verify_right_padding(data) == (True, None)


def ids_and(ids, lengths, ids_key="input_ids", len_key="input_lengths") -> dict:
    return {ids_key: torch.tensor(ids), len_key: torch.tensor(lengths)}


NOT_PADDED = "is not right-padded with pad value 0: row"
BAD_PADDING = [
    (
        {"input_ids": torch.tensor([[5]])},
        "expected input_ids with input_lengths, or output_ids with unpadded_sequence_lengths; got keys ['input_ids']",
    ),
    (ids_and([5, 6], [2]), "input_ids: expected a 2-D [batch, sequence] tensor, got shape (2,)"),
    (
        ids_and([[0] * 3] * 2, [1]),
        "input_lengths: expected one length per row of input_ids, shape (2,), got shape (1,)",
    ),
    (ids_and([[0] * 3], [1.0]), "input_lengths: expected integer lengths, got torch.float32"),
    (ids_and([[0] * 3] * 2, [1, 4]), "input_lengths[1] = 4 exceeds the sequence dimension of input_ids (3)"),
    (ids_and([[0] * 3] * 2, [-1, 2]), "input_lengths[0] = -1 is negative"),
    (
        ids_and([[5, 6, 0, 0], [0, 0, 5, 6]], [2, 2]),
        f"input_ids {NOT_PADDED} 1 has length 2 but holds other values at positions [2, 3]",
    ),
    (
        ids_and([[5, 6, 7]], [1], "output_ids", "unpadded_sequence_lengths"),
        f"output_ids {NOT_PADDED} 0 has length 1 but holds other values at positions [1, 2]",
    ),
]


@pytest.mark.parametrize("data,message", BAD_PADDING, ids=[m.split(":")[0][:40] for _, m in BAD_PADDING])
def test_bad_padding_is_named(data, message):
    assert verify_right_padding(data, raise_error=False) == (False, message)
    with pytest.raises(ValueError) as e:
        verify_right_padding(data)
    assert str(e.value) == message


def test_long_runs_of_bad_positions_are_cut_short_and_pad_none_is_refused():
    data = {"input_ids": torch.full((1, 20), 7), "input_lengths": torch.tensor([2])}
    assert verify_right_padding(data, raise_error=False)[1].endswith("positions [2, 3, 4, 5, 6, 7, 8, 9, ...]")
    refused = (False, "pad_value is None: pass the tokenizer's pad token id")
    assert verify_right_padding(batch([[5]]), pad_value=None, raise_error=False) == refused


# -- rows in -------------------------------------------------------------------------------------


def test_each_row_becomes_one_prompt_with_its_own_stop_strings():
    data = batch([[5, 6, 7], [8], [9, 10]], width=5, stop_strings=[["x", "b"], None, "y"])
    prompts, width = prompts_from_batch(
        data, 0, greedy=True, sampling={"max_tokens": 7}, base_stop=["b"], id_prefix="g-row"
    )
    assert width == 5
    assert [p.token_ids for p in prompts] == [[5, 6, 7], [8], [9, 10]]
    assert [p.id for p in prompts] == ["g-row0", "g-row1", "g-row2"]
    greedy = {"max_tokens": 7, "n": 1, "temperature": 0.0, "top_k": 1}
    assert prompts[0].sampling == {**greedy, "stop": ["b", "x"]}  # configured stops first, no duplicates
    assert prompts[1].sampling == greedy  # no stop key: the configured ones apply unchanged
    assert prompts[2].sampling == {**greedy, "stop": ["b", "y"]}
    sampled, _ = prompts_from_batch(batch([[5]]), 0, sampling={"n": 3, "temperature": 0.5})
    assert sampled[0].sampling == {"n": 1, "temperature": 0.5}


BAD_ROWS = [
    (
        {"input_lengths": torch.tensor([1])},
        "data: generation needs a mapping with input_ids and input_lengths, got keys ['input_lengths']",
    ),
    (ids_and([[0, 5]], [1]), f"input_ids {NOT_PADDED} 0 has length 1 but holds other values at positions [1]"),
    (ids_and([[5.0, 0.0]], [1]), "input_ids: expected integer token ids, got torch.float32"),
    (ids_and([[5], [0]], [1, 0]), "input_lengths[1] is 0: every row needs at least one prompt token"),
    (batch([[5], [6]], stop_strings=[["x"]]), "stop_strings: expected one entry per row (2), got 1 entries"),
    (batch([[5], [6]], stop_strings="x"), "stop_strings: expected one entry per row (2), got a string"),
    (
        batch([[5], [6]], stop_strings=[None, [""]]),
        "stop_strings[1]: expected None, a string or non-empty strings, got ['']",
    ),
]


@pytest.mark.parametrize("data,message", BAD_ROWS, ids=[m.split(":")[0][:40] for _, m in BAD_ROWS])
def test_bad_rows_are_refused_with_the_reason(data, message):
    with pytest.raises(InvalidPromptError) as e:
        prompts_from_batch(data, 0)
    assert str(e.value) == message


# -- tensors out ---------------------------------------------------------------------------------


def test_output_rows_are_prompt_then_generation_with_aligned_logprobs_and_epochs():
    rows = [
        Trajectory(prompt_token_ids=[5, 6, 7], token_ids=[20, 21], logprobs=[-0.5, -1.5], policy_epochs=[(0, 3)]),
        Trajectory(
            prompt_token_ids=[8],
            token_ids=[30, 31, 32, 33],
            logprobs=[-1.0, -2.0, -3.0, -4.0],
            finish_reason="length",
            policy_epochs=[(0, 3), (2, 4)],
        ),
    ]
    out = output_tensors(rows, input_width=4, pad_value=9)
    keys = {"output_ids", "logprobs", "generation_lengths", "unpadded_sequence_lengths", "truncated", "token_epochs"}
    assert set(out) == keys
    assert out["output_ids"].tolist() == [[5, 6, 7, 20, 21, 9, 9, 9], [8, 30, 31, 32, 33, 9, 9, 9]]  # width 4 + 4
    assert out["logprobs"].tolist() == [[0, 0, 0, -0.5, -1.5, 0, 0, 0], [0, -1, -2, -3, -4, 0, 0, 0]]
    assert out["token_epochs"].tolist() == [[-1, -1, -1, 3, 3, -1, -1, -1], [-1, 3, 3, 4, 4, -1, -1, -1]]
    assert out["generation_lengths"].tolist() == [2, 4]
    assert out["unpadded_sequence_lengths"].tolist() == [5, 5]
    assert out["truncated"].tolist() == [False, True]
    assert out["output_ids"].dtype == torch.long and out["logprobs"].dtype == torch.float32
    assert verify_right_padding(out, pad_value=9) == (True, None)
    empty = output_tensors([], input_width=4, pad_value=0)
    assert empty["output_ids"].shape == (0, 4) and empty["generation_lengths"].shape == (0,)


def test_pad_id_comes_from_the_tokenizer_then_the_model_config(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    assert pad_id_from_model_dir(tmp_path) is None
    (tmp_path / "config.json").write_text('{"pad_token_id": 5}')
    assert pad_id_from_model_dir(tmp_path) == 5
    Tokenizer(WordLevel({"a": 0, "<unk>": 1, "<p>": 2}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": {"content": "<p>"}}))
    assert pad_id_from_model_dir(tmp_path) == 2
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": None}))
    assert pad_id_from_model_dir(tmp_path) == 5


# -- RolloutGeneration over fake engines ---------------------------------------------------------

ROWS = [[10, 11, 12], [13], [14, 15], [16, 17, 18, 19], [20], [21, 22]]


def expected_generation(prompt: list[int]) -> list[int]:
    return [fake_token(prompt, 0, i) for i in range(MAX_TOKENS)]


def assert_row(out: dict, r: int, prompt: list[int], width: int) -> None:
    p, gen = len(prompt), expected_generation(prompt)
    assert out["output_ids"][r].tolist() == prompt + gen + [0] * (width - p - len(gen))
    expected = [fake_logprob(t, i) for i, t in enumerate(gen)]
    assert out["logprobs"][r, p : p + len(gen)].tolist() == pytest.approx(expected)
    assert out["logprobs"][r, :p].abs().sum() == 0 and out["logprobs"][r, p + len(gen) :].abs().sum() == 0
    assert out["generation_lengths"][r] == MAX_TOKENS and out["unpadded_sequence_lengths"][r] == p + MAX_TOKENS
    assert bool(out["truncated"][r])


async def test_rows_come_back_in_input_order_one_sample_each(generation_cfg):
    pool = FakePool(2)
    async with wrapped(generation_cfg, pool) as gen:
        data = BatchedDataDict(batch(ROWS, stop_strings=[None, ["x"], None, None, None, None]))
        out = await gen.agenerate(data, greedy=True)
    width = 4 + MAX_TOKENS
    assert out["output_ids"].shape == (len(ROWS), width)
    for r, prompt in enumerate(ROWS):
        assert_row(out, r, prompt, width)
    requests = {r.prompt_id: r for e in pool.engines for r in e.requests}
    tag = next(iter(requests)).split(".")[0]  # gen<facade>.<call>-row<i>
    assert sorted(requests) == sorted(f"{tag}.0-row{i}" for i in range(len(ROWS)))
    assert all(r.sample_index == 0 and r.sampling.n == 1 for r in requests.values())
    assert all(r.sampling.temperature == 0.0 and r.sampling.top_k == 1 for r in requests.values())
    assert requests[f"{tag}.0-row1"].sampling.stop == ["cfg", "x"]  # the configured stop strings, then the row's
    assert requests[f"{tag}.0-row0"].sampling.stop == ["cfg"]


async def test_generate_async_yields_every_row_once_by_index(generation_cfg):
    async with wrapped(generation_cfg, FakePool(2)) as gen:
        seen = {}
        async for i, one in gen.generate_async(batch(ROWS)):
            assert i not in seen
            seen[i] = one
        empty = {"input_ids": torch.zeros((0, 3), dtype=torch.long), "input_lengths": torch.zeros(0, dtype=torch.long)}
        assert [x async for x in gen.generate_async(empty)] == []
        assert (await gen.agenerate(empty))["output_ids"].shape == (0, 3)
    assert sorted(seen) == list(range(len(ROWS)))
    for i, one in seen.items():
        assert one["output_ids"].shape == (1, 4 + MAX_TOKENS)
        assert_row(one, 0, ROWS[i], 4 + MAX_TOKENS)


async def test_overlapping_calls_each_get_their_own_rows(generation_cfg):
    pool = FakePool(2)
    gate = anyio.Event()
    for e in pool.engines:
        e.gate = gate
    results: dict[str, dict] = {}
    async with wrapped(generation_cfg, pool) as gen:

        async def whole(name: str, rows: list[list[int]]) -> None:
            results[name] = await gen.agenerate(batch(rows))

        async def streamed(name: str, rows: list[list[int]]) -> None:
            got = {i: one async for i, one in gen.generate_async(batch(rows))}
            results[name] = got

        async with anyio.create_task_group() as tg:
            tg.start_soon(whole, "a", ROWS[:3])
            tg.start_soon(streamed, "b", ROWS[3:])
            tg.start_soon(whole, "c", ROWS[1:2])
            await settled()
            gate.set()
    for r, prompt in enumerate(ROWS[:3]):
        assert_row(results["a"], r, prompt, 3 + MAX_TOKENS)
    assert_row(results["c"], 0, ROWS[1], 1 + MAX_TOKENS)
    assert sorted(results["b"]) == [0, 1, 2]
    for i, one in results["b"].items():
        assert_row(one, 0, ROWS[3 + i], 4 + MAX_TOKENS)


async def test_rows_left_behind_by_an_abandoned_stream_are_dropped(generation_cfg):
    async with wrapped(generation_cfg, FakePool(2)) as gen:
        async with aclosing(gen.generate_async(batch(ROWS))) as stream:
            async for _ in stream:
                break
        out = await gen.agenerate(batch([[30, 31]]))
        assert_row(out, 0, [30, 31], 2 + MAX_TOKENS)
        await settled()
        assert await gen.engine.next_group() is None  # nothing left over in the engine either
        other = RolloutGeneration(engine=gen.engine)  # a second facade on the same engine: its own rows only
        assert_row(await other.agenerate(batch([[30, 31]])), 0, [30, 31], 2 + MAX_TOKENS)


async def test_blocking_calls_work_from_a_thread_but_refuse_the_engine_loop(generation_cfg):
    async with wrapped(generation_cfg, FakePool(2)) as gen:
        with pytest.raises(RuntimeError, match="await agenerate"):
            gen.generate(batch([[5]]))
        out = await anyio.to_thread.run_sync(gen.generate, batch(ROWS[:2]))
        assert_row(out, 1, ROWS[1], 3 + MAX_TOKENS)


class FailingEngine(FakeEngine):
    """Fails every request whose prompt starts with token 99, as the engine reports a bad request."""

    def _trajectory(self, request: Request) -> Trajectory:
        traj = super()._trajectory(request)
        if request.token_ids and request.token_ids[0] == 99:
            return Trajectory(prompt_token_ids=traj.prompt_token_ids, finish_reason="error", error="boom")
        return traj


async def test_a_failed_row_raises_naming_the_row(generation_cfg):
    pool = FakePool([FailingEngine(0), FailingEngine(1)])
    async with wrapped(generation_cfg, pool) as gen:
        with pytest.raises(GenerationError) as e:
            await gen.agenerate(batch([[5], [99], [6], [99, 1]]))
        assert e.value.rows == {1: "boom", 3: "boom"}
        assert str(e.value) == "2 of 4 rows failed: row 1: boom; row 3: boom"
        yielded = []
        with pytest.raises(GenerationError, match="row 0: boom"):
            async for i, _ in gen.generate_async(batch([[99], [5]])):
                yielded.append(i)
        assert yielded in ([], [1])
        assert_row(await gen.agenerate(batch([[7]])), 0, [7], 1 + MAX_TOKENS)  # the engine goes on


async def test_bad_input_fails_before_anything_is_admitted(generation_cfg):
    pool = FakePool(2)
    async with wrapped(generation_cfg, pool) as gen:
        left_padded = {"input_ids": torch.tensor([[5, 6], [0, 7]]), "input_lengths": torch.tensor([2, 1])}
        ok, message = verify_right_padding(left_padded, raise_error=False)
        with pytest.raises(InvalidPromptError) as e:
            await gen.agenerate(left_padded)
        assert not ok and str(e.value) == message
        with pytest.raises(InvalidPromptError, match="outside the vocabulary"):
            await gen.agenerate(batch([[5], [300]]))
        await settled()
        assert await gen.engine.next_group() is None
    assert [e.requests for e in pool.engines] == [[], []]


async def test_a_learner_consuming_the_same_engine_meanwhile_gets_its_own_groups(generation_cfg):
    """Each call has a channel of its own: the engine's queue (the learner's) and the facade's calls
    never see each other's groups, whoever reads first."""
    async with wrapped(generation_cfg, FakePool(2)) as gen:
        gen.engine.feed([Prompt(token_ids=[5], id="mine")])
        await settled()
        out = await gen.agenerate(batch([[6], [7]]))
        assert_row(out, 1, [7], 1 + MAX_TOKENS)
        group = await gen.engine.next_group()
        assert group.prompt_id == "mine" and await gen.engine.next_group() is None


async def test_construction_checks(generation_cfg):
    with pytest.raises(ValueError, match="exactly one of"):
        RolloutGeneration()
    with pytest.raises(ValueError, match="n=1"):
        RolloutGeneration(generation_cfg, sampling={"n": 2})
    pool = FakePool(2)
    with pytest.raises(InvalidPromptError, match="sampling.temperature"):
        RolloutGeneration(generation_cfg, pool=pool, sampling={"temperature": -1.0})
    assert pool.shutdown_calls == 0  # refused before any engine started
    with pytest.raises(RuntimeError, match="async with"):
        RolloutGeneration(engine=RolloutEngine(generation_cfg, pool=pool))
    async with wrapped(generation_cfg, FakePool(2), pad_value=3) as gen:
        assert gen.pad_value == 3
        with pytest.raises(ValueError, match="need cfg"):
            RolloutGeneration(engine=gen.engine, pool=pool)
        with pytest.raises(RuntimeError, match="event loop"):
            await anyio.to_thread.run_sync(lambda: RolloutGeneration(engine=gen.engine))


def test_owning_the_engine_blocking_and_async_from_another_loop(generation_cfg):
    pool = FakePool(2)
    with RolloutGeneration(generation_cfg, pool=pool) as gen:
        assert gen.pad_value == 0  # config.json pad_token_id
        assert gen.prepare_for_generation() and gen.finish_generation()
        assert_row(gen.generate(batch(ROWS)), 2, ROWS[2], 4 + MAX_TOKENS)
        assert gen.update_weights(WEIGHTS) == 1 and gen.engine.epoch == 1
        assert [e.commits for e in pool.engines] == [[1], [1]]

        async def from_another_loop() -> tuple[dict, dict]:
            streamed = {i: one async for i, one in gen.generate_async(batch(ROWS[:3]))}
            return streamed, await gen.agenerate(batch(ROWS[:1]))

        streamed, whole = anyio.run(from_another_loop)
        assert sorted(streamed) == [0, 1, 2]
        assert_row(whole, 0, ROWS[0], 3 + MAX_TOKENS)
        assert whole["token_epochs"][0, 3:].tolist() == [1] * MAX_TOKENS  # served by the new weights
        assert gen.shutdown() and gen.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            gen.generate(batch([[5]]))
    assert pool.shutdown_calls == 1
