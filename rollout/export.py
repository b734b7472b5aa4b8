"""Exporters of a trajectory's tokens and epochs to the shapes other RL stacks read.

Index conventions (README, "Per-token epochs"): in both exports, epoch runs are
`(start_token_index, epoch)` over the WHOLE sequence, prompt then generation, index 0 = the first
prompt token; a run holds until the next one starts.
- `policy_epoch`: runs over generated tokens only, so its first start is the prompt length P.
- `kv_cache_epoch`: runs over the positions that hold a KV entry, 0..P+T-2 (the last generated
  token is never fed back, so it has none).
- `num_evictions`: times the request's KV was dropped and recomputed.

Worked example: prompt of 4 tokens, 6 generated; g0..g2 sampled at epoch 3, an update, g3..g5 at
epoch 4, in `keep` mode: `policy_epoch = [(4, 3), (7, 4)]`, `kv_cache_epoch = [(0, 3), (6, 4)]`
(position 6 holds g2, fed in the step that sampled g3 with epoch 4), `num_evictions = 0`. In
`recompute` mode the update recomputed positions 0..6 with epoch 4: `kv_cache_epoch = [(0, 4)]`,
`num_evictions = 1`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout.types import Trajectory


def to_megatron(traj: Trajectory) -> dict[str, Any]:
    """Megatron-Core inference style: `policy_epoch`, `kv_cache_epoch`, `num_evictions`."""
    p = len(traj.prompt_token_ids)
    return {
        "policy_epoch": [(p + i, e) for i, e in traj.policy_epochs],
        "kv_cache_epoch": [tuple(r) for r in traj.kv_epochs],
        "num_evictions": traj.num_preemptions,
    }


def to_nemo_gym(turns: Trajectory | Sequence[Trajectory]) -> dict[str, list[Any]]:
    """NeMo Gym style: one inner list per turn for tokens, logprobs and the three epoch fields.

    A multi-turn episode passes its turns in order (each turn's prompt holds the conversation
    so far); a single trajectory is one turn.
    """
    turns = [turns] if isinstance(turns, Trajectory) else list(turns)
    out: dict[str, list[Any]] = {
        k: []
        for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "policy_epoch", "kv_cache_epoch", "num_evictions")
    }
    for t in turns:
        m = to_megatron(t)
        out["prompt_token_ids"].append(list(t.prompt_token_ids))
        out["generation_token_ids"].append(list(t.token_ids))
        out["generation_log_probs"].append(list(t.logprobs))
        for key in ("policy_epoch", "kv_cache_epoch", "num_evictions"):
            out[key].append(m[key])
    return out
