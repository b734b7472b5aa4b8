"""Prompt sources and prompt validation.

Owns: turning what a user feeds (a list, an iterator, an async iterator, a JSONL file, synthetic
prompts with a length distribution) into one async stream of `Prompt`s, and checking each prompt
against the model (vocabulary, `max_model_len`) and its effective sampling values.
A bad item in a lazily read source becomes a `BadPrompt` for the scheduler to report; it never
stops the stream.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import msgspec

from rollout.config import PromptsConfig, readable_validation_error
from rollout.errors import InvalidPromptError
from rollout.types import Prompt, Sampling, not_utf8_in, printable


class BadPrompt(msgspec.Struct, frozen=True):
    """A source item that is not a valid prompt; reported as a failed group."""

    id: str
    reason: str


class Checked(msgspec.Struct, frozen=True):
    """A prompt that passed `check_prompt` (`check_all`), with the sampling it runs with: the
    scheduler runs it as it is, without checking it again."""

    prompt: Prompt
    sampling: Sampling


class ModelLimits(msgspec.Struct, frozen=True):
    """What a prompt is checked against: the model's vocabulary and length, the largest group."""

    vocab_size: int
    max_model_len: int
    max_n: int  # a group runs on one engine: n <= engines.max_inflight_per_engine

    @classmethod
    def from_model_dir(cls, path: str | Path, max_model_len: int, max_n: int) -> ModelLimits:
        config = json.loads((Path(path) / "config.json").read_text())
        vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
        return cls(vocab_size=int(vocab), max_model_len=max_model_len, max_n=max_n)


def effective_sampling(base: Sampling, prompt: Prompt) -> Sampling:
    """The prompt's sampling overrides applied to `base`. Raises InvalidPromptError naming the field."""
    if not prompt.sampling:
        return base
    if (bad := not_utf8_in(prompt.sampling, "sampling")) is not None:  # msgspec would raise UnicodeEncodeError
        raise InvalidPromptError(f"prompt {printable(prompt.id)!r}: {bad}")
    if prompt.sampling.get("logprobs", base.logprobs) != base.logprobs:
        raise InvalidPromptError(
            f"prompt {prompt.id!r}: sampling.logprobs is engine-wide (vLLM's logprobs_mode), "
            f"{base.logprobs!r} here; set it in the config"
        )
    merged = {**msgspec.structs.asdict(base), **prompt.sampling}
    try:
        return msgspec.convert(merged, Sampling)
    except msgspec.ValidationError as e:
        raise InvalidPromptError(f"prompt {prompt.id!r}: sampling.{readable_validation_error(e)}") from e


def sampling_problem(sampling: Sampling, vocab_size: int) -> str | None:
    """Why `sampling` cannot run on a model of `vocab_size` tokens ("stop_token_ids[1]: ..."), or
    None. The checks that need the model; `Sampling` checks the rest itself. Used for each prompt
    and for the config (`rollout validate`)."""
    for i, t in enumerate(sampling.stop_token_ids):
        if t >= vocab_size:  # vLLM indexes the logits with them (min_tokens): one outside would crash the engine
            return f"stop_token_ids[{i}]: {t} outside the vocabulary (vocab size {vocab_size})"
    return None


def check_prompt(prompt: Prompt, sampling: Sampling, limits: ModelLimits) -> None:
    """Raise InvalidPromptError with the reason if the prompt cannot run as given."""
    if (bad := not_utf8_in(msgspec.structs.asdict(prompt), "")) is not None:
        raise InvalidPromptError(f"prompt {printable(prompt.id)!r}: {bad.lstrip('.')}")
    name = f"prompt {prompt.id!r}"
    if sampling.n > limits.max_n:
        raise InvalidPromptError(
            f"{name}: sampling.n {sampling.n} exceeds engines.max_inflight_per_engine {limits.max_n}"
        )
    if (bad := sampling_problem(sampling, limits.vocab_size)) is not None:
        raise InvalidPromptError(f"{name}: sampling.{bad}")
    if prompt.session is not None and sampling.n != 1:
        raise InvalidPromptError(
            f"{name}: a session continues one conversation: sampling.n must be 1, got {sampling.n}"
        )
    if (prompt.token_ids is None) == (prompt.text is None):
        raise InvalidPromptError(f"{name}: give exactly one of token_ids or text")
    if prompt.text is not None:
        if not prompt.text:
            raise InvalidPromptError(f"{name}: empty text")
        if sampling.max_tokens >= limits.max_model_len:  # at least one prompt token; the rest is checked once tokenized
            raise InvalidPromptError(
                f"{name}: max_tokens {sampling.max_tokens} leaves no room in max_model_len {limits.max_model_len}"
            )
        return
    ids = prompt.token_ids or []
    if not ids:
        raise InvalidPromptError(f"{name}: empty token_ids")
    if min(ids) < 0 or max(ids) >= limits.vocab_size:  # at C speed: a prompt's ids, per group
        bad = next(t for t in ids if not 0 <= t < limits.vocab_size)
        raise InvalidPromptError(f"{name}: token id {bad} outside the vocabulary [0, {limits.vocab_size})")
    if len(ids) + sampling.max_tokens > limits.max_model_len:
        raise InvalidPromptError(
            f"{name}: {len(ids)} prompt tokens + max_tokens {sampling.max_tokens} exceed "
            f"max_model_len {limits.max_model_len}"
        )


