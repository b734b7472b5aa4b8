"""Helpers for the learner's side, none of them needed to generate: off-policy corrections
(`offpolicy`), exports to Megatron and NeMo Gym shapes (`export`), NeMo RL's batch dicts
(`nemo_tensors`).
"""

from rollout.learner.export import to_megatron
from rollout.learner.nemo_tensors import output_tensors, prompts_from_batch, verify_right_padding
from rollout.learner.offpolicy import decoupled_ppo_loss, importance_weights, masked_mean, staleness_mask

__all__ = [
    "decoupled_ppo_loss",
    "importance_weights",
    "masked_mean",
    "output_tensors",
    "prompts_from_batch",
    "staleness_mask",
    "to_megatron",
    "verify_right_padding",
]
