"""The NeMo RL-style generation interface against the real engines: the contract its docs promise.

Uses the session engine pair (tiny model, float32, `sampling.max_tokens=16`, EOS id 2). The tiny
tokenizer is byte-level: id = byte + 4, printable ASCII decodes to itself.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import anyio
import pytest
import torch
from tokenizers import Tokenizer

from rollout import InvalidPromptError, Prompt, RolloutEngine
from rollout.nemo_rl import RolloutGeneration, verify_right_padding

LONG = 24  # max_tokens of the greedy tests (rows may still stop early on EOS)
GREEDY = {"n": 1, "temperature": 0.0, "top_k": 1, "max_tokens": LONG}


def right_padded(rows: list[list[int]], width: int, **extra) -> dict:
    return {
        "input_ids": torch.tensor([r + [0] * (width - len(r)) for r in rows]),
        "input_lengths": torch.tensor([len(r) for r in rows]),
        **extra,
    }


def random_rows(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 260) for _ in range(rng.randint(3, 20))] for _ in range(count)]


def generated(out: dict, r: int) -> list[int]:
    p = int(out["unpadded_sequence_lengths"][r] - out["generation_lengths"][r])
    return out["output_ids"][r, p : int(out["unpadded_sequence_lengths"][r])].tolist()


async def engine_greedy(engine: RolloutEngine, rows: list[list[int]]):
    """The same rows straight through the engine: the trajectories the facade must reproduce."""
    engine.feed([Prompt(token_ids=r, id=f"ref-{i}", sampling=GREEDY) for i, r in enumerate(rows)])
    with anyio.fail_after(120):
        groups = [g async for g in engine.groups()]
    return {int(g.prompt_id.split("-")[1]): g.trajectories[0] for g in groups}


@pytest.fixture
async def gen(engine):  # async: created on the engine's event loop
    return RolloutGeneration(engine=engine, sampling={"max_tokens": LONG})


@pytest.fixture
def tokenizer(engine):
    return Tokenizer.from_file(str(Path(engine.model_path) / "tokenizer.json"))


async def test_generate_returns_the_engines_trajectories_row_for_row(engine, gen):
    rows = random_rows(6, seed=1)
    data = right_padded(rows, width=22)
    with anyio.fail_after(120):
        out = await anyio.to_thread.run_sync(gen.generate, data, True)  # the blocking NeMo RL call
    ref = await engine_greedy(engine, rows)

    gen_len = [len(ref[i].token_ids) for i in range(6)]
    width = 22 + max(gen_len)
    assert out["output_ids"].shape == (6, width) and out["logprobs"].shape == (6, width)
    assert verify_right_padding(out, pad_value=gen.pad_value) == (True, None)
    assert out["generation_lengths"].tolist() == gen_len
    assert out["unpadded_sequence_lengths"].tolist() == [len(r) + g for r, g in zip(rows, gen_len)]
    assert out["truncated"].tolist() == [ref[i].finish_reason == "length" for i in range(6)]
    for i, row in enumerate(rows):
        p, end = len(row), len(row) + gen_len[i]
        assert out["output_ids"][i, :p].tolist() == row  # row i out is row i in
        assert generated(out, i) == ref[i].token_ids
        # logprobs line up with output_ids: the engine's logprob of the token at that position
        assert out["logprobs"][i, p:end].tolist() == pytest.approx(ref[i].logprobs, abs=1e-4)
        assert out["logprobs"][i, :p].abs().sum() == 0 and out["logprobs"][i, end:].abs().sum() == 0
        # the shared engines' epoch (no update ran here): where the tests before left it
        assert out["token_epochs"][i].tolist() == [-1] * p + [engine.epoch] * gen_len[i] + [-1] * (width - end)


async def test_generate_async_streams_every_row_once_and_greedy_is_the_argmax(engine, gen):
    rows = random_rows(5, seed=2)
    data = right_padded(rows, width=20)
    with anyio.fail_after(120):
        whole = await gen.agenerate(data, greedy=True)
        streamed = {}
        async for i, one in gen.generate_async(data, greedy=True):
            assert i not in streamed
            streamed[i] = one
        sampled = await gen.agenerate(data)
    assert sorted(streamed) == list(range(5))
    for i, one in streamed.items():
        width = 20 + int(whole["generation_lengths"][i])  # a one-row result: S + its own generation
        assert one["output_ids"].shape == (1, width)
        assert one["output_ids"][0].tolist() == whole["output_ids"][i, :width].tolist()
        assert one["logprobs"][0].tolist() == pytest.approx(whole["logprobs"][i, :width].tolist(), abs=1e-4)
        for key in ("generation_lengths", "unpadded_sequence_lengths", "truncated"):
            assert one[key].tolist() == [whole[key][i].item()]
    # greedy picks the most likely token: sampling at temperature 1 from a random model does not
    assert sum(generated(sampled, i) != generated(whole, i) for i in range(5)) >= 4
    gen_lp = sampled["logprobs"][sampled["token_epochs"] >= 0]
    assert all(math.isfinite(x) and x < 0 for x in gen_lp.tolist())
    assert gen_lp.mean() < whole["logprobs"][whole["token_epochs"] >= 0].mean()


def first_printable(tokens: list[int], start: int, exclude: str = "") -> int:
    """Index of the first token at >= start whose byte is printable ASCII, not seen before, not in `exclude`."""
    for k in range(start, len(tokens)):
        t = tokens[k]
        if 36 <= t < 131 and t not in tokens[:k] and chr(t - 4) not in exclude:
            return k
    raise AssertionError(f"no usable stop character in {tokens}")


async def test_stop_strings_stop_only_their_own_row(engine, gen, tokenizer):
    prompt = [40, 41, 42, 43]
    with anyio.fail_after(120):
        first = await gen.agenerate(right_padded([prompt], 4), greedy=True)
        free, free_truncated = generated(first, 0), bool(first["truncated"][0])
        k = first_printable(free, 2)
        j = first_printable(free, k + 1, exclude=chr(free[k] - 4))
        s, t = chr(free[k] - 4), chr(free[j] - 4)
        data = right_padded([prompt] * 4, 4, stop_strings=[[s], None, t, ["\x7f\x7f"]])
        out = await gen.agenerate(data, greedy=True)

    rows = [generated(out, r) for r in range(4)]
    assert rows[0] == free[: k + 1] and rows[2] == free[: j + 1]  # the stop string's token is kept
    assert rows[1] == free and rows[3] == free  # no stop string / one that never shows up: runs on
    assert out["truncated"].tolist() == [False, free_truncated, False, free_truncated]
    assert out["generation_lengths"].tolist() == [k + 1, len(free), j + 1, len(free)]
    text = [tokenizer.decode(r) for r in rows]
    assert text[0].endswith(s) and s not in text[0][:-1]
    assert text[2].endswith(t) and t not in text[2][:-1]
    assert s in text[1] and t in text[1]


async def test_truncated_means_length_and_generation_lengths_count_the_generated_positions(engine):
    stops = [2, *range(4, 24)]  # EOS (always a stop) and ~8% of the vocabulary: most rows stop early
    gen = RolloutGeneration(engine=engine, sampling={"stop_token_ids": stops})
    rows = random_rows(48, seed=3)
    with anyio.fail_after(120):
        out = await gen.agenerate(right_padded(rows, 20))
    max_tokens = engine.cfg.sampling.max_tokens
    lengths = out["generation_lengths"]
    truncated = out["truncated"].tolist()
    for i in range(48):
        tokens = generated(out, i)
        assert len(tokens) == lengths[i] >= 1
        assert not any(x in stops for x in tokens[:-1])
        assert truncated[i] == (tokens[-1] not in stops)
        if truncated[i]:
            assert len(tokens) == max_tokens
    assert 0 < sum(truncated) < 48
    assert lengths.sum() == (out["logprobs"] != 0).sum() == (out["token_epochs"] >= 0).sum()
    assert lengths.sum() == (out["unpadded_sequence_lengths"] - torch.tensor([len(r) for r in rows])).sum()


BAD_BATCHES = [
    {"input_ids": torch.tensor([[5, 6, 7], [0, 8, 9]]), "input_lengths": torch.tensor([3, 2])},  # left-padded
    {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 0]]), "input_lengths": torch.tensor([3, 1])},  # length too short
    {"input_ids": torch.tensor([[5, 6, 7]]), "input_lengths": torch.tensor([3, 1])},
    {"input_ids": torch.tensor([5, 6, 7]), "input_lengths": torch.tensor([3])},
]


@pytest.mark.parametrize("data", BAD_BATCHES, ids=["left-padded", "short-length", "count-mismatch", "1-D"])
async def test_a_batch_that_is_not_right_padded_fails_with_the_verify_message(engine, gen, data):
    ok, message = verify_right_padding(data, pad_value=0, raise_error=False)
    assert not ok
    with pytest.raises(InvalidPromptError) as e:
        await anyio.to_thread.run_sync(gen.generate, data)
    assert str(e.value) == message
    with anyio.fail_after(30):
        assert [g async for g in engine.groups()] == []  # nothing was admitted


async def test_pad_value_and_lifecycle(engine, gen):
    assert gen.pad_value == 0  # the tiny tokenizer's <pad>
    assert gen.prepare_for_generation() is True and gen.finish_generation() is True
    assert gen.shutdown() and gen.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        await gen.agenerate(right_padded([[5]], 1))
    assert len(await engine_greedy(engine, [[5, 6]])) == 1  # a wrapped engine stays up for its owner
