"""From the config to vLLM: an engine's environment, its AsyncEngineArgs, each request's
SamplingParams and seed. Pure translation, checked where it can be: a bad engine argument raises
`InvalidConfigError` naming the key before any engine starts (`rollout validate` runs it too).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import msgspec

from policies.cpu_engine import DRIVER_SESSION, session
from policies.speculative import speculative_config
from policies.vllm_adapter.worker import CPU_WORKER
from rollout.config import Config
from rollout.errors import InvalidConfigError
from rollout.log import ENGINE_LOG_ENV
from rollout.types import Request, Sampling

# Keys of `engines.vllm` that are ours, not AsyncEngineArgs fields.
_OUR_ENGINE_KEYS = {"kv_cache_gib"}
# A CPU engine's KV cache when the config says nothing: vLLM would size it from the NUMA node's
# memory, which exceeds what a small machine has free. A GPU engine gets vLLM's own sizing
# (`gpu_memory_utilization` of its share of the GPU).
CPU_KV_CACHE_GIB = 1
# Engine args rollout sets from its own config: one way in, so epochs and logprobs keep their meaning.
_OURS_ELSEWHERE = {"logprobs_mode": "sampling.logprobs (processed | raw)"}


def engine_env(
    engine_index: int, cpus_per_engine: int, gpus_per_engine: float, log_level: str = "info", log_file: str = ""
) -> dict[str, str]:
    """Environment for engine `engine_index`: on CPU, the cores it runs on; vLLM's log level and
    where the engine's output goes.

    vLLM's automatic binding would put every engine's OpenMP threads on the same cores of NUMA
    node 0; `ROLLOUT_ENGINE_CORES` also confines the engine's other processes (see `start`).
    vLLM logs warnings and errors, everything at `logging.level: debug`. With `log_file`, the
    engine's processes write their output there (`rollout.log.output_to_file`), and vLLM formats
    its own records even where the driver's environment says not to (`libraries_to_file`);
    without, it reaches the driver's console through Ray.
    """
    env = {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": "DEBUG" if log_level == "debug" else "WARNING",
        "TQDM_DISABLE": "0" if log_level == "debug" else "1",  # vLLM's loading bars would reach the driver too
    }
    if log_file:
        env[ENGINE_LOG_ENV] = log_file
        env["VLLM_CONFIGURE_LOGGING"] = "1"
    if gpus_per_engine == 0:
        ncpu = os.cpu_count() or 1
        first = (engine_index * cpus_per_engine) % ncpu
        cores = ",".join(map(str, sorted({(first + i) % ncpu for i in range(cpus_per_engine)})))
        env["VLLM_CPU_OMP_THREADS_BIND"] = env["ROLLOUT_ENGINE_CORES"] = cores
        env[DRIVER_SESSION] = session()  # `policies.cpu_engine.behind_driver` leaves the driver's own alone
        # vllm-cpu 0.32 saves torch.compile AOT artifacts it cannot load back (the loaded function
        # has no `finalize_loading`): every start failed the load and compiled again on the AOT
        # path. Without it, a start takes 17-18 s instead of 22 s here. The caller's setting wins.
        env["VLLM_USE_AOT_COMPILE"] = os.environ.get("VLLM_USE_AOT_COMPILE", "0")
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
        if key in _OURS_ELSEWHERE:
            raise InvalidConfigError(
                f"engines.vllm.{key}: set by rollout from {_OURS_ELSEWHERE[key]}; configure it there"
            )
    gpu = cfg.engines.gpus_per_engine
    kv_gib = extra.pop("kv_cache_gib", None)
    if kv_gib is None and not gpu and "kv_cache_memory_bytes" not in extra:
        kv_gib = CPU_KV_CACHE_GIB
    if 0 < gpu < 1 and "gpu_memory_utilization" not in extra:
        extra["gpu_memory_utilization"] = round(0.9 * gpu, 3)  # engines sharing a GPU: each its share of vLLM's 0.9
    if kv_gib is not None:
        if (
            isinstance(kv_gib, bool) or not isinstance(kv_gib, (int, float)) or not 0 < kv_gib < 2**33
        ):  # finite; in bytes, an int64
            raise InvalidConfigError(f"engines.vllm.kv_cache_gib: expected a number > 0, got {kv_gib!r}")
        extra.setdefault("kv_cache_memory_bytes", int(kv_gib * 2**30))
    args = dict(
        model=model_path,
        dtype=cfg.model.dtype,
        max_model_len=cfg.model.max_model_len,
        seed=cfg.model.seed,
        disable_log_stats=True,
        # The behaviour logprob: of the distribution sampled from (after temperature, top-k/top-p,
        # min_tokens), or of the raw logits. vLLM's GPU sampler (FlashInfer) cannot return the
        # processed ones; vLLM then samples with its native PyTorch sampler instead (checked in
        # vllm/v1/sample/ops/topk_topp_sampler.py, TopKTopPSampler.__init__).
        logprobs_mode="processed_logprobs" if cfg.sampling.logprobs == "processed" else "raw_logprobs",
        enable_prefix_caching=True,
        # Every request the scheduler keeps on an engine runs: a hidden queue inside vLLM (its
        # engine default is 128) would keep the router from seeing real load.
        max_num_seqs=cfg.engines.max_inflight_per_engine,
    )
    if cfg.engines.max_inflight_per_engine > 2048:  # vLLM's default token budget per step; it must cover max_num_seqs
        args["max_num_batched_tokens"] = cfg.engines.max_inflight_per_engine
    if not cfg.engines.gpus_per_engine:  # the vllm-cpu repairs; a user's own extension wins (warned)
        args["worker_extension_cls"] = CPU_WORKER
    # vLLM's weight-transfer engines (`rollout.weights.transfer`): our shm one on CPU (serves gloo learners too;
    # registered by the vllm.general_plugins entry point), vLLM's nccl on GPUs; engines.vllm.weight_transfer_config wins
    args["weight_transfer_config"] = {"backend": "nccl" if cfg.engines.gpus_per_engine else "shm"}
    args.update(extra)
    if cfg.speculative.enabled:
        args["speculative_config"] = speculative_config(cfg)
    try:
        return AsyncEngineArgs(**args)
    except (TypeError, ValueError) as e:
        raise InvalidConfigError(f"engines.vllm: {e}") from e


def checked_engine_args(cfg: Config, model_path: str) -> Any:
    """`engine_args`, and vLLM's model config built from them in this process (it reads the model's
    config.json: cheap), so what vLLM would refuse at engine start (`model.max_model_len` above the
    model's positions, a dtype it cannot use) fails here, before any actor starts, as
    InvalidConfigError naming the key."""
    args = engine_args(cfg, model_path)
    try:
        args.create_model_config()
    except Exception as e:  # pydantic's ValidationError, ValueError, OSError for a model dir it cannot read
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        reason = next(
            (line.split("Value error, ", 1)[1] for line in lines if "Value error, " in line),
            lines[0] if lines else type(e).__name__,
        )
        raise InvalidConfigError(f"{_key_of(reason, cfg)}: vLLM refuses it: {reason}") from e
    return args


def _key_of(reason: str, cfg: Config) -> str:
    """The config key a vLLM model-config error is about: one of `engines.vllm`, else ours."""
    for key in cfg.engines.vllm:
        if key in reason:
            return f"engines.vllm.{key}"
    for ours in ("max_model_len", "dtype", "seed"):
        if ours in reason:
            return f"model.{ours}"
    return "model.path"


def sampling_params(s: Sampling, request_seed: int | None, done: int = 0) -> Any:
    """vLLM SamplingParams for `s`; `done` tokens already generated (a continuation) count against the limits.

    In vLLM's own non-streaming mode: one output per request, when it ends. Meanwhile its tokens
    accumulate in vLLM's output processor, which `progress` reads and `_after_step` watches for
    first tokens; nothing is copied out per step.
    """
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    max_tokens = s.max_tokens - done
    greedy = s.temperature < 1e-5
    return SamplingParams(
        n=1,
        temperature=s.temperature,
        # Top-k/top-p never change a greedy pick, but vLLM applies them to a greedy request's
        # processed logprobs only when it shares a step with sampled ones (then at temperature 1);
        # dropping them makes a greedy token's logprob log_softmax(logits) in every batch.
        top_p=1.0 if greedy else s.top_p,
        top_k=0 if greedy else s.top_k,
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
