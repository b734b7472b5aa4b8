"""Off-policy corrections against hand-computed values; logprob gaps of log(2) give ratios 0.5, 1, 2, 4."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from rollout.batch import grpo_advantages
from rollout.learner.offpolicy import (
    decoupled_ppo_loss,
    importance_weights,
    lag,
    masked_mean,
    staleness_mask,
)

LN2 = math.log(2.0)
NAN, INF = float("nan"), float("inf")


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


# --- masked_mean


def test_masked_mean_ignores_garbage_and_empty_mask_is_zero():
    assert masked_mean(t([1.0, 3.0, NAN]), t([1.0, 1.0, 0.0])).item() == 2.0
    x = t([NAN, INF, 5.0]).requires_grad_()
    out = masked_mean(x, t([0.0, 0.0, 0.0]))
    out.backward()
    assert out.item() == 0.0
    assert_close(x.grad, t([0.0, 0.0, 0.0]))


# --- GRPO advantages


def test_grpo_advantages_with_std():
    # [0, 0, 0, 3]: mean 0.75, centered [-0.75] * 3 + [2.25], unbiased var 6.75 / 3 = 2.25, std 1.5
    # [1, 2, 3, 2]: mean 2, centered [-1, 0, 1, 0], unbiased var 2 / 3
    adv = grpo_advantages(t([0.0, 0.0, 0.0, 3.0], [1.0, 2.0, 3.0, 2.0]))
    s = math.sqrt(2 / 3)
    assert_close(adv, t([-0.5, -0.5, -0.5, 1.5], [-1 / s, 0.0, 1 / s, 0.0]), atol=1e-5, rtol=1e-5)


def test_grpo_advantages_without_std():
    adv = grpo_advantages(t([0.0, 0.0, 0.0, 3.0], [1.0, 2.0, 3.0, 2.0]), normalize_std=False)
    assert_close(adv, t([-0.75, -0.75, -0.75, 2.25], [-1.0, 0.0, 1.0, 0.0]))


@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_identical_rewards_give_exact_zeros(normalize_std: bool):
    # eight float32 0.1s: the mean is off by one ulp, so a naive (r - mean) / (std + eps) gives -0.0074
    adv = grpo_advantages(torch.tensor([[0.1] * 8, [1.0, 0.0] * 4]), normalize_std=normalize_std)
    assert adv[0].tolist() == [0.0] * 8
    assert torch.isfinite(adv).all()
    single = grpo_advantages(t([5.0], [7.0]), normalize_std=normalize_std)  # n == 1
    assert single.tolist() == [[0.0], [0.0]]


def test_grpo_non_finite_reward_raises_with_index():
    with pytest.raises(ValueError, match=r"rewards\[1, 2\]"):
        grpo_advantages(t([0.0, 1.0, 0.0], [1.0, 0.0, NAN]))
    with pytest.raises(ValueError, match=r"rewards\[0, 0\]"):
        grpo_advantages(t([-INF, 1.0]))
    with pytest.raises(ValueError, match="num_groups, n"):
        grpo_advantages(torch.zeros(4))


# --- staleness


def test_lag_is_minus_one_on_prompt_and_padding():
    epochs = torch.tensor([[-1, -1, 5, 4, 3, -1]])
    assert lag(epochs, 5).tolist() == [[-1, -1, 0, 1, 2, -1]]


def test_staleness_keeps_lag_equal_to_max_lag_and_drops_one_more():
    # prompt (2 tokens), generated at epochs 5, 4, 3, 4, padding; learner at 5, max_lag 1
    epochs = torch.tensor([[-1, -1, 5, 4, 3, 4, -1]])
    loss_mask = t([0, 0, 1, 1, 1, 0, 0])  # the 4th generated token is masked out by the caller
    assert staleness_mask(epochs, 5, 1, loss_mask).tolist() == [[0, 0, 1, 1, 0, 0, 0]]
    assert staleness_mask(epochs, 5, 2, loss_mask).tolist() == [[0, 0, 1, 1, 1, 0, 0]]
    assert staleness_mask(epochs, 5, 0, loss_mask).tolist() == [[0, 0, 1, 0, 0, 0, 0]]


def test_staleness_never_counts_epoch_minus_one():
    epochs = torch.tensor([[-1, -1, 0, -1]])
    # even with a loss mask claiming the prompt and padding, and a huge max_lag
    assert staleness_mask(epochs, 0, 100, t([1, 1, 1, 1])).tolist() == [[0, 0, 1, 0]]


def test_staleness_rejects_future_epochs_and_negative_max_lag():
    with pytest.raises(ValueError, match="newer than learner_epoch 5"):
        staleness_mask(torch.tensor([[6]]), 5, 1, t([1]))
    with pytest.raises(ValueError, match="max_lag"):
        staleness_mask(torch.tensor([[5]]), 5, -1, t([1]))


# --- importance weights

BEHAVIOUR = -2.0


def logprobs(log_ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(learner, behaviour) logprobs whose differences are `log_ratios`."""
    behaviour = torch.full((len(log_ratios), len(log_ratios[0])), BEHAVIOUR)
    return behaviour + t(*log_ratios), behaviour


