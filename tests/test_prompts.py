"""Prompt validation, per-prompt sampling overrides, and the prompt sources."""

from __future__ import annotations

import json

import pytest

from rollout.config import PromptsConfig
from rollout.errors import InvalidPromptError
from rollout.inputs.prompts import (
    BadPrompt,
    ModelLimits,
    as_async,
    check_prompt,
    coerce,
    configured_prompts,
    effective_sampling,
    jsonl_prompts,
    synthetic_prompts,
)
from rollout.types import Prompt, Sampling

LIMITS = ModelLimits(vocab_size=260, max_model_len=64, max_n=8)
SAMPLING = Sampling(max_tokens=16)


def test_check_prompt_accepts_valid_prompts():
    check_prompt(Prompt(token_ids=[0, 259], id="a"), SAMPLING, LIMITS)
    check_prompt(Prompt(token_ids=[5] * 48, id="b"), SAMPLING, LIMITS)  # 48 + 16 == max_model_len
    check_prompt(Prompt(text="x" * 1000, id="c"), SAMPLING, LIMITS)  # text length is the engine's to check


@pytest.mark.parametrize(
    "prompt, message",
    [
        (Prompt(token_ids=[5, 260], id="a"), r"prompt 'a': token id 260 outside the vocabulary \[0, 260\)"),
        (Prompt(token_ids=[-1, 5], id="a"), r"prompt 'a': token id -1 outside the vocabulary"),
        (Prompt(token_ids=[], id="a"), r"prompt 'a': empty token_ids"),
        (Prompt(text="", id="a"), r"prompt 'a': empty text"),
        (Prompt(token_ids=[5], text="x", id="a"), r"prompt 'a': give exactly one of token_ids or text"),
        (Prompt(id="a"), r"prompt 'a': give exactly one of token_ids or text"),
        (
            Prompt(token_ids=[5] * 49, id="a"),
            r"prompt 'a': 49 prompt tokens \+ max_tokens 16 exceed max_model_len 64",
        ),
    ],
)
def test_check_prompt_errors(prompt, message):
    with pytest.raises(InvalidPromptError, match=f"^{message}"):
        check_prompt(prompt, SAMPLING, LIMITS)


def test_check_prompt_uses_the_given_sampling():
    prompt = Prompt(token_ids=[5] * 40, id="a")
    check_prompt(prompt, Sampling(max_tokens=24), LIMITS)
    with pytest.raises(InvalidPromptError, match="max_tokens 25 exceed"):
        check_prompt(prompt, Sampling(max_tokens=25), LIMITS)
    with pytest.raises(
        InvalidPromptError,
        match=r"^prompt 'a': sampling.stop_token_ids\[1\]: 260 outside the vocabulary \(vocab size 260\)",
    ):
        check_prompt(prompt, Sampling(max_tokens=8, stop_token_ids=[2, 260]), LIMITS)


def test_effective_sampling_without_overrides_is_the_base():
    base = Sampling(n=3)
    assert effective_sampling(base, Prompt(token_ids=[5])) is base


def test_effective_sampling_applies_overrides():
    base = Sampling(n=3, temperature=0.7, stop_token_ids=[2, 9])
    s = effective_sampling(base, Prompt(token_ids=[5], sampling={"max_tokens": 8, "temperature": 0, "seed": 11}))
    assert s == Sampling(n=3, temperature=0.0, max_tokens=8, stop_token_ids=[2, 9], seed=11)
    assert base.max_tokens == 128  # the base is untouched


@pytest.mark.parametrize(
    "override, field",
    [
        ({"n": 0}, "sampling.n:"),
        ({"max_tokens": 0}, "sampling.max_tokens:"),
        ({"top_p": 0}, "sampling.top_p:"),
        ({"top_p": 1.5}, "sampling.top_p:"),
        ({"temperature": -0.1}, "sampling.temperature:"),
        ({"temperature": float("nan")}, "sampling.temperature:"),
        ({"foo": 1}, "sampling.foo: unknown key"),
        ({"n": "2"}, "sampling.n:"),
        ({"min_tokens": 200}, "sampling.min_tokens: 200 exceeds max_tokens 128"),
        ({"stop_token_ids": [-1]}, r"sampling.stop_token_ids\[0\]:"),
        ({"stop": ["x", ""]}, r"sampling.stop\[1\]: empty"),
    ],
)
def test_effective_sampling_bad_overrides(override, field):
    with pytest.raises(InvalidPromptError, match=f"^prompt 'q': {field}"):
        effective_sampling(Sampling(), Prompt(token_ids=[5], id="q", sampling=override))


