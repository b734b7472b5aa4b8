"""Epochs and weight updates: the two-phase update, epochs and restarts (`updates`), and
vLLM's four weight-transfer calls over every engine with our guarantees (`transfer`).
"""

from rollout.weights.transfer import WeightSyncClient, WeightTransfer
from rollout.weights.updates import WeightUpdates

__all__ = ["WeightSyncClient", "WeightTransfer", "WeightUpdates"]
