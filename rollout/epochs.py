"""Epoch runs: the algebra of `Trajectory`'s per-token epoch fields (exact meaning in the README,
"Per-token epochs").

`policy_epochs` is a list of `(first generated index, epoch)` runs, the weights whose logits
sampled each generated token; `kv_epochs` is a list of `(first position, epoch)` runs over prompt +
generated positions, the weights that computed each KV entry as held at the end; `kv_recomputes`
lists `(generated index j, epoch)`: before token j was sampled, every position before it was
recomputed with that epoch. A run holds until the next one starts. `expand_runs` turns runs into
one value per token, `fill_runs` writes them into a tensor row, `kv_runs` derives `kv_epochs`,
`append_run` records a change.
"""

from __future__ import annotations

from typing import Any


def expand_runs(runs: list[tuple[int, int]], length: int) -> list[int]:
    """Expand `(first index, value)` runs into `length` values. Raises ValueError on bad runs."""
    if length == 0:
        return []
    if not runs or runs[0][0] != 0:
        raise ValueError(f"runs must start at index 0, got {runs[:1]}")
    out: list[int] = []
    for (start, value), (end, _) in zip(runs, [*runs[1:], (length, 0)]):
        if end <= start:
            raise ValueError(f"runs must have increasing starts, got {runs}")
        out.extend([value] * (end - start))
    return out[:length]


def fill_runs(row: Any, runs: list[tuple[int, int]]) -> None:
    """Write `(first index, value)` runs into the tensor `row` (`expand_runs`, without a Python int
    per position). Raises ValueError on bad runs, as `expand_runs` does."""
    length = len(row)
    if length == 0:
        return
    if not runs or runs[0][0] != 0:
        raise ValueError(f"runs must start at index 0, got {runs[:1]}")
    for (start, value), (end, _) in zip(runs, [*runs[1:], (length, 0)]):
        if end <= start:
            raise ValueError(f"runs must have increasing starts, got {runs}")
        row[start:end] = value


def kv_runs(
    prompt_len: int,
    num_tokens: int,
    policy_epochs: list[tuple[int, int]],
    kv_recomputes: list[tuple[int, int]],
    reused: int = 0,
    before: list[tuple[int, int]] | tuple = (),
) -> list[tuple[int, int]]:
    """`kv_epochs` implied by the policy epochs and recompute points.

    KV entries exist for positions 0..P+T-2 (the last token is never fed back). Without a
    recompute, position P+i-1 was computed by the step that sampled token i, so it has token i's
    policy epoch, and the prompt has token 0's, except the first `reused` positions of an
    episode's turn, which keep the epochs `before` (the turn before's `kv_epochs`) gives them.
    A recompute at token j recomputed 0..P+j-1.
    """
    if num_tokens == 0:
        return []
    if kv_recomputes:
        base, epoch = kv_recomputes[-1]
        runs = [(0, epoch)]
    else:
        base, runs = 0, [tuple(r) for r in before if r[0] < reused] if reused else []
        append_run(runs, reused if runs else 0, policy_epochs[0][1])
    for start, e in policy_epochs:
        if start > base:
            append_run(runs, prompt_len + start - 1, e)
    return runs


def append_run(runs: list[tuple[int, int]], index: int, value: int) -> None:
    """Record that the tokens from `index` on carry `value` (no-op when the value is unchanged)."""
    if not runs or runs[-1][1] != value:
        runs.append((index, value))
