"""NeMo RL's batch shapes: right-padded rows in, generation output tensors out; pure functions.

Owns: `verify_right_padding` (NeMo RL's check, with messages naming the row and positions),
`prompts_from_batch` (one `n=1` Prompt per row), `output_tensors` (NeMo RL's output dict of CPU
tensors), `pad_id_from_model_dir`. No engine, no event loop: `rollout.nemo_rl` uses them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollout.epochs import fill_runs
from rollout.errors import InvalidPromptError
from rollout.packed import tensor
from rollout.types import Prompt, Trajectory

GREEDY = {"temperature": 0.0, "top_k": 1}
PAIRS = (("input_ids", "input_lengths"), ("output_ids", "unpadded_sequence_lengths"))


def verify_right_padding(
    data: Mapping[str, Any], pad_value: int | None = 0, raise_error: bool = True
) -> tuple[bool, str | None]:
    """Check that every position past a row's length holds `pad_value`.

    Checks `input_ids` against `input_lengths` when both are present, else `output_ids` against
    `unpadded_sequence_lengths`. Returns `(True, None)` or `(False, message)`; with `raise_error`
    (the default) raises ValueError with that message instead.
    """
    import torch

    def fail(message: str) -> tuple[bool, str | None]:
        if raise_error:
            raise ValueError(message)
        return False, message

    if pad_value is None:
        return fail("pad_value is None: pass the tokenizer's pad token id")
    if not isinstance(data, Mapping):
        return fail(f"expected a mapping of tensors (a dict or BatchedDataDict), got {type(data).__name__}")
    pair = next((p for p in PAIRS if p[0] in data and p[1] in data), None)
    if pair is None:
        pairs = "input_ids with input_lengths, or output_ids with unpadded_sequence_lengths"
        return fail(f"expected {pairs}; got keys {list(data.keys())}")
    ids_key, len_key = pair
    ids, lengths = torch.as_tensor(data[ids_key]), torch.as_tensor(data[len_key])
    if ids.ndim != 2:
        return fail(f"{ids_key}: expected a 2-D [batch, sequence] tensor, got shape {tuple(ids.shape)}")
    batch, width = ids.shape
    if lengths.ndim != 1 or lengths.shape[0] != batch:
        shape = tuple(lengths.shape)
        return fail(f"{len_key}: expected one length per row of {ids_key}, shape ({batch},), got shape {shape}")
    if lengths.is_floating_point() or lengths.is_complex():
        return fail(f"{len_key}: expected integer lengths, got {lengths.dtype}")
    lengths = lengths.to(device=ids.device, dtype=torch.long)
    if (lengths < 0).any():
        i = int((lengths < 0).nonzero()[0])
        return fail(f"{len_key}[{i}] = {int(lengths[i])} is negative")
    if (lengths > width).any():
        i = int((lengths > width).nonzero()[0])
        return fail(f"{len_key}[{i}] = {int(lengths[i])} exceeds the sequence dimension of {ids_key} ({width})")
    bad = (torch.arange(width, device=ids.device)[None, :] >= lengths[:, None]) & (ids != pad_value)
    if bad.any():
        i = int(bad.any(dim=1).nonzero()[0])
        positions = bad[i].nonzero().flatten().tolist()
        shown = ", ".join(map(str, positions[:8])) + (", ..." if len(positions) > 8 else "")
        return fail(
            f"{ids_key} is not right-padded with pad value {pad_value}: row {i} has length {int(lengths[i])} "
            f"but holds other values at positions [{shown}]"
        )
    return True, None


def prompts_from_batch(
    data: Mapping[str, Any],
    pad_value: int,
    *,
    greedy: bool = False,
    sampling: Mapping[str, Any] | None = None,
    base_stop: Sequence[str] = (),
    id_prefix: str = "row",
) -> tuple[list[Prompt], int]:
    """One `n=1` Prompt per row (`token_ids = input_ids[i, :input_lengths[i]]`), and the input width S.

    `sampling` overrides apply to every row; `greedy` adds temperature 0 / top_k 1. A row's
    `stop_strings` (a list, a string, or None) are added to `base_stop` (the configured ones) for
    that row only. Prompt ids are `{id_prefix}{i}`. Raises InvalidPromptError naming the problem:
    missing keys, a batch that is not right-padded (verify_right_padding's message), an empty
    row, non-integer ids, `stop_strings` not one per row.
    """
    import torch

    if not isinstance(data, Mapping) or "input_ids" not in data or "input_lengths" not in data:
        got = f"keys {list(data.keys())}" if isinstance(data, Mapping) else f"a {type(data).__name__}"
        raise InvalidPromptError(f"data: generation needs a mapping with input_ids and input_lengths, got {got}")
    checked = {"input_ids": data["input_ids"], "input_lengths": data["input_lengths"]}
    ok, message = verify_right_padding(checked, pad_value, raise_error=False)
    if not ok:
        raise InvalidPromptError(message)
    ids, lengths = torch.as_tensor(data["input_ids"]), torch.as_tensor(data["input_lengths"]).tolist()
    if ids.is_floating_point() or ids.is_complex():
        raise InvalidPromptError(f"input_ids: expected integer token ids, got {ids.dtype}")
    if 0 in lengths:
        raise InvalidPromptError(f"input_lengths[{lengths.index(0)}] is 0: every row needs at least one prompt token")
    base = {**(sampling or {}), "n": 1, **(GREEDY if greedy else {})}
    prompts = []
    for i, (length, stop) in enumerate(zip(lengths, _row_stops(data.get("stop_strings"), len(lengths)))):
        overrides = {**base, "stop": list(dict.fromkeys([*base_stop, *stop]))} if stop else base
        prompts.append(Prompt(token_ids=ids[i, :length].tolist(), id=f"{id_prefix}{i}", sampling=overrides))
    return prompts, ids.shape[1]


def _row_stops(stop_strings: Any, batch: int) -> list[list[str]]:
    if stop_strings is None:
        return [[] for _ in range(batch)]
    if isinstance(stop_strings, str) or len(stop_strings) != batch:
        got = "a string" if isinstance(stop_strings, str) else f"{len(stop_strings)} entries"
        raise InvalidPromptError(f"stop_strings: expected one entry per row ({batch}), got {got}")
    out = [[] if s is None else [s] if isinstance(s, str) else list(s) for s in stop_strings]
    for i, s in enumerate(out):
        if not all(isinstance(x, str) and x for x in s):
            raise InvalidPromptError(f"stop_strings[{i}]: expected None, a string or non-empty strings, got {s!r}")
    return out


def output_tensors(
    trajectories: Sequence[Trajectory], input_width: int, pad_value: int, dtype: Any = None
) -> dict[str, Any]:
    """NeMo RL's generation output, one row per trajectory, right-padded with `pad_value`.

    Width: `input_width` plus the longest generation (as NeMo RL's vLLM backend sizes it).
    `output_ids`: prompt then generated tokens. `logprobs`: the sampled token's logprob at each
    generated position, 0.0 on prompt and padding. `token_epochs`: the policy epoch of each
    generated token, -1 elsewhere. `truncated`: finish reason "length" with something generated.
    `output_ids` has `dtype` (default int64: NeMo RL keeps the dtype of `input_ids`). All on the CPU.
    """
    import torch

    gen = [len(t.token_ids) for t in trajectories]
    b, width = len(trajectories), input_width + max(gen, default=0)
    output_ids = torch.full((b, width), pad_value, dtype=dtype or torch.long)
    logprobs = torch.zeros((b, width), dtype=torch.float32)
    epochs = torch.full((b, width), -1, dtype=torch.long)
    for r, t in enumerate(trajectories):  # per row, never per token: packed data is read as buffers
        p, g = len(t.prompt_token_ids), len(t.token_ids)
        output_ids[r, :p] = tensor(t.prompt_token_ids, output_ids.dtype)
        output_ids[r, p : p + g] = tensor(t.token_ids, output_ids.dtype)
        logprobs[r, p : p + g] = tensor(t.logprobs, torch.float32)
        fill_runs(epochs[r, p : p + g], t.policy_epochs)
    return {
        "output_ids": output_ids,
        "logprobs": logprobs,
        "generation_lengths": torch.tensor(gen, dtype=torch.long),
        "unpadded_sequence_lengths": torch.tensor([len(t.prompt_token_ids) + len(t.token_ids) for t in trajectories]),
        "truncated": torch.tensor(
            [t.finish_reason == "length" and bool(t.token_ids) for t in trajectories], dtype=torch.bool
        ),
        "token_epochs": epochs,
    }


def pad_id_from_model_dir(path: str | Path) -> int | None:
    """The model's pad token id: the tokenizer's pad token, else config.json's `pad_token_id`; None if neither."""
    path = Path(path)
    if (path / "tokenizer_config.json").is_file() and (path / "tokenizer.json").is_file():
        pad = json.loads((path / "tokenizer_config.json").read_text()).get("pad_token")
        pad = pad.get("content") if isinstance(pad, dict) else pad
        if pad:
            from tokenizers import Tokenizer

            if (pad_id := Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id(pad)) is not None:
                return pad_id
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    return config.get("pad_token_id") if isinstance(config.get("pad_token_id"), int) else None
