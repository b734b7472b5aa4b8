"""Simulated GPU engines for `benchmarks/cluster_sim.py`: the engine side of the driver's real Ray hop.

`SimEngine` stands where `policies.vllm_policy.VLLMPolicy` stands, behind the same group calls
(`policies.group_calls.GroupCalls`: `serve`, and submit, results and cancel frames on the driver's
zmq data path, `actors.channel`), progress reports, stats and the
two-phase weight update, so the driver's own `actors.handle.RayEngine` talks to it unchanged. It models
a GPU engine with continuous batching and computes nothing:
- `capacity` sequences decode at once, each at `tokens_per_s / capacity` tokens/s (the engine makes
  `tokens_per_s` when full, as a GPU's decode step costs about the same at any batch size); more wait
  in arrival order, as in vLLM's waiting queue;
- a sequence's first token comes `ttft_s` after it gets a slot (prefill);
- its length comes from `length` (`LengthDist`), chosen by its request id, so a sample resumed on
  another engine ends at the same length; capped by its `max_tokens`;
- a weight update (`commit_weights`) pauses every sequence for `load_s`; the tokens after it carry the
  new epoch (`weight_sync.mode: keep`'s runs);
- a `preempt` fraction of samples is preempted once at a random token: it waits `ttft_s` again (the
  recompute) and records it in `kv_recomputes`, as the real policy records vLLM's evictions.
Each sequence costs one timer and its tokens and logprobs are slices of a pre-made packed pool (as
a real engine's, `rollout.packed`), so an engine costs far less CPU than the driver it feeds. Hosting
them (many per Ray actor): `benchmarks.sim_pool`.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import zlib
from collections import deque
from typing import Any

import msgspec

from policies.group_calls import GroupCalls
from rollout.epochs import append_run, kv_runs
from rollout.packed import Logprobs, TokenIds, encode
from rollout.types import EngineStats, Request, Trajectory

TABLE = 8192  # lengths and token offsets drawn per engine host, picked by a request id's hash


class SimSpec(msgspec.Struct, frozen=True):
    """One simulated engine; checked by `cluster_sim.check` (errors there name the flag)."""

    tokens_per_s: float = 2000.0
    ttft_s: float = 0.05
    capacity: int = 32
    length: str = "lognormal:200:1.0"
    preempt: float = 0.0
    load_s: float = 0.0
    vocab: int = 32000
    seed: int = 0


class LengthDist:
    """Output lengths: `fixed:N`, `uniform:A:B`, `lognormal:MEDIAN:SIGMA` or `pareto:MIN:ALPHA` (long
    tails). Raises ValueError saying what is wrong with `spec`."""

    def __init__(self, spec: str):
        kind, _, rest = spec.partition(":")
        try:
            args = [float(a) for a in rest.split(":")] if rest else []
        except ValueError:
            raise ValueError(f"{spec!r}: parameters must be numbers") from None
        want = {"fixed": 1, "uniform": 2, "lognormal": 2, "pareto": 2}
        if kind not in want:
            raise ValueError(
                f"{spec!r}: unknown distribution {kind!r} "
                "(fixed:N, uniform:A:B, lognormal:MEDIAN:SIGMA, pareto:MIN:ALPHA)"
            )
        if len(args) != want[kind] or any(not math.isfinite(a) for a in args):
            raise ValueError(f"{spec!r}: {kind} takes {want[kind]} finite number(s)")
        if (
            args[0] < 1
            or (kind == "uniform" and args[1] < args[0])
            or (kind != "fixed" and kind != "uniform" and args[1] <= 0)
        ):
            raise ValueError(f"{spec!r}: lengths must be >= 1 and the spread > 0 (uniform: A <= B)")
        self.kind, self.args = kind, args

    def sample(self, rng: random.Random) -> int:
        a = self.args
        if self.kind == "fixed":
            return int(a[0])
        if self.kind == "uniform":
            return rng.randint(int(a[0]), int(a[1]))
        if self.kind == "lognormal":
            return max(1, round(rng.lognormvariate(math.log(a[0]), a[1])))
        return max(1, round(a[0] * rng.paretovariate(a[1])))

    def mean(self, cap: int, n: int = 20000) -> float:
        rng = random.Random(1)
        return sum(min(cap, self.sample(rng)) for _ in range(n)) / n


class _Seq:
    __slots__ = ("req", "length", "done0", "epochs", "recomputes", "at", "count", "timer", "future", "preempt_at",
                 "submitted", "parked")  # fmt: skip

    def __init__(self, req: Request, length: int, future: asyncio.Future):
        self.req, self.length, self.future = req, length, future
        r = req.resume
        self.done0 = len(r.token_ids) if r else 0  # tokens carried over from a dead engine
        self.epochs = list(r.policy_epochs) if r else []
        self.recomputes = list(r.kv_recomputes) if r else []
        self.at, self.count = 0.0, self.done0  # decoding from loop time `at` on, `count` tokens then
        self.timer: asyncio.TimerHandle | None = None
        self.preempt_at = 0  # 0: not preempted
        self.submitted = time.time()
        self.parked = False

    def tokens(self, now: float, rate: float) -> int:
        """Tokens generated by `now` (the last one only once it finishes)."""
        return min(self.length - 1, self.count + max(0, int((now - self.at) * rate)))


class SimEngine(GroupCalls):
    def __init__(self, spec: SimSpec, engine_id: int, lengths: list[int], tokens: bytes, logprobs: bytes):
        super().__init__()
        self.spec, self.engine_id = spec, engine_id
        self.epoch = 0
        self.rate = spec.tokens_per_s / spec.capacity  # tokens/s of one sequence
        self._lengths, self._tokens, self._logprobs = lengths, tokens, logprobs  # packed pools: int32, float64
        self._rng = random.Random(spec.seed * 7919 + engine_id)
        self.running: dict[str, _Seq] = {}
        self.waiting: deque[_Seq] = deque()
        self._finished: dict[str, Trajectory] = {}  # done, their group not yet: what progress reports keep
        self._paused_until = 0.0
        self.dead = self.stalled = False
        self.died = asyncio.Event()
        self.calls: set[asyncio.Task] = set()
        self.hold = False  # tests: a sequence at its last token waits for `release`
        self.parked: list[_Seq] = []
        self.changed = asyncio.Event()
        self.counts = {"trajectories": 0, "tokens": 0, "preempted": 0, "resumed": 0, "busy": 0.0}
        self._last = time.monotonic()

    # -- the group calls' side ---------------------------------------------------------------

    async def finish_group(self, requests: list[Request]) -> list[Trajectory]:
        loop = asyncio.get_running_loop()
        seqs = []
        for req in requests:
            h = zlib.crc32(req.request_id.encode())
            seq = _Seq(req, min(self._lengths[h % TABLE], req.sampling.max_tokens), loop.create_future())
            self.counts["resumed"] += seq.done0 > 0
            if seq.done0 >= seq.length:  # a resumed sample that had all but its last token
                seq.length = seq.done0 + 1
            if self._rng.random() < self.spec.preempt and seq.length - seq.done0 > 2:
                seq.preempt_at = self._rng.randint(seq.done0 + 1, seq.length - 2)
            seqs.append(seq)
            self.waiting.append(seq)
        self._fill(loop.time())
        try:
            return list(await asyncio.gather(*(s.future for s in seqs)))
        finally:
            for s in seqs:
                self._drop(s)
                self._finished.pop(s.req.request_id, None)

    def _fill(self, now: float) -> None:
        if self.dead:
            return
        self._account()
        while self.waiting and len(self.running) < self.spec.capacity:
            seq = self.waiting.popleft()
            self.running[seq.req.request_id] = seq
            seq.at = max(now, self._paused_until) + self.spec.ttft_s
            if not seq.epochs or seq.epochs[-1][1] != self.epoch:
                append_run(seq.epochs, seq.done0, self.epoch)
            if seq.done0:  # prompt + carried tokens are prefilled again here
                seq.recomputes.append((seq.done0, self.epoch))
            self._schedule(seq)

    def _schedule(self, seq: _Seq) -> None:
        if seq.timer is not None:
            seq.timer.cancel()
        if self.stalled or self.dead:
            return
        loop = asyncio.get_running_loop()
        if seq.preempt_at > seq.count:
            seq.timer = loop.call_at(seq.at + (seq.preempt_at - seq.count) / self.rate, self._preempt, seq)
        else:
            seq.timer = loop.call_at(seq.at + (seq.length - seq.count) / self.rate, self._finish, seq)

    def _preempt(self, seq: _Seq) -> None:
        seq.count, seq.at = seq.preempt_at, asyncio.get_running_loop().time() + self.spec.ttft_s
        seq.recomputes.append((seq.preempt_at, self.epoch))
        seq.preempt_at = 0
        self.counts["preempted"] += 1
        self._schedule(seq)

    def _finish(self, seq: _Seq) -> None:
        seq.timer = None
        if self.hold:
            seq.parked = True
            self.parked.append(seq)
            self._notify()
            return
        tokens, logprobs = self._slices(seq.req.request_id, seq.length)
        prompt = TokenIds(seq.req.token_ids or ())
        now = time.time()
        traj = Trajectory(
            request_id=seq.req.request_id, prompt_id=seq.req.prompt_id, sample_index=seq.req.sample_index,
            prompt_token_ids=prompt, token_ids=tokens, logprobs=logprobs,
            finish_reason="length" if seq.length >= seq.req.sampling.max_tokens else "stop",
            policy_epochs=seq.epochs, kv_recomputes=seq.recomputes, num_preemptions=len(seq.recomputes),
            kv_epochs=kv_runs(len(prompt), len(tokens), seq.epochs, seq.recomputes),
            engine_id=self.engine_id, submitted_at=seq.submitted, first_token_at=seq.submitted + self.spec.ttft_s,
            finished_at=now,
        )  # fmt: skip
        self.counts["trajectories"] += 1
        self.counts["tokens"] += seq.length - seq.done0
        self._finished[traj.request_id] = traj
        self._account()
        del self.running[seq.req.request_id]
        if not seq.future.done():
            seq.future.set_result(traj)
        self._fill(asyncio.get_running_loop().time())

    def _drop(self, seq: _Seq) -> None:
        """A sequence the driver gave up (cancelled) or that is done: its slot is free."""
        if seq.timer is not None:
            seq.timer.cancel()
        if self.running.pop(seq.req.request_id, None) is not None:
            self._fill(asyncio.get_running_loop().time())
        elif not seq.future.done() and seq in self.waiting:
            self.waiting.remove(seq)

    def release(self) -> None:
        """Tests: finish every parked sequence and stop holding."""
        self.hold = False
        parked, self.parked = self.parked, []
        for seq in parked:
            seq.parked = False
            if seq.req.request_id in self.running:
                self._finish(seq)

    def _account(self) -> None:
        now = time.monotonic()
        self.counts["busy"] += len(self.running) * (now - self._last)
        self._last = now

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    # -- what the driver asks besides groups -------------------------------------------------

    def progress(self) -> bytes:
        now = asyncio.get_running_loop().time()
        out = list(self._finished.values())
        for seq in [*self.running.values(), *self.waiting]:
            n = seq.tokens(now, self.rate) if seq.req.request_id in self.running else seq.done0
            tokens, logprobs = self._slices(seq.req.request_id, n)
            out.append(Trajectory(
                request_id=seq.req.request_id, prompt_id=seq.req.prompt_id, sample_index=seq.req.sample_index,
                prompt_token_ids=TokenIds(seq.req.token_ids or ()), token_ids=tokens, logprobs=logprobs,
                policy_epochs=[(s, e) for s, e in seq.epochs if s < n],
                kv_recomputes=[(j, e) for j, e in seq.recomputes if j < n],
                engine_id=self.engine_id,
            ))  # fmt: skip
        return encode(out)

    def _slices(self, request_id: str, n: int) -> tuple[TokenIds, Logprobs]:
        """A sample's first `n` tokens and logprobs: the same on every engine (picked by its id)."""
        off = zlib.crc32(request_id.encode()) % TABLE
        return TokenIds(self._tokens[4 * off : 4 * (off + n)]), Logprobs(self._logprobs[8 * off : 8 * (off + n)])

    def report(self, sock: Any) -> None:
        if not self.stalled:  # a stalled engine answers nothing, on the data path as through Ray
            super().report(sock)

    async def stats(self) -> EngineStats:
        return EngineStats(engine_id=self.engine_id, epoch=self.epoch, running=len(self.running),
                           requests_finished=self.counts["trajectories"],
                           tokens_generated=self.counts["tokens"])  # fmt: skip

    async def reset_prefix_cache(self) -> None:
        pass

    async def stage_weights(self, epoch: int, weights: Any) -> int:
        return int(getattr(weights, "nbytes", 0))

    async def drop_weights(self, epoch: int) -> None:
        pass

    async def commit_weights(self, epoch: int) -> dict[str, float]:
        """Every running sequence: its tokens from now on carry `epoch`, after a `load_s` pause."""
        loop = asyncio.get_running_loop()
        now, pause = loop.time(), self.spec.load_s
        for seq in self.running.values():
            n = seq.tokens(now, self.rate) if now > seq.at else seq.count
            _retag(seq.epochs, n, epoch)
            seq.count, seq.at = n, max(now, seq.at) + pause
            if not seq.parked:
                self._schedule(seq)
        self.epoch = epoch
        self._paused_until = now + pause
        if pause:
            await asyncio.sleep(pause)
        return {"pause_s": 0.0, "load_s": pause, "stall_s": pause}

    async def spec_counters(self) -> Any:
        from rollout.types import SpecCounters

        return SpecCounters(engine_id=self.engine_id)

    async def shutdown(self) -> None:
        self.stop()

    def stop(self) -> None:
        """Die: every sequence stops, every call in flight raises EngineDeadError."""
        self.dead = True
        self.died.set()
        for seq in [*self.running.values(), *self.waiting]:
            if seq.timer is not None:
                seq.timer.cancel()
        groups, self._groups = self._groups, {}
        for task in [*groups.values(), *self.calls]:
            task.cancel()

    def freeze(self) -> None:
        """Stall: nothing progresses and no call answers, until the driver kills it."""
        self.stalled = True
        for seq in self.running.values():
            if seq.timer is not None:
                seq.timer.cancel()


def _retag(runs: list[tuple[int, int]], index: int, epoch: int) -> None:
    """Tokens from `index` on carry `epoch` (a run starting there with no token yet is replaced)."""
    while runs and runs[-1][0] >= index:
        runs.pop()
    append_run(runs, index, epoch)
