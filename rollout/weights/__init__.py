"""Epochs and weight updates: the two-phase update, epochs and restarts (`updates`), and
vLLM's four weight-transfer calls over every engine with our guarantees (`transfer`).
"""

from rollout.weights.sync_client import WeightSyncClient
from rollout.weights.transfer import WeightTransfer
from rollout.weights.updates import WeightUpdates

__all__ = ["WeightSyncClient", "WeightTransfer", "WeightUpdates"]
