"""Asynchronous, actor-based rollout engine for LLM reinforcement learning."""

from rollout import torch_addons  # noqa: F401  (first: before anything imports transformers or vLLM)
from rollout.batch import Batch
from rollout.config import Config, load_config
from rollout.engine import RolloutEngine
from rollout.epochs import expand_runs
from rollout.errors import EngineDeadError, InvalidConfigError, InvalidPromptError, RetryableError, RolloutError
from rollout.nemo_rl import GenerationError, RolloutGeneration, verify_right_padding
from rollout.sync_engine import SyncRolloutEngine
from rollout.types import Group, Prompt, Sampling, Trajectory

__all__ = [
    "Batch",
    "Config",
    "EngineDeadError",
    "GenerationError",
    "Group",
    "InvalidConfigError",
    "InvalidPromptError",
    "Prompt",
    "RetryableError",
    "RolloutEngine",
    "RolloutError",
    "RolloutGeneration",
    "Sampling",
    "SyncRolloutEngine",
    "Trajectory",
    "expand_runs",
    "load_config",
    "verify_right_padding",
]
