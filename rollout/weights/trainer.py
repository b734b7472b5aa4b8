"""The learner's half of weight transfer: what a learner imports to send its weights into the
engines over the backends this project registers in vLLM's factories (`gloo` on CPU between
processes, `shm` on one node), next to vLLM's own (`nccl`, `ipc`).

A learner written for vLLM builds its trainer with vLLM's `WeightTransferTrainerFactory` from an
init info and a weight source, over `engine.weight_sync_client()` or vLLM's
`HTTPVLLMWeightSyncClient` (docs/guides/weight-updates.md):

- `GlooTrainerInitInfo`: the `gloo` trainer's init info (`world_size`, `rank`, `bucket_bytes`,
  `timeout_s`; the address and port are found by the trainer).
- `ShmTrainerInitInfo`: the `shm` trainer's (the learner and the engines on one machine).
- `StateDictSource`: vLLM's `WeightSource` over a state dict (a `name_map` renames the learner's
  parameters to the model's), for either trainer; vLLM's `ModuleSource` works too.
- `GlooCollective`: the collective NeMo RL's refit broadcasts through (`rollout.nemo_rl`).

Owns: the public names, and nothing else: each is the engine side's own class
(`policies.gloo_transfer`, `policies.shm_wire`, `policies.gloo_wire`), imported on first use, so
`import rollout` does not load vLLM. The only module outside `policies/` that names
vLLM's weight-transfer classes (`tests/test_layers.py` holds it to that).
Does not own: the transfer itself (the engines' workers, `policies/`), the rounds and their
checks (`rollout.weights.transfer`).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from policies.gloo_transfer import GlooTrainerInitInfo, StateDictSource
    from policies.gloo_wire import GlooCollective
    from policies.shm_wire import ShmTrainerInitInfo

_HOME = {
    "GlooTrainerInitInfo": "policies.gloo_transfer",
    "StateDictSource": "policies.gloo_transfer",
    "GlooCollective": "policies.gloo_wire",
    "ShmTrainerInitInfo": "policies.shm_wire",
}
__all__ = ["GlooCollective", "GlooTrainerInitInfo", "ShmTrainerInitInfo", "StateDictSource"]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_HOME[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
