"""Exporters of a trajectory's tokens and epochs to Megatron-Core's and NeMo Gym's shapes.

Owns the mapping from our fields (docs/design/epochs.md: `policy_epochs` over generated
indices, `kv_epochs` over positions, `kv_recomputes`) to Megatron-Core's dynamic inference engine's
`policy_epoch`, `kv_cache_epoch`, `num_evictions`, which Megatron-RL and NeMo Gym read. Does not
change the trajectory.

Megatron's convention (positions: prompt 0..P-1, generated g_i at P+i; runs of
`(start_token_index, epoch)` over the whole sequence, each holding until the next one starts):
- a request starts both lists at `(0, epoch at admission)`. Each weight update while it runs
  appends `(P + G - 1, new epoch)` to both, G = tokens generated so far: the input position of the
  first step under the new weights. Expanded, `policy_epoch` at position x is the epoch of the step
  whose input is x, whose logits sampled the token at x + 1; so g_i's epoch is at P + i - 1.
- an eviction (KV dropped, recomputed when the request is scheduled again) re-stamps
  `kv_cache_epoch` to `[(0, epoch then)]` and leaves `policy_epoch` as it was; `num_evictions`
  counts them.
Ours maps onto it exactly: g_0's step processes the whole prompt (an update before g_0 reruns the
request at the new epoch, i.e. admits it there), so `policy_epoch = [(0, e_0)]` then
`(P + i - 1, e)` for each later run `(i, e)` of `policy_epochs`; `kv_cache_epoch` is our
`kv_epochs` (already `(0, epoch of the last recompute)`, then the update boundaries after it);
`num_evictions` is `len(kv_recomputes)` (`num_preemptions`): every drop and recompute of the KV,
by a `recompute` update, an `abort_resume` continuation or a move to another engine.

Worked example, P=4, T=6: g0..g2 sampled at epoch 3, an update, g3..g5 at epoch 4.
    ours      policy_epochs=[(0, 3), (3, 4)]   kv_epochs=[(0, 3), (6, 4)]   kv_recomputes=[]
    Megatron  policy_epoch=[(0, 3), (6, 4)]    kv_cache_epoch=[(0, 3), (6, 4)]   num_evictions=0
(G=3 at the update: boundary 4+3-1 = 6, the position of g2, the input of the step that sampled
g3.) Expanded per position 0..9: [3, 3, 3, 3, 3, 3, 4, 4, 4, 4]; g_i reads position 3+i: 3, 3, 3,
4, 4, 4 = `token_epochs()`. Back: `policy_epochs_from_megatron([(0, 3), (6, 4)], 4, 6)` gives
[(0, 3), (3, 4)]. In `recompute` mode the update recomputed positions 0..6 with epoch 4:
`kv_recomputes=[(3, 4)]`, `kv_cache_epoch=[(0, 4)]`, `num_evictions=1`, `policy_epoch` as above.
A trajectory without generated tokens has no epochs: empty lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout.epochs import append_run, kv_runs
from rollout.types import Trajectory


def to_megatron(traj: Trajectory) -> dict[str, Any]:
    """Megatron-Core's `policy_epoch`, `kv_cache_epoch` (lists of `(start_token_index, epoch)`
    tuples, as its requests hold them) and `num_evictions` (an int) for one trajectory; for an
    episode (`turns` set), each of the three is a list with one entry per turn."""
    if traj.turns:
        per_turn = [to_megatron(turn) for turn in traj.turns]
        return {key: [m[key] for m in per_turn] for key in ("policy_epoch", "kv_cache_epoch", "num_evictions")}
    p, t = len(traj.prompt_token_ids), len(traj.token_ids)
    if not t or not traj.policy_epochs:
        return {"policy_epoch": [], "kv_cache_epoch": [], "num_evictions": traj.num_preemptions}
    runs = [tuple(r) for r in traj.policy_epochs]
    policy = [(0, runs[0][1])] + [(p + i - 1, e) for i, e in runs[1:]]
    kv = traj.kv_epochs or kv_runs(p, t, runs, [tuple(r) for r in traj.kv_recomputes])
    return {"policy_epoch": policy, "kv_cache_epoch": [tuple(r) for r in kv], "num_evictions": traj.num_preemptions}


def to_nemo_gym(turns: Trajectory | Sequence[Trajectory]) -> dict[str, list[Any]]:
    """NeMo Gym's fields, one inner list per turn, as its Megatron backend collects them per
    output item: `prompt_token_ids`, `generation_token_ids`, `generation_log_probs`,
    `policy_epoch` / `kv_cache_epoch` (per turn, a list of `[start_token_index, epoch]` pairs over
    that turn's prompt + generation) and `num_evictions` (per turn, an int).

    A multi-turn episode passes its turns in order, or itself (`turns` set): each turn's prompt
    holds the conversation so far, and its indices count from that prompt's first token; a single
    trajectory is one turn.
    """
    if isinstance(turns, Trajectory):
        turns = turns.turns or [turns]  # an episode: its turns
    keys = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
    out: dict[str, list[Any]] = {k: [] for k in (*keys, "policy_epoch", "kv_cache_epoch", "num_evictions")}
    for t in turns:
        m = to_megatron(t)
        out["prompt_token_ids"].append(list(t.prompt_token_ids))
        out["generation_token_ids"].append(list(t.token_ids))
        out["generation_log_probs"].append(list(t.logprobs))
        out["policy_epoch"].append([[s, e] for s, e in m["policy_epoch"]])
        out["kv_cache_epoch"].append([[s, e] for s, e in m["kv_cache_epoch"]])
        out["num_evictions"].append(m["num_evictions"])
    return out


def expand_megatron_runs(runs: Sequence[Sequence[int]], length: int) -> list[int]:
    """Megatron `(start_token_index, epoch)` runs as one epoch per position 0..length-1.

    Starts never decrease; of runs with the same start (two updates with no step between them)
    the later one holds. Raises ValueError on runs that do not start at position 0 or go back.
    """
    if length == 0:
        return []
    if not runs or runs[0][0] != 0:
        raise ValueError(f"Megatron epoch runs must start at position 0, got {list(runs[:1])}")
    out: list[int] = []
    ends = [start for start, _ in runs[1:]] + [max(length, runs[-1][0])]
    for (start, epoch), end in zip(runs, ends):
        if end < start:
            raise ValueError(f"Megatron epoch run starts never decrease, got {list(runs)}")
        out.extend([epoch] * (min(end, length) - min(start, length)))
    return out


def policy_epochs_from_megatron(
    policy_epoch: Sequence[Sequence[int]], prompt_len: int, num_tokens: int
) -> list[tuple[int, int]]:
    """Our `policy_epochs` (runs over generated indices) from Megatron's `policy_epoch`: token i
    was sampled by the step whose input is position `prompt_len + i - 1`. Raises as
    `expand_megatron_runs`, and on an empty prompt."""
    if num_tokens == 0:
        return []
    if prompt_len < 1:
        raise ValueError("an empty prompt has no position whose logits sampled the first token")
    per_position = expand_megatron_runs(policy_epoch, prompt_len + num_tokens - 1)
    runs: list[tuple[int, int]] = []
    for i in range(num_tokens):
        append_run(runs, i, per_position[prompt_len + i - 1])
    return runs
