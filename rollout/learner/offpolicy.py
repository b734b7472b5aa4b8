"""Off-policy corrections for the learner: pure torch over `Batch.to_tensors()` layouts, no engine
(GRPO advantages: `rollout.batch`).

Owns: staleness filtering by policy epoch, behaviour importance weights
(truncated, TIS, or masked, MIS; per token or per sequence) and the decoupled PPO loss (AReaL).

Conventions: per-token tensors are `[batch, tokens]`, right-padded, aligned with `input_ids`;
`mask` is 0/1 (1 on the tokens that count, normally `loss_mask`). Values outside the mask are
never read, so padding may hold garbage (NaN, -inf). Logprob ratios are always learner over
behaviour (the engine's logprobs). Importance weights carry no gradient.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """`sum(x * mask) / max(sum(mask), 1)`: the mean over a 0/1 mask, 0 for an empty mask.

    `x` outside the mask is ignored even when it is NaN or inf, and gets a zero gradient.
    """
    return (torch.where(mask != 0, x, 0.0) * mask).sum() / mask.sum().clamp(min=1)


def lag(token_epochs: Tensor, learner_epoch: int) -> Tensor:
    """`learner_epoch - token_epoch` per token; -1 where `token_epochs` is -1 (prompt, padding)."""
    return torch.where(token_epochs >= 0, learner_epoch - token_epochs, -1)


def staleness_mask(token_epochs: Tensor, learner_epoch: int, max_lag: int, loss_mask: Tensor) -> Tensor:
    """`loss_mask` kept where the token's lag is at most `max_lag` (lag == max_lag is kept).

    Tokens with epoch -1 (prompt, padding) are never kept. Raises ValueError when `max_lag` is
    negative or a token's epoch is newer than `learner_epoch` (the epochs are mislabelled).
    """
    if max_lag < 0:
        raise ValueError(f"max_lag: must be >= 0, got {max_lag}")
    newest = int(token_epochs.max()) if token_epochs.numel() else -1
    if newest > learner_epoch:
        raise ValueError(f"token epoch {newest} is newer than learner_epoch {learner_epoch}")
    lags = lag(token_epochs, learner_epoch)
    keep = (token_epochs >= 0) & (lags <= max_lag)
    return loss_mask * keep.to(loss_mask.dtype)


def importance_weights(
    learner_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    level: Literal["token", "sequence"] = "token",
    mode: Literal["tis", "mis"] = "tis",
    cap: float = 2.0,
    lower: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Detached learner/behaviour importance weights and the mask they leave: `(weights, new_mask)`.

    `level="token"`: ratio `exp(lp_learner - lp_behaviour)` per token. `level="sequence"`: `exp` of
    the sum of a sequence's token log-ratios over `mask`, the same value on each of its tokens.
    `mode="tis"` truncates the ratio to `[lower, cap]` (`lower=None`: no lower bound) and keeps
    every token; `mode="mis"` keeps the ratio as is and drops each token (token level) or whole
    sequence (sequence level) whose ratio is outside `[lower, cap]`. A token with a non-finite
    log-ratio on the mask is dropped, and at sequence level so is its sequence. `weights` is 0
    wherever `new_mask` is 0; shapes are those of the inputs, `[batch, tokens]`.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"level: expected 'token' or 'sequence', got {level!r}")
    if mode not in ("tis", "mis"):
        raise ValueError(f"mode: expected 'tis' or 'mis', got {mode!r}")
    if not cap > 0:
        raise ValueError(f"cap: must be > 0, got {cap}")
    if lower is not None and not 0 <= lower <= cap:
        raise ValueError(f"lower: must be in [0, cap={cap}], got {lower}")
    dtype = torch.promote_types(torch.promote_types(learner_logprobs.dtype, behaviour_logprobs.dtype), torch.float32)
    on = mask != 0
    log_ratio = torch.where(on, learner_logprobs.detach().to(dtype) - behaviour_logprobs.detach().to(dtype), 0.0)
    finite = torch.isfinite(log_ratio)
    log_ratio = torch.where(finite, log_ratio, 0.0)
    if level == "sequence":
        finite = finite.all(dim=-1, keepdim=True).expand_as(log_ratio)
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    keep = on & finite
    if mode == "tis":
        ratio = log_ratio.clamp(max=math.log(cap)).exp()  # clamped in log space: no overflow
        if lower is not None:
            ratio = ratio.clamp(min=lower)
    else:
        ratio = log_ratio.exp()
        keep = keep & (ratio <= cap) & (ratio >= (lower or 0.0))
    return torch.where(keep, ratio, 0.0), mask * keep.to(mask.dtype)


def decoupled_ppo_loss(
    current_logprobs: Tensor,
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    behaviour_cap: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The decoupled PPO objective (AReaL): clip against the proximal policy, reweight to behaviour.

    `r = exp(current - proximal)`, surrogate `min(r * A, clip(r, 1 - clip_eps, 1 + clip_eps_high) * A)`
    (`clip_eps_high=None`: `clip_eps`), behaviour weight `w = exp(proximal - behaviour)`, detached,
    truncated at `behaviour_cap` when given. Loss `-sum(w * surrogate * mask) / max(sum(mask), 1)`:
    0 with a zero gradient when nothing is masked in. With proximal == behaviour it is vanilla PPO.
    Only `current_logprobs` gets a gradient. `advantages` is per token `[batch, tokens]` or per
    sequence `[batch]`. Values outside `mask` are ignored (garbage there is fine).

    Metrics, detached 0-dim tensors: `clip_frac` (masked tokens whose gradient the clip zeroes),
    `behaviour_weight_mean` (mean `w` after truncation), `tokens` (`sum(mask)`).
    """
    if behaviour_cap is not None and not behaviour_cap > 0:
        raise ValueError(f"behaviour_cap: must be > 0, got {behaviour_cap}")
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    on = mask != 0
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    advantages = torch.where(on, advantages.detach(), 0.0)
    proximal = proximal_logprobs.detach()
    ratio = torch.where(on, current_logprobs - proximal, 0.0).exp()
    behaviour_log_w = torch.where(on, proximal - behaviour_logprobs.detach(), 0.0)
    if behaviour_cap is not None:
        behaviour_log_w = behaviour_log_w.clamp(max=math.log(behaviour_cap))
    weight = behaviour_log_w.exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + eps_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    loss = -masked_mean(weight * surrogate, mask)
    metrics = {
        "clip_frac": masked_mean((clipped < unclipped).to(mask.dtype), mask).detach(),
        "behaviour_weight_mean": masked_mean(weight, mask).detach(),
        "tokens": mask.sum().detach(),
    }
    return loss, metrics
