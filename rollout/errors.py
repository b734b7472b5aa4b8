"""The error hierarchy, split by what the caller does about it.

- `RetryableError`: try again later (engine busy, timed out).
- `EngineDeadError`: an engine is gone; fatal for the requests it held unless they are moved.
- `InvalidPromptError`: this prompt (or its sampling values) is bad; fix the input, nothing else stops.
- `InvalidConfigError`: the config is bad; nothing was started. The message names the key path.
Exceptions from vllm and ray are translated into these at the boundary (`raise ... from e`).
"""


class RolloutError(Exception):
    """Base of every error this package raises on purpose."""


class RetryableError(RolloutError):
    pass


class EngineDeadError(RolloutError):
    pass


class InvalidPromptError(RolloutError, ValueError):
    pass


class InvalidConfigError(RolloutError, ValueError):
    pass
