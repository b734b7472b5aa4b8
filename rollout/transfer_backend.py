"""Which weight-transfer backend the engines run, read from the config the same way by the driver
(`rollout.weights`) and by the engines (`policies.weight_loading`).

Owns: `transfer_backend` (the backend's name), `stages` (whether it stages the bytes before the
load) and `STAGING`. Does not own: the backends (ours: `policies.gloo_transfer`,
`policies.shm_transfer`; vLLM's `nccl`, `ipc`), the engine args that name one (`policies.vllm_args`).
"""

from __future__ import annotations

from typing import Any

GLOO = "gloo"  # ours on CPU, by the name `policies.gloo_transfer` registers
STAGING = ("gloo", "shm")  # backends of ours: bytes staged until finish, waits bounded by their init's timeout_s


def transfer_backend(cfg: Any) -> str:
    """The engines' vLLM weight-transfer backend: `engines.vllm.weight_transfer_config`'s, else
    `nccl` on GPUs and ours, `gloo`, on CPU (`policies.vllm_args`)."""
    conf = cfg.engines.vllm.get("weight_transfer_config") or {}
    backend = conf.get("backend") if isinstance(conf, dict) else getattr(conf, "backend", None)
    return backend or ("nccl" if cfg.engines.gpus_per_engine else GLOO)


def stages(cfg: Any) -> bool:
    """Whether the engines' backend stages the bytes before the load: ours, `gloo` and `shm`."""
    return transfer_backend(cfg) in STAGING