def test_tis_token_level_clamps_at_cap():
    learner, behaviour = logprobs([[-LN2, 0.0, LN2, 2 * LN2, 0.0]])  # ratios 0.5, 1, 2, 4; padding
    mask = t([1, 1, 1, 1, 0])
    w, new_mask = importance_weights(learner, behaviour, mask, level="token", mode="tis", cap=2.0)
    assert_close(w, t([0.5, 1.0, 2.0, 2.0, 0.0]))
    assert new_mask.tolist() == mask.tolist()
    w, _ = importance_weights(learner, behaviour, mask, mode="tis", cap=2.0, lower=0.75)
    assert_close(w, t([0.75, 1.0, 2.0, 2.0, 0.0]))


def test_tis_sequence_level_uses_product_over_masked_tokens():
    learner, behaviour = logprobs(
        [
            [LN2, LN2, -LN2],  # 2 * 2 * 0.5 = 2
            [LN2, LN2, 5.0],  # 2 * 2 = 4 (last is padding), truncated to 3
            [-LN2, -LN2, 0.0],  # 0.25, raised to lower 0.5
        ]
    )
    mask = t([1, 1, 1], [1, 1, 0], [1, 1, 0])
    w, new_mask = importance_weights(learner, behaviour, mask, level="sequence", mode="tis", cap=3.0, lower=0.5)
    assert_close(w, t([2.0, 2.0, 2.0], [3.0, 3.0, 0.0], [0.5, 0.5, 0.0]))
    assert new_mask.tolist() == mask.tolist()


def test_mis_token_level_masks_tokens_outside_bounds():
    learner, behaviour = logprobs([[-LN2, 0.0, LN2, 2 * LN2, 0.0]])  # 0.5, 1, 2, 4; padding
    mask = t([1, 1, 1, 1, 0])
    w, new_mask = importance_weights(learner, behaviour, mask, level="token", mode="mis", cap=3.0, lower=0.75)
    assert new_mask.tolist() == [[0, 1, 1, 0, 0]]
    assert_close(w, t([0.0, 1.0, 2.0, 0.0, 0.0]))
    w, new_mask = importance_weights(learner, behaviour, mask, mode="mis", cap=3.0)  # no lower bound
    assert new_mask.tolist() == [[1, 1, 1, 0, 0]]
    assert_close(w, t([0.5, 1.0, 2.0, 0.0, 0.0]))


