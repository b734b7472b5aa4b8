"""One vLLM AsyncLLM as the policy sees it: `VllmFrontend`, vLLM's public API plus what it lacks.

Public surfaces used: `AsyncLLM.from_vllm_config`, `generate` (one output per request, vLLM's
non-streaming mode), `abort`, `pause_generation`, `resume_generation`, `is_paused`, `update_weight_version`,
`collective_rpc("reload_weights")`, the weight-transfer calls (`init_weight_transfer_engine`,
`start_weight_update`, `update_weights`, `finish_weight_update`), `reset_prefix_cache`, `shutdown`,
`RequestOutput` with its `weight_versions` spans, `SamplingParams(flat_logprobs=True)`.
Private internals, each checked at start (`probe`), failing closed:
- `AsyncLLM._logger_ref`: vLLM's output loop calls the stat logger in it once per engine step;
  `StepWatch` takes that slot (times first tokens within a step).
- `AsyncLLM.output_processor.external_req_ids` / `.request_states[...]` (its size: requests inside
  vLLM, sampled per step for the running batch, `BatchMeter`): a running request's
  `is_prefilling`, `detokenizer.output_token_ids`, `logprobs_processor.logprobs`,
  `weight_version_starts` and `num_cached_tokens` (what a progress report keeps of it if the
  engine dies).
- `SchedulerConfig.scheduler_cls` = `scheduler.EvictingScheduler`: vLLM's KV-cache preemptions
  become evictions the policy sees (see that module).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from policies.vllm_adapter import EVICTED, VllmChangedError, check_vllm
from rollout.errors import EngineDeadError

Spans = list[tuple[int, int]]


class Finished:
    """A finished vLLM request: its tokens, logprobs, finish reason and weight-version spans."""

    __slots__ = ("ids", "logprobs", "reason", "evicted", "spans", "cached")

    def __init__(
        self, ids: list[int], logprobs: list[float], reason: str, evicted: bool, spans: Spans, cached: int = 0
    ):
        self.ids, self.logprobs, self.reason, self.evicted, self.spans = ids, logprobs, reason, evicted, spans
        self.cached = cached  # prompt positions found in the prefix cache


def sampled_logprobs(flat: Any) -> list[float]:
    """The sampled token's logprob at each position of vLLM's FlatLogprobs (a copy).

    Requested with `logprobs=0`, a position holds just the sampled token, so the flat list is
    already one per position (copied at C speed); otherwise each position's first entry.
    """
    if len(flat.logprobs) == len(flat.start_indices):
        return list(flat.logprobs)
    return [flat.logprobs[i] for i in flat.start_indices]


class BatchMeter:
    """The running batch over time: the time integral of the requests inside vLLM (added, not yet
    finished), split at `max_num_seqs` into running and waiting in its queue. Sampled once per engine
    step (`StepWatch`) and at each reading, so an idle engine counts zero between its steps and
    `rollout bench` divides the integral by the wall time of a run. Running is min(requests,
    max_num_seqs): exact unless vLLM holds requests back for KV cache (then it is an upper bound)."""

    __slots__ = ("count", "cap", "at", "last", "running_s", "waiting_s")

    def __init__(self, count: Callable[[], int], cap: int) -> None:
        self.count, self.cap = count, cap
        self.at, self.last = time.monotonic(), 0
        self.running_s = self.waiting_s = 0.0

    def sample(self) -> None:
        now = time.monotonic()
        dt, running = now - self.at, min(self.last, self.cap)
        self.running_s += running * dt
        self.waiting_s += (self.last - running) * dt
        self.at, self.last = now, self.count()

    def read(self) -> tuple[float, float, float]:
        """(running request-seconds, waiting request-seconds, monotonic seconds now), cumulative."""
        self.sample()
        return self.running_s, self.waiting_s, self.at


class StepWatch:
    """Takes the place of the stat logger in vLLM's output loop, which reads it from a one-element
    list (`AsyncLLM._logger_ref`) and calls `record` once per engine step, after that step's
    outputs are processed. Calls `after_step`, and the logger it replaced, if any (speculative
    decoding's counts), with everything it is given; samples `meter` (the running batch)."""

    def __init__(self, inner: Any, after_step: Callable[[], None], meter: BatchMeter | None = None) -> None:
        self.inner = inner
        self.after_step = after_step
        self.meter = meter

    def record(self, *args: Any, **kwargs: Any) -> None:
        if self.inner is not None:
            self.inner.record(*args, **kwargs)
        if self.meter is not None:
            self.meter.sample()
        self.after_step()


class VllmFrontend:
    """Built by `start`; the policy's only way to its AsyncLLM."""

    def __init__(self, llm: Any, clock: Callable[[], float] = time.monotonic):
        self.llm = llm
        self.meter: BatchMeter | None = None  # the running batch over time, once started
        self.held = False  # a learner's /pause (`hold`): vLLM stays paused until its /resume
        self.updating = False  # a weight update's pause: vLLM stays paused until the update resumes it
        self.clock = clock
        self.transferring = 0  # weight calls running in the engine core (each bounded by its caller)
        self._asked_at: float | None = None  # when the unanswered round trip of `watch_core` was sent

    @classmethod
    async def start(cls, args: Any, stat_loggers: list[Any] | None, after_step: Callable[[], None]) -> VllmFrontend:
        """Start an AsyncLLM from engine args with the evicting scheduler, take the stat-logger
        slot and check every internal this module reads. Raises VllmChangedError."""
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        check_vllm()
        config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        sched = config.scheduler_config
        if sched.scheduler_cls is not None:
            raise VllmChangedError(f"engines.vllm set scheduler_cls={sched.scheduler_cls!r}; rollout needs its own")
        kind = "EvictingAsyncScheduler" if sched.async_scheduling else "EvictingScheduler"
        sched.scheduler_cls = f"policies.vllm_adapter.scheduler.{kind}"
        # `disable_log_stats` is an argument here, not part of the config: without it vLLM keeps
        # per-step iteration stats and its Prometheus logger, a good part of this front end's CPU.
        # Custom loggers (speculative decoding's counts) still get their records.
        llm = AsyncLLM.from_vllm_config(config, stat_loggers=stat_loggers, disable_log_stats=args.disable_log_stats)
        frontend = cls(llm)
        try:
            ref = getattr(frontend.llm, "_logger_ref", None)
            if not (isinstance(ref, list) and len(ref) == 1):
                raise VllmChangedError("AsyncLLM._logger_ref is not the one-element list of vLLM 0.32's output loop")
            op = frontend.llm.output_processor  # its request_states: probed below
            frontend.meter = BatchMeter(lambda: len(op.request_states), config.scheduler_config.max_num_seqs)
            ref[0] = StepWatch(ref[0], after_step, frontend.meter)
            await frontend.set_epoch(0)  # weight versions are epochs: the probe reads one back
            await frontend._probe()
        except BaseException:
            frontend.shutdown()
            raise
        return frontend

    async def _probe(self) -> None:
        """One 2-token request, watched while it runs: every private field read later must be there."""
        from rollout.types import Sampling

        probe = Sampling(n=1, temperature=0.0, max_tokens=2, min_tokens=2, stop_token_ids=[])
        task = asyncio.ensure_future(self.run("rollout-probe", [1], "rollout-probe", self.params(probe, None)))
        state = None
        while not task.done() and state is None:
            state = self.state("rollout-probe")
            await asyncio.sleep(0)
        done = await task
        if state is None:
            raise VllmChangedError("AsyncLLM.output_processor has no request_states entry for a running request")
        for path in (
            "is_prefilling",
            "detokenizer.output_token_ids",
            "logprobs_processor.logprobs",
            "weight_version_starts",
            "num_cached_tokens",
        ):
            obj = state
            for part in path.split("."):
                if not hasattr(obj, part):
                    raise VllmChangedError(f"vLLM's output-processor request state has no {path}")
                obj = getattr(obj, part)
        if self.so_far(state) is None or not done.spans:
            raise VllmChangedError("vLLM did not report weight versions for a request's tokens")

    # -- requests ----------------------------------------------------------------------------

    @staticmethod
    def params(sampling: Any, seed: int | None, done: int = 0) -> Any:
        """vLLM SamplingParams of a request (`policies.vllm_args.sampling_params`)."""
        from policies.vllm_args import sampling_params

        return sampling_params(sampling, seed, done)

    async def run(self, piece_id: str, token_ids: list[int], cache_salt: str, params: Any) -> Finished:
        """Run one request to its end (cancelling aborts it in vLLM). Its prefix-cache blocks are
        salted with `cache_salt` (`policies.ledger.Piece`): only requests with the same salt share
        blocks. Raises EngineDeadError when vLLM's engine died."""
        from vllm.inputs.engine import tokens_input
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDead

        # Already token ids: handed over as rendered engine input, which vLLM takes on the spot
        # (a raw prompt goes through its renderer's thread pool and back).
        prompt = tokens_input(token_ids, cache_salt=cache_salt)
        out = None
        try:
            # Longest remaining budget first where vLLM runs `scheduling_policy: priority`
            # (`engines.vllm`; lower runs earlier, ties in arrival order; it orders vLLM's queue and
            # picks KV-preemption victims, never preempts for a waiting request); fcfs ignores it.
            async for out in self.llm.generate(prompt, params, request_id=piece_id, priority=-params.max_tokens):
                pass  # one output, when it ends
        except VllmDead as e:
            raise EngineDeadError(f"vLLM's engine core died: {e}") from e
        if out is None:
            raise RuntimeError(f"vLLM ended request {piece_id} without an output")
        c = out.outputs[0]
        spans = [(s.start, int(s.version)) for s in (c.weight_versions or [])]
        reason = c.finish_reason or "stop"
        cached = out.num_cached_tokens or 0
        return Finished(
            list(c.token_ids), sampled_logprobs(c.logprobs), reason, c.stop_reason == EVICTED, spans, cached
        )

    def tokenize(self, text: str) -> list[int]:
        return list(self.llm.get_tokenizer().encode(text))

    async def abort(self, piece_ids: list[str]) -> None:
        await self.llm.abort(piece_ids)

    def state(self, piece_id: str) -> Any:
        """vLLM's output-processor state of a running request; None before vLLM has it."""
        op = self.llm.output_processor
        internal = op.external_req_ids.get(piece_id)
        return op.request_states.get(internal[0]) if internal else None

    @staticmethod
    def started(state: Any) -> bool:
        return not state.is_prefilling

    @staticmethod
    def so_far(state: Any) -> tuple[list[int], list[float], Spans, int]:
        """Token ids, logprobs, (first token, epoch) spans produced so far, prompt positions cached."""
        return (
            list(state.detokenizer.output_token_ids),
            sampled_logprobs(state.logprobs_processor.logprobs),
            [(start, int(version)) for version, start in state.weight_version_starts],
            state.num_cached_tokens or 0,
        )

    @staticmethod
    def tail(state: Any, k: int) -> tuple[list[int], list[float], Spans, int, int]:
        """`so_far` from the request's `k`-th token on: token ids and logprobs past the first `k`,
        every span, prompt positions cached, and `k` (a streamed sample's new tokens, read per
        engine step without copying what was sent)."""
        flat = state.logprobs_processor.logprobs
        if len(flat.logprobs) == len(flat.start_indices):
            lps = flat.logprobs[k:]
        else:
            lps = [flat.logprobs[i] for i in flat.start_indices[k:]]
        return (
            list(state.detokenizer.output_token_ids[k:]),
            list(lps),
            [(start, int(version)) for version, start in state.weight_version_starts],
            state.num_cached_tokens or 0,
            k,
        )

    # -- weight updates ----------------------------------------------------------------------

    # Two owners pause vLLM: a weight update (`pause` .. `resume`) and a learner's /pause of
    # `rollout serve` (`hold` .. `release`). vLLM resumes only once neither holds it, so an update
    # inside a learner's pause leaves the engine paused, and a /resume inside an update waits for it.
    async def pause(self, mode: str, clear_cache: bool) -> None:
        self.updating = True
        await self.llm.pause_generation(mode=mode, clear_cache=clear_cache)

    async def resume(self) -> None:
        self.updating = False
        if not self.held:
            await self.llm.resume_generation()

    async def hold(self, mode: str) -> None:
        self.held = True
        await self.llm.pause_generation(mode=mode, clear_cache=False)

    async def release(self) -> None:
        self.held = False
        if not self.updating:
            await self.llm.resume_generation()

    async def is_paused(self) -> bool:
        return bool(await self.llm.is_paused())

    async def set_epoch(self, epoch: int) -> None:
        await self.llm.update_weight_version(str(epoch))

    # -- is the engine core stepping? ---------------------------------------------------------
    # vLLM's engine core answers a utility call (`is_paused`) between two steps. A core stuck
    # inside one step, or inside a utility call that never returns, answers none: the actor still
    # answers the driver, so only a round trip to the core shows it.

    async def watch_core(self, interval: float) -> None:
        """Forever: one round trip to the engine core every `interval` seconds (`core_silent_s`).
        Ends when the core dies (`dead` says so)."""
        while True:
            self._asked_at = self.clock()
            try:
                await self.llm.is_paused()
            except Exception:  # the core is gone: `dead` reports it, not silence
                self._asked_at = None
                return
            self._asked_at = None
            await asyncio.sleep(interval)

    def core_silent_s(self) -> float:
        """Seconds the engine core has left `watch_core`'s round trip unanswered; 0 while a weight
        call runs in it (that call is bounded by its caller, `weight_sync.timeout_s`)."""
        if self._asked_at is None or self.transferring:
            return 0.0
        return self.clock() - self._asked_at

    @contextlib.contextmanager
    def _transfer(self) -> Iterator[None]:
        self.transferring += 1
        try:
            yield
        finally:
            self.transferring -= 1
            if self._asked_at is not None:  # the round trip waited behind the weight call: counted from now
                self._asked_at = self.clock()

    async def load(self, weights: str) -> None:
        """Load new weights from a directory of safetensors with vLLM's layerwise reload."""
        with self._transfer():
            await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": weights})

    # vLLM's own weight-transfer calls (its `weight_transfer_config` backend: gloo of ours on CPU)
    async def init_transfer(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        with self._transfer():
            await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    async def start_update(self) -> None:
        with self._transfer():
            await self.llm.start_weight_update()

    async def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        with self._transfer():
            await self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    async def finish_update(self) -> None:
        with self._transfer():
            await self.llm.finish_weight_update()

    async def reset_prefix_cache(self) -> None:
        await self.llm.reset_prefix_cache()

    # -- engine ------------------------------------------------------------------------------

    async def rpc(self, method: str) -> list[Any]:
        return await self.llm.collective_rpc(method)

    def batch(self) -> tuple[float, float, float]:
        """`BatchMeter.read`: cumulative running and waiting request-seconds, and the time now."""
        assert self.meter is not None
        return self.meter.read()

    def kv_capacity(self) -> tuple[int, int, int]:
        """(KV blocks, tokens per block, draft tokens per step) of this engine."""
        cache, spec = self.llm.vllm_config.cache_config, self.llm.vllm_config.speculative_config
        return cache.num_gpu_blocks or 0, cache.block_size, spec.num_speculative_tokens if spec is not None else 0

    def speculative_tokens(self) -> int:
        return self.kv_capacity()[2]

    async def raw(self, prompts: list[tuple[str, list[int], Any, int | None]], outputs: bool = False) -> dict[str, Any]:
        """Baseline for `rollout bench`: every request (id, token ids, Sampling, seed) into AsyncLLM
        at once, in vLLM's own non-streaming mode, keeping each one's token ids and logprobs
        (returned with `outputs`, as (ids, logprobs, finish reason) per request)."""
        from vllm.inputs.engine import tokens_input

        async def one(
            request_id: str, ids: list[int], sampling: Any, seed: int | None
        ) -> tuple[list[int], list[float], str]:
            async for out in self.llm.generate(tokens_input(ids), self.params(sampling, seed), request_id=request_id):
                c = out.outputs[0]
            return list(c.token_ids), sampled_logprobs(c.logprobs), c.finish_reason or "stop"

        start = time.time()
        samples = await asyncio.gather(*(one(*p) for p in prompts))
        result = {
            "tokens": sum(len(s[0]) for s in samples),
            "trajectories": len(prompts),
            "start": start,
            "end": time.time(),
        }
        return {**result, "outputs": samples} if outputs else result

    @property
    def dead(self) -> bool:
        """vLLM's engine core is gone (AsyncLLM's public `errored`): every request fails from now on."""
        return bool(self.llm.errored)

    def shutdown(self) -> None:
        self.llm.shutdown()