def check_all(prompts: list[Any], base: Sampling, limits: ModelLimits) -> list[Checked]:
    """Every prompt coerced and checked against the model (`base`: the config's sampling), with
    the sampling it runs with; raises InvalidPromptError naming each bad one, and admits none of them."""
    items = [coerce(p) for p in prompts]
    checked, problems = [], []
    for i, item in enumerate(items):
        try:
            if isinstance(item, BadPrompt):
                raise InvalidPromptError(item.reason)
            if isinstance(item, Checked):  # checked already (a list fed again)
                item = item.prompt
            sampling = effective_sampling(base, item)
            check_prompt(item, sampling, limits)
            checked.append(Checked(item, sampling))
        except InvalidPromptError as e:
            problems.append(f"[{i}] {e}")
    if problems:
        raise InvalidPromptError(f"{len(problems)} of {len(items)} prompts rejected: " + "; ".join(problems))
    return checked


def synthetic_prompts(cfg: PromptsConfig, vocab_size: int) -> list[Prompt]:
    """`cfg.count` prompts of random tokens, lengths uniform in [min_len, max_len], seeded."""
    rng = random.Random(cfg.seed)
    low = min(4, vocab_size - 1)  # skip the usual special ids (pad, bos, eos, unk)
    return [
        Prompt(
            token_ids=[rng.randrange(low, vocab_size) for _ in range(rng.randint(cfg.min_len, cfg.max_len))],
            id=f"syn-{i}",
        )
        for i in range(cfg.count)
    ]


async def jsonl_prompts(path: str | Path) -> AsyncIterator[Prompt | BadPrompt]:
    """Prompts from a JSONL file, one `Prompt` object per line; a bad line yields a BadPrompt."""
    decoder = msgspec.json.Decoder(Prompt)
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompt = decoder.decode(line)
            except msgspec.ValidationError as e:
                yield BadPrompt(
                    id=f"{Path(path).name}:{lineno}", reason=f"line {lineno}: {readable_validation_error(e)}"
                )
                continue
            except msgspec.DecodeError as e:
                yield BadPrompt(id=f"{Path(path).name}:{lineno}", reason=f"line {lineno}: not JSON: {e}")
                continue
            yield prompt if prompt.id else msgspec.structs.replace(prompt, id=f"{Path(path).name}:{lineno}")


def configured_prompts(cfg: PromptsConfig, vocab_size: int) -> list[Prompt] | AsyncIterator[Prompt | BadPrompt]:
    """The prompt source a config names (`prompts:` block)."""
    if cfg.source == "jsonl":
        assert cfg.path is not None
        if not Path(cfg.path).is_file():
            raise InvalidPromptError(f"prompts.path: no such file {cfg.path!r}")
        return jsonl_prompts(cfg.path)
    return synthetic_prompts(cfg, vocab_size)


async def as_async(source: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
    if isinstance(source, AsyncIterable):
        async for item in source:
            yield item
    else:
        for item in source:
            yield item


def coerce(item: Any) -> Prompt | BadPrompt | Checked:
    """Accept a Prompt, a list of token ids, a string, or a dict with Prompt fields. Types are
    checked here (a Prompt made in code too: its constructor checks none), text is checked to be
    UTF-8 in `check_prompt`. What `check_all` passed stays as it is."""
    if isinstance(item, (BadPrompt, Checked)):
        return item
    if isinstance(item, Prompt):
        item = msgspec.structs.asdict(item)
    elif isinstance(item, str):
        item = {"text": item}
    elif isinstance(item, (list, tuple)):
        item = {"token_ids": list(item)}
    if not isinstance(item, dict):
        return BadPrompt(id="", reason=f"cannot make a prompt from a {type(item).__name__}")
    name = printable(item.get("id", ""))
    if (bad := not_utf8_in({k: v for k, v in item.items() if k not in Prompt.__struct_fields__}, "")) is not None:
        return BadPrompt(id=name, reason=bad.lstrip("."))  # an unknown key msgspec could not even name
    try:
        return msgspec.convert(item, Prompt)
    except msgspec.ValidationError as e:
        return BadPrompt(id=name, reason=readable_validation_error(e))
