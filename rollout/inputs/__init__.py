"""What users give the engine: prompts (sources, coercion, the checks against the model), reward
functions, and calling user code (an environment's steps, a reward) so that what it raises is its own.
"""

from rollout.inputs.prompts import (
    BadPrompt,
    ModelLimits,
    check_all,
    check_prompt,
    configured_prompts,
    effective_sampling,
)
from rollout.inputs.rewards import RewardFn, load_reward, score
from rollout.inputs.usercode import UserCodeError, invoke

__all__ = [
    "BadPrompt",
    "ModelLimits",
    "RewardFn",
    "UserCodeError",
    "check_all",
    "check_prompt",
    "configured_prompts",
    "effective_sampling",
    "invoke",
    "load_reward",
    "score",
]
