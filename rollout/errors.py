"""The error hierarchy, split by what the caller does about it.

- `RetryableError`: try again later (engine busy, timed out).
- `EngineDeadError`: an engine is gone; fatal for the requests it held unless they are moved.
- `EngineClosedError`: the `RolloutEngine` is not running (outside or after its `async with`).
- `InvalidPromptError`: this prompt (or its sampling values) is bad; fix the input, nothing else stops.
- `InvalidConfigError`: the config is bad; nothing was started. The message names the key path.
- `InvalidWeightsError`: weights that do not fit the model (names, shapes, dtypes); no engine touched.
- `WeightSyncError`: a weight update failed on some engines (`failed` lists them); they are out of
  rotation, every other engine serves the new epoch.
Exceptions from vllm and ray are translated into these at the boundary (`raise ... from e`).
"""


class RolloutError(Exception):
    """Base of every error this package raises on purpose."""


class RetryableError(RolloutError):
    pass


class EngineDeadError(RolloutError):
    pass


class EngineClosedError(RolloutError, RuntimeError):
    """The engine is not running (used outside its `async with`, or after it exited)."""


class InvalidPromptError(RolloutError, ValueError):
    pass


class InvalidConfigError(RolloutError, ValueError):
    pass


class InvalidWeightsError(RolloutError, ValueError):
    pass


class WeightSyncError(RolloutError):
    def __init__(self, message: str, failed: list[int]):
        super().__init__(message)
        self.failed = failed
