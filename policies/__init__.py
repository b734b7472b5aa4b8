"""vLLM engines and what they load: the policy, the adapter over vLLM's internals, weight transfer.
The only package that imports vllm."""

from rollout import torch_addons  # noqa: F401  (first: before anything imports transformers or vLLM)
