"""vLLM's scheduler, except that a request it preempts for KV cache ends instead (engine-core side).

vLLM preempts a running request when the KV cache cannot hold the next step: it frees the
request's blocks and later recomputes its KV, possibly from prefix-cache blocks computed by older
weights, possibly across a weight update, and tells no one where. Here such a request *ends*:
finish reason `abort`, stop reason `EVICTED`, with every token it produced. The front-end
(`policies.vllm_policy`) continues the sample as a new request (prompt + tokens so far, salted with
the current epoch), which records the recompute exactly like an `abort_resume` continuation:
`kv_recomputes` gets `(tokens so far, epoch of the next token)`.

Preemptions vLLM makes to reset the cache for a weight update in `recompute` mode stay vLLM's own
(the front-end records those at the update). The classes are picked by vLLM through
`SchedulerConfig.scheduler_cls` (one for sync scheduling, one for async) and run in the engine-core
process. Their hooks (`_preempt_request`, `reset_prefix_cache`, `update_from_output`,
`_free_request`) are checked against the installed vLLM by `policies.vllm_adapter.check_vllm`.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import RequestStatus

from policies.vllm_adapter import EVICTED


class _Evicting:
    """Mixed into vLLM's scheduler classes (first base: its methods wrap theirs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rollout_evicted: list[Any] = []  # ended since the last output was built
        self._rollout_resetting = False

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        self._rollout_resetting = True  # its preemptions are an update's (recompute mode): vLLM's own
        try:
            return super().reset_prefix_cache(*args, **kwargs)
        finally:
            self._rollout_resetting = False

    def _preempt_request(self, request: Any, timestamp: float, drop_stale_output: bool = False) -> None:
        if self._rollout_resetting:
            return super()._preempt_request(request, timestamp, drop_stale_output)
        # The caller took it off the running queue; it ends here as if aborted (an in-flight step's
        # token for it is dropped, as for any abort), and its output goes out with the next step's.
        request.status = RequestStatus.FINISHED_ABORTED
        request.stop_reason = EVICTED
        self._free_request(request)
        self._rollout_evicted.append(request)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, Any]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request in self._rollout_evicted:
            eco = outputs.get(request.client_index)
            if eco is None:
                eco = outputs[request.client_index] = EngineCoreOutputs()
            eco.outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.ABORT,
                    stop_reason=EVICTED,
                )
            )
        self._rollout_evicted.clear()
        return outputs


class EvictingScheduler(_Evicting, Scheduler):
    pass


class EvictingAsyncScheduler(_Evicting, AsyncScheduler):
    pass
