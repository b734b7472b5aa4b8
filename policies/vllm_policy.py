"""The vLLM policy: one AsyncLLM engine, token in, token out. The only module that imports vllm.

Owns: engine start from config (CPU defaults: KV cache size, pinned OpenMP threads), streaming one
request to a finished `Trajectory` (per-token behaviour logprobs, epoch runs, timings), abort,
stats, clean shutdown, and the raw-vLLM baseline used by `rollout bench`.
Does not own: routing, retries, grouping (the scheduler), Ray (the actor shell in `actors/`).

Per-token streaming stays here; only finished trajectories leave. A bad request becomes a
trajectory with `finish_reason="error"` and a reason; only a dead engine raises.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from rollout.config import Config
from rollout.backend import as_finished
from rollout.errors import EngineDeadError, InvalidConfigError, InvalidPromptError
from rollout.types import EngineStats, Request, Sampling, Trajectory, append_run

# Keys of `engines.vllm` that are ours, not AsyncEngineArgs fields.
_OUR_ENGINE_KEYS = {"kv_cache_gib"}


def engine_env(engine_index: int, cpus_per_engine: int, gpus_per_engine: float) -> dict[str, str]:
    """Environment for engine `engine_index`: on CPU, pin its OpenMP threads to its own cores.

    vLLM's automatic binding would put every engine on the same cores of NUMA node 0.
    """
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "TOKENIZERS_PARALLELISM": "false"}
    if gpus_per_engine == 0:
        ncpu = os.cpu_count() or 1
        first = (engine_index * cpus_per_engine) % ncpu
        cores = sorted({(first + i) % ncpu for i in range(cpus_per_engine)})
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
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
    )
    args.update(extra)
    try:
        return AsyncEngineArgs(**args)
    except (TypeError, ValueError) as e:
        raise InvalidConfigError(f"engines.vllm: {e}") from e


def sampling_params(s: Sampling, request_seed: int | None) -> Any:
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(
        n=1,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_tokens=s.max_tokens,
        min_tokens=s.min_tokens,
        stop_token_ids=list(s.stop_token_ids),
        stop=list(s.stop) or None,
        seed=request_seed,
        logprobs=0,
        detokenize=bool(s.stop),  # stop strings are matched on text; otherwise skip the work
        output_kind=RequestOutputKind.DELTA,
    )


class VLLMPolicy:
    """One vLLM engine. Plain async class: the Ray actor in `actors/` is a shell around it."""

    def __init__(self, cfg: Config, model_path: str, engine_id: int = 0):
        self.cfg = cfg
        self.model_path = model_path
        self.engine_id = engine_id
        self.epoch = 0
        self._llm: Any = None
        self._running = 0
        self._finished = 0
        self._failed = 0
        self._tokens = 0

    async def start(self) -> int:
        """Start the engine; returns the engine id once it can serve."""
        from vllm.v1.engine.async_llm import AsyncLLM

        args = engine_args(self.cfg, self.model_path)
        self._llm = AsyncLLM.from_engine_args(args)
        return self.engine_id

    async def generate(self, req: Request) -> Trajectory:
        """Run one request to completion. Bad input gives an error trajectory; raises EngineDeadError."""
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDead

        traj = Trajectory(
            request_id=req.request_id,
            prompt_id=req.prompt_id,
            sample_index=req.sample_index,
            prompt_token_ids=list(req.token_ids or []),
            engine_id=self.engine_id,
            submitted_at=time.time(),
        )
        self._running += 1
        try:
            if req.token_ids is None:  # text: tokenize here, so the length check below covers it too
                traj.prompt_token_ids = list(self._llm.get_tokenizer().encode(req.text or ""))
            limit = self.cfg.model.max_model_len
            if len(traj.prompt_token_ids) + req.sampling.max_tokens > limit:
                raise InvalidPromptError(
                    f"prompt of {len(traj.prompt_token_ids)} tokens + max_tokens {req.sampling.max_tokens} "
                    f"exceed max_model_len {limit}"
                )
            sp = sampling_params(req.sampling, _request_seed(req))
            prompt = TokensPrompt(prompt_token_ids=traj.prompt_token_ids)
            async for out in self._llm.generate(prompt, sp, request_id=req.request_id):
                c = out.outputs[0]
                if c.token_ids:
                    if not traj.token_ids:
                        traj.first_token_at = time.time()
                    append_run(traj.policy_epochs, len(traj.token_ids), self.epoch)
                    traj.token_ids.extend(c.token_ids)
                    traj.logprobs.extend(lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids))
                if out.finished:
                    traj.finish_reason = c.finish_reason if c.finish_reason in ("stop", "length", "abort") else "stop"
        except VllmDead as e:
            raise EngineDeadError(f"engine {self.engine_id} died: {e}") from e
        except Exception as e:  # a bad request: report it on this trajectory, keep serving the rest
            cause = e.__cause__ or e
            traj.finish_reason = "error"
            traj.error = f"{type(cause).__name__}: {cause}"
            self._failed += 1
        finally:
            self._running -= 1
        traj.finished_at = time.time()
        self._finished += 1
        self._tokens += len(traj.token_ids)
        return traj

    async def generate_group(self, requests: list[Request]) -> AsyncIterator[Trajectory]:
        """Run a group's requests together; yield each trajectory as it finishes.

        Closing or cancelling the stream aborts the unfinished requests.
        """
        async for traj in as_finished(self.generate(r) for r in requests):
            yield traj

    async def finish_group(self, requests: list[Request]) -> list[Trajectory]:
        """`generate_group` collected: the whole group in one reply, in finishing order."""
        return [t async for t in self.generate_group(requests)]

    async def abort(self, request_ids: list[str]) -> None:
        await self._llm.abort(request_ids)

    async def stats(self) -> EngineStats:
        return EngineStats(
            engine_id=self.engine_id,
            epoch=self.epoch,
            running=self._running,
            requests_finished=self._finished,
            tokens_generated=self._tokens,
            requests_failed=self._failed,
        )

    async def reset_prefix_cache(self) -> None:
        await self._llm.reset_prefix_cache()

    async def run_raw(self, requests: list[Request]) -> dict[str, Any]:
        """Baseline: submit every request to AsyncLLM at once, no scheduler; for `rollout bench`."""
        from vllm.inputs import TokensPrompt

        async def one(req: Request) -> int:
            sp = sampling_params(req.sampling, _request_seed(req))
            n = 0
            async for out in self._llm.generate(TokensPrompt(prompt_token_ids=req.token_ids), sp, request_id="raw-" + req.request_id):
                n += len(out.outputs[0].token_ids)
            return n

        start = time.time()
        counts = await asyncio.gather(*(one(r) for r in requests))
        return {"tokens": sum(counts), "trajectories": len(requests), "start": start, "end": time.time()}

    async def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None


def _request_seed(req: Request) -> int | None:
    if req.sampling.seed is None:
        return None
    key = msgspec.msgpack.encode((req.sampling.seed, req.prompt_id, req.sample_index))
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")
