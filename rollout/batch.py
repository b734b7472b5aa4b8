"""`Batch`: the complete groups of one learner step, and its training tensors (`to_tensors`: the
right-padded NeMo RL layout, GRPO group advantages). The off-policy corrections over this layout:
`rollout.learner.offpolicy`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from msgspec import Struct

from rollout.epochs import fill_runs
from rollout.packed import tensor
from rollout.types import Group, Trajectory

if TYPE_CHECKING:
    from torch import Tensor


class Batch(Struct):
    """Complete groups for one learner step."""

    groups: list[Group] = msgspec.field(default_factory=list)

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]

    def to_tensors(self, pad_id: int = 0, normalize_std: bool = True) -> dict[str, Any]:
        """Right-padded torch tensors, NeMo RL layout, one row per successful trajectory.

        `input_ids` = prompt + generation; `logprobs` aligned with `input_ids` (0 on prompt and
        padding); `token_epochs` (-1 on prompt and padding); `loss_mask` 1 on generated tokens
        (except the leading `stale_tokens` of a trajectory, masked as too stale). An episode is one
        row: its whole conversation, `loss_mask` 1 on model tokens only (observation tokens: 0,
        logprob 0, epoch -1).
        When every row has a reward: `rewards` and GRPO `advantages` (per group, over its
        successful samples; divided by the group's std when `normalize_std`).
        """
        import torch

        rows = [t for t in self.trajectories if t.ok]
        lengths = [len(t.prompt_token_ids) + len(t.token_ids) for t in rows]
        width = max(lengths, default=0)
        b = len(rows)
        input_ids = torch.full((b, width), pad_id, dtype=torch.long)
        logprobs = torch.zeros((b, width), dtype=torch.float32)
        epochs = torch.full((b, width), -1, dtype=torch.long)
        loss_mask = torch.zeros((b, width), dtype=torch.float32)
        for r, t in enumerate(rows):  # per row, never per token: packed ids and logprobs are read as buffers
            p, g = len(t.prompt_token_ids), len(t.token_ids)
            input_ids[r, :p] = tensor(t.prompt_token_ids, torch.long)
            input_ids[r, p : p + g] = tensor(t.token_ids, torch.long)
            logprobs[r, p : p + g] = tensor(t.logprobs, torch.float32)
            fill_runs(epochs[r, p : p + g], t.policy_epochs)
            if t.loss_mask:  # an episode: its model tokens, less the leading stale ones among them
                mask = torch.tensor(t.loss_mask, dtype=torch.float32)
                if t.stale_tokens:
                    mask[mask.nonzero()[: t.stale_tokens, 0]] = 0.0
                loss_mask[r, p : p + g] = mask
            else:
                loss_mask[r, p + min(t.stale_tokens, g) : p + g] = 1.0
        extra = {}
        if rows and all(t.reward is not None for t in rows):
            extra["rewards"] = torch.tensor([t.reward for t in rows], dtype=torch.float32)
            per_group = [[t.reward for t in g.trajectories if t.ok] for g in self.groups]
            extra["advantages"] = torch.cat(
                [grpo_advantages(torch.tensor([r], dtype=torch.float32), normalize_std)[0] for r in per_group if r]
            )
        return {
            **extra,
            "input_ids": input_ids,
            "input_lengths": torch.tensor([len(t.prompt_token_ids) for t in rows], dtype=torch.long),
            "generation_lengths": torch.tensor([len(t.token_ids) for t in rows], dtype=torch.long),
            "unpadded_sequence_lengths": torch.tensor(lengths, dtype=torch.long),
            "logprobs": logprobs,
            "token_epochs": epochs,
            "loss_mask": loss_mask,
        }


def grpo_advantages(rewards: Tensor, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantages of `rewards` shaped `[num_groups, n]` (one row per prompt), same shape.

    Each reward minus its group's mean, divided by `std + eps` when `normalize_std` (the unbiased
    std, as TRL and verl use). A group whose rewards are all equal (any group when n == 1) gets
    exactly 0. `.reshape(-1)` gives one advantage per row of `Batch.to_tensors()` when every
    trajectory is ok (rows come group by group). Raises ValueError on a non-finite reward.
    """
    import torch

    if rewards.ndim != 2:
        raise ValueError(f"rewards: expected shape [num_groups, n], got {tuple(rewards.shape)}")
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    bad = (~torch.isfinite(rewards)).nonzero()
    if len(bad):
        g, i = bad[0].tolist()
        raise ValueError(f"rewards[{g}, {i}]: reward must be finite, got {rewards[g, i].item()}")
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if normalize_std and rewards.shape[1] > 1:
        centered = centered / (rewards.std(dim=1, keepdim=True) + eps)
    flat = rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True)
    return torch.where(flat, 0.0, centered)