def test_mis_sequence_level_masks_whole_sequences():
    learner, behaviour = logprobs([[LN2, LN2, -LN2], [LN2, LN2, 0.0], [-LN2, -LN2, 0.0]])  # 2, 4, 0.25
    mask = t([1, 1, 1], [1, 1, 0], [1, 1, 0])
    w, new_mask = importance_weights(learner, behaviour, mask, level="sequence", mode="mis", cap=3.0, lower=0.5)
    assert new_mask.tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0]]
    assert_close(w, t([2.0, 2.0, 2.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]))
    w, new_mask = importance_weights(learner, behaviour, mask, level="sequence", mode="mis", cap=3.0)
    assert new_mask.tolist() == [[1, 1, 1], [0, 0, 0], [1, 1, 0]]
    assert_close(w, t([2.0, 2.0, 2.0], [0.0, 0.0, 0.0], [0.25, 0.25, 0.0]))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_importance_weights_ignore_garbage_in_padding(level: str, mode: str):
    learner, behaviour = logprobs([[LN2, 0.0, 0.0, 0.0], [-LN2, LN2, 0.0, 0.0]])
    mask = t([1, 1, 0, 0], [1, 1, 1, 0])
    clean_w, clean_mask = importance_weights(learner, behaviour, mask, level=level, mode=mode, cap=3.0)
    learner[0, 2:] = t([NAN, INF])
    behaviour[0, 2:] = t([-INF, NAN])
    learner[1, 3], behaviour[1, 3] = -INF, -INF
    w, new_mask = importance_weights(learner, behaviour, mask, level=level, mode=mode, cap=3.0)
    assert torch.isfinite(w).all()
    assert_close(w, clean_w)
    assert new_mask.tolist() == clean_mask.tolist()
    if level == "token":
        assert_close(w, t([2.0, 1.0, 0.0, 0.0], [0.5, 2.0, 1.0, 0.0]))
    else:  # sequence ratios 2 and 0.5 * 2 * 1 = 1
        assert_close(w, t([2.0, 2.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]))


def test_non_finite_ratio_on_mask_is_dropped():
    learner, behaviour = logprobs([[LN2, 0.0, 0.0], [0.0, 0.0, 0.0]])
    learner[0, 1] = NAN
    behaviour[1, 2] = -INF  # log-ratio +inf
    mask = t([1, 1, 1], [1, 1, 1])
    w, new_mask = importance_weights(learner, behaviour, mask, level="token", mode="tis", cap=3.0)
    assert new_mask.tolist() == [[1, 0, 1], [1, 1, 0]]
    assert_close(w, t([2.0, 0.0, 1.0], [1.0, 1.0, 0.0]))
    w, new_mask = importance_weights(learner, behaviour, mask, level="sequence", mode="tis", cap=3.0)
    assert new_mask.tolist() == [[0, 0, 0], [0, 0, 0]]
    assert (w == 0).all()


def test_tis_does_not_overflow_and_weights_are_detached():
    learner = t([200.0, 0.0]).requires_grad_()  # exp(200) overflows float32
    w, new_mask = importance_weights(learner, t([0.0, 0.0]), t([1, 1]), level="token", mode="tis", cap=2.0)
    assert_close(w, t([2.0, 1.0]))
    assert not w.requires_grad
    with pytest.raises(ValueError, match="level"):
        importance_weights(learner, learner, t([1, 1]), level="batch")
    with pytest.raises(ValueError, match="mode"):
        importance_weights(learner, learner, t([1, 1]), mode="clip")


# --- decoupled PPO loss


