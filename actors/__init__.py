"""Ray actor shells and cluster plumbing. The only package that imports ray."""

from rollout import torch_addons  # noqa: F401  (first: an engine actor's process imports vLLM next)