def test_synthetic_prompts_are_seeded_and_bounded():
    cfg = PromptsConfig(count=50, min_len=3, max_len=9, seed=7)
    a = synthetic_prompts(cfg, vocab_size=260)
    assert a == synthetic_prompts(cfg, vocab_size=260)
    assert a != synthetic_prompts(PromptsConfig(count=50, min_len=3, max_len=9, seed=8), vocab_size=260)
    assert len(a) == 50
    assert [p.id for p in a] == [f"syn-{i}" for i in range(50)]
    lengths = {len(p.token_ids) for p in a}
    assert min(lengths) >= 3 and max(lengths) <= 9
    assert len(lengths) > 1  # lengths are drawn, not fixed
    ids = [t for p in a for t in p.token_ids]
    assert min(ids) >= 4 and max(ids) < 260  # no special ids
    for p in a:
        check_prompt(p, Sampling(max_tokens=8), ModelLimits(vocab_size=260, max_model_len=32, max_n=8))


def test_synthetic_prompts_fixed_length():
    prompts = synthetic_prompts(PromptsConfig(count=5, min_len=4, max_len=4), vocab_size=10)
    assert all(len(p.token_ids) == 4 and all(4 <= t < 10 for t in p.token_ids) for p in prompts)


async def collect(source) -> list:
    return [item async for item in source]


async def test_jsonl_prompts_bad_line_yields_bad_prompt_and_goes_on(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [
        json.dumps({"token_ids": [5, 6], "id": "first"}),
        "{not json",
        "",
        json.dumps({"text": "hello"}),
        json.dumps({"tokens": [1]}),
        json.dumps({"token_ids": [7], "sampling": {"max_tokens": 4}, "metadata": {"answer": 1}}),
    ]
    path.write_text("\n".join(lines) + "\n")
    items = await collect(jsonl_prompts(path))
    assert len(items) == 5
    assert items[0] == Prompt(token_ids=[5, 6], id="first")
    assert isinstance(items[1], BadPrompt)
    assert items[1].id == "p.jsonl:2" and items[1].reason.startswith("line 2: not JSON")
    assert items[2] == Prompt(text="hello", id="p.jsonl:4")  # no id: file and line
    assert isinstance(items[3], BadPrompt)
    assert items[3].id == "p.jsonl:5" and items[3].reason == "line 5: tokens: unknown key"
    assert items[4] == Prompt(token_ids=[7], id="p.jsonl:6", sampling={"max_tokens": 4}, metadata={"answer": 1})


async def test_configured_prompts(tmp_path):
    synthetic = configured_prompts(PromptsConfig(count=3, min_len=2, max_len=2), vocab_size=260)
    assert isinstance(synthetic, list) and len(synthetic) == 3
    path = tmp_path / "p.jsonl"
    path.write_text('{"token_ids": [5]}\n')
    items = await collect(configured_prompts(PromptsConfig(source="jsonl", path=str(path)), vocab_size=260))
    assert items == [Prompt(token_ids=[5], id="p.jsonl:1")]
    with pytest.raises(InvalidPromptError, match="prompts.path: no such file"):
        configured_prompts(PromptsConfig(source="jsonl", path=str(tmp_path / "missing.jsonl")), vocab_size=260)


async def test_as_async_takes_sync_and_async_iterables():
    async def agen():
        yield 1
        yield 2

    assert await collect(as_async([1, 2])) == [1, 2]
    assert await collect(as_async(iter((3, 4)))) == [3, 4]
    assert await collect(as_async(agen())) == [1, 2]


@pytest.mark.parametrize(
    "item, expected",
    [
        ("hi", Prompt(text="hi")),
        ([4, 5], Prompt(token_ids=[4, 5])),
        ((6,), Prompt(token_ids=[6])),
        ({"token_ids": [1], "id": "q", "metadata": {"a": 1}}, Prompt(token_ids=[1], id="q", metadata={"a": 1})),
        (Prompt(text="x", id="same"), Prompt(text="x", id="same")),
        (BadPrompt(id="b", reason="r"), BadPrompt(id="b", reason="r")),
    ],
)
def test_coerce(item, expected):
    assert coerce(item) == expected


@pytest.mark.parametrize(
    "item, bad_id, reason",
    [
        (5, "", "cannot make a prompt from a int"),
        (None, "", "cannot make a prompt from a NoneType"),
        ({"tokens": [1], "id": "z"}, "z", "tokens: unknown key"),
        (["a"], "", "token_ids[0]: expected `int`, got `str`"),
        ({"text": 3}, "", "text: expected `str | null`, got `int`"),
    ],
)
def test_coerce_bad_items(item, bad_id, reason):
    out = coerce(item)
    assert out == BadPrompt(id=bad_id, reason=reason)


def test_model_limits_from_model_dir(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 260}')
    assert ModelLimits.from_model_dir(tmp_path, 512, 8) == ModelLimits(vocab_size=260, max_model_len=512, max_n=8)
    nested = tmp_path / "vlm"
    nested.mkdir()
    (nested / "config.json").write_text('{"text_config": {"vocab_size": 1000}}')
    assert ModelLimits.from_model_dir(nested, 8, 4).vocab_size == 1000