def ppo_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1x3: proximal/behaviour weights 1, 2, 0.5 and current/proximal ratios 1, 2, 0.5."""
    behaviour = t([-1.0, -1.0, -1.0])
    proximal = behaviour + t([0.0, LN2, -LN2])
    current = proximal + t([0.0, LN2, -LN2])
    return current, proximal, behaviour


def test_decoupled_ppo_loss_hand_computed():
    current, proximal, behaviour = ppo_example()
    current.requires_grad_()
    # A = 1, clip to [0.8, 1.2]:
    #   token 0: r 1,   surrogate min(1, 1) = 1,        w 1   -> 1
    #   token 1: r 2,   surrogate min(2, 1.2) = 1.2 (clipped), w 2 -> 2.4
    #   token 2: r 0.5, surrogate min(0.5, 0.8) = 0.5,  w 0.5 -> 0.25
    # loss = -(1 + 2.4 + 0.25) / 3
    loss, metrics = decoupled_ppo_loss(current, proximal, behaviour, torch.tensor([1.0]), t([1, 1, 1]), clip_eps=0.2)
    assert loss.item() == pytest.approx(-3.65 / 3, rel=1e-6)
    assert metrics["clip_frac"].item() == pytest.approx(1 / 3)
    assert metrics["behaviour_weight_mean"].item() == pytest.approx(3.5 / 3, rel=1e-6)
    assert metrics["tokens"].item() == 3
    loss.backward()
    # d/d current = -w * A * r / 3 on unclipped tokens, 0 on the clipped one
    assert_close(current.grad, t([-1 / 3, 0.0, -0.25 / 3]))


def test_decoupled_ppo_loss_per_token_advantages_and_caps():
    current, proximal, behaviour = ppo_example()
    # per-token A = [1, -1, -1]:
    #   token 1: r 2, A -1: min(-2, -1.2) = -2 (not clipped), w 2 -> -4
    #   token 2: r 0.5, A -1: min(-0.5, -0.8) = -0.8 (clipped), w 0.5 -> -0.4
    loss, metrics = decoupled_ppo_loss(current, proximal, behaviour, t([1.0, -1.0, -1.0]), t([1, 1, 1]))
    assert loss.item() == pytest.approx(-(1 - 4 - 0.4) / 3, rel=1e-6)
    assert metrics["clip_frac"].item() == pytest.approx(1 / 3)
    # behaviour_cap 1.5 truncates w = 2 on token 1; clip_eps_high 1.5 lets r = 2 through (2 < 2.5)
    loss, metrics = decoupled_ppo_loss(
        current, proximal, behaviour, torch.tensor([1.0]), t([1, 1, 1]), clip_eps_high=1.5, behaviour_cap=1.5
    )
    assert loss.item() == pytest.approx(-(1 + 1.5 * 2 + 0.25) / 3, rel=1e-6)
    assert metrics["clip_frac"].item() == 0.0
    assert metrics["behaviour_weight_mean"].item() == pytest.approx(3.0 / 3, rel=1e-6)


def test_decoupled_ppo_equals_vanilla_ppo_when_proximal_is_behaviour():
    gen = torch.Generator().manual_seed(0)
    behaviour = -torch.rand(4, 6, generator=gen) * 3
    current = (behaviour + torch.randn(4, 6, generator=gen) * 0.3).requires_grad_()
    advantages = torch.randn(4, generator=gen)
    mask = (torch.rand(4, 6, generator=gen) > 0.3).float()
    loss, metrics = decoupled_ppo_loss(current, behaviour, behaviour, advantages, mask, clip_eps=0.2)

    r = (current - behaviour).exp()
    a = advantages[:, None]
    vanilla = -(torch.minimum(r * a, r.clamp(0.8, 1.2) * a) * mask).sum() / mask.sum()
    assert_close(loss, vanilla)
    assert metrics["behaviour_weight_mean"].item() == pytest.approx(1.0)
    grad = torch.autograd.grad(loss, current)[0]
    assert_close(grad, torch.autograd.grad(vanilla, current)[0])


def test_all_masked_batch_gives_zero_loss_and_finite_grads():
    current, proximal, behaviour = ppo_example()
    current.requires_grad_()
    loss, metrics = decoupled_ppo_loss(current, proximal, behaviour, torch.tensor([1.0]), t([0, 0, 0]))
    assert loss.item() == 0.0
    loss.backward()
    assert_close(current.grad, t([0.0, 0.0, 0.0]))
    assert metrics["tokens"].item() == 0
    assert metrics["clip_frac"].item() == 0.0


def test_garbage_in_padding_does_not_leak_into_loss():
    current, proximal, behaviour = ppo_example()
    clean, _ = decoupled_ppo_loss(current, proximal, behaviour, t([1.0, 1.0, 1.0]), t([1, 1, 1]))

    def pad(x: torch.Tensor, values: list[float]) -> torch.Tensor:
        return torch.cat([x, t(values)], dim=1)

    current_p = pad(current, [NAN, INF]).requires_grad_()
    proximal_p = pad(proximal, [INF, -INF])
    behaviour_p = pad(behaviour, [-INF, NAN])
    advantages = t([1.0, 1.0, 1.0, NAN, INF])
    loss, metrics = decoupled_ppo_loss(current_p, proximal_p, behaviour_p, advantages, t([1, 1, 1, 0, 0]))
    assert_close(loss, clean)
    assert torch.isfinite(metrics["behaviour_weight_mean"])
    loss.backward()
    assert torch.isfinite(current_p.grad).all()
    assert_close(current_p.grad, t([-1 / 3, 0.0, -0.25 / 3, 0.0, 0.0]))
