"""A small fake of one vLLM engine, at the edge `VLLMPolicy` talks to (`VllmFrontend`'s methods).

It runs a step loop with vLLM's semantics where epochs are concerned, and records the truth the
policy must reconstruct: the epoch of the weights that computed every KV entry.
- A request is prefilled in chunks (a step computes up to `chunk` positions of it), then decodes
  one token per step; each token is sampled by a step at the current weight version.
- Prefix cache: full blocks of `BLOCK` positions, keyed by (cache salt, tokens), hold the epochs
  they were computed with; a request starting its prefill reuses the longest cached prefix.
- `pause("keep")` freezes steps; `pause("wait")` stops admitting and returns once nothing runs;
  `clear_cache=True` drops the cache and makes every running request recompute its KV (vLLM's
  reset with running requests). `abort` ends requests with their tokens so far; a request is
  registered a few loop turns after `run` is called, so an abort can miss it, as in vLLM.
- Eviction (vLLM preempting for KV cache, as `EvictingScheduler` ends it): a running request may
  end with reason `abort` and `evicted`; its computed blocks stay in the cache.
- A sampled token's "logprob" is a function of the step's epoch and the epochs of every KV entry
  it attends to (`logprob`), so `replay` (the oracle's semantics over a trajectory's
  `policy_epochs` and `kv_recomputes`) reproduces it only if those records are exact.
Randomness (step interleaving, chunk sizes, evictions) comes from the `random.Random` passed in.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from rollout.epochs import expand_runs
from rollout.errors import EngineDeadError
from rollout.types import Trajectory

BLOCK = 4


def logprob(epoch: int, kv: list[int]) -> float:
    """The fake model: depends on the sampling step's weights and on what computed every KV entry."""
    return -1.0 - (hash((epoch, tuple(kv))) % 100_003) / 100_003


def replay(traj: Trajectory) -> list[float]:
    """What `logprob` gives for every token under the trajectory's records (the oracle's reading:
    the step of g_0 computes the prompt, a recompute at j recomputes 0..P+j-1, otherwise the step
    of g_i computes position P+i-1, each with g_i's policy epoch)."""
    return replay_episode([traj])[0]


def replay_episode(turns: list[Trajectory]) -> list[list[float]]:
    """`replay` of each turn of an episode, the KV carried over: a turn's first `kv_reused` prompt
    positions keep the epochs the turns before computed them with, the rest get its first token's."""
    kv: list[int] = []
    out = []
    for k, traj in enumerate(turns):
        p, epochs = len(traj.prompt_token_ids), expand_runs(traj.policy_epochs, len(traj.token_ids))
        recomputed = {j for j, _ in traj.kv_recomputes}
        lps = []
        for i, e in enumerate(epochs):
            if i == 0:
                kept = traj.kv_reused if k else 0
                assert kept <= len(kv), (kept, len(kv))
                kv = kv[:kept] + [e] * (p - kept)
            elif i in recomputed:
                kv = [e] * (p + i)
            else:
                kv.append(e)
            lps.append(logprob(e, kv))
        out.append(lps)
    return out


class _Request:
    def __init__(self, rid: str, ids: list[int], salt: str, max_tokens: int, first_token: int):
        self.id, self.ids, self.salt = rid, ids, salt
        self.max_tokens = max_tokens
        self.first_token = first_token  # token values differ per request
        self.kv: list[int] = []  # epoch of each computed KV entry
        self.out: list[int] = []
        self.lps: list[float] = []
        self.spans: list[tuple[int, int]] = []
        self.cached = 0  # prompt positions found in the prefix cache
        self.done = asyncio.get_running_loop().create_future()

    @property
    def is_prefilling(self) -> bool:  # read through `state`, like vLLM's output-processor state
        return not self.out


class _Params:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens


class _Finished:
    def __init__(
        self, ids: list[int], lps: list[float], reason: str, evicted: bool, spans: list[tuple[int, int]], cached: int
    ):
        self.ids, self.logprobs, self.reason, self.evicted, self.spans, self.cached = (
            ids,
            lps,
            reason,
            evicted,
            spans,
            cached,
        )


class FakeVllm:
    def __init__(self, rng: random.Random, *, evict_p: float = 0.0, chunk: int = 8, capacity: int = 64):
        self.rng = rng
        self.evict_p = evict_p
        self.chunk = chunk
        self.capacity = capacity  # requests running at once; the rest wait
        self.version = 0
        self.paused = False
        self.draining = False
        self.cache: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        self.requests: dict[str, _Request] = {}
        self.evictions = 0
        self.steps = 0
        self.dead = False  # like AsyncLLM.errored: the engine core is gone
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._loop = asyncio.ensure_future(self._run())

    # -- what VllmFrontend offers ------------------------------------------------------------

    def core_silent_s(self) -> float:  # this engine core steps on the test's loop: never stuck
        return 0.0

    @staticmethod
    def params(sampling: Any, seed: int | None, done: int = 0) -> Any:
        return _Params(sampling.max_tokens - done)

    async def run(self, piece_id: str, token_ids: list[int], salt: str, params: Any) -> _Finished:
        for _ in range(self.rng.randrange(0, 3)):  # vLLM registers a request a moment later: an abort may miss it
            await asyncio.sleep(0)
        assert piece_id not in self.requests, f"request id {piece_id} reused while it runs"
        req = _Request(piece_id, list(token_ids), salt, params.max_tokens, first_token=self.rng.randrange(4, 200))
        self.requests[piece_id] = req
        self.waiting.append(req)
        self._wake.set()
        try:
            return await asyncio.shield(req.done)
        except asyncio.CancelledError:
            self._end(req, "abort")  # vLLM aborts a request whose caller went away
            raise

    async def abort(self, piece_ids: list[str]) -> None:
        for pid in piece_ids:
            if (req := self.requests.get(pid)) is not None:
                self._end(req, "abort")

    def state(self, piece_id: str) -> Any:
        return self.requests.get(piece_id)

    @staticmethod
    def started(state: _Request) -> bool:
        return not state.is_prefilling

    @staticmethod
    def so_far(state: _Request) -> tuple[list[int], list[float], list[tuple[int, int]], int]:
        return list(state.out), list(state.lps), list(state.spans), state.cached

    @staticmethod
    def tail(state: _Request, k: int) -> tuple[list[int], list[float], list[tuple[int, int]], int, int]:
        return list(state.out[k:]), list(state.lps[k:]), list(state.spans), state.cached, k

    async def pause(self, mode: str, clear_cache: bool) -> None:
        if mode == "wait":
            self.draining = True
            while self.running:
                self._idle.clear()
                await self._idle.wait()
        else:
            self.paused = True
        if clear_cache:
            self.cache.clear()
            for req in self.running:
                req.kv = []  # recomputed, at whatever epoch the steps that redo it run with

    async def resume(self) -> None:
        self.paused = self.draining = False
        self._wake.set()

    async def set_epoch(self, epoch: int) -> None:
        self.version = epoch

    async def load(self, weights_dir: str) -> None:
        await asyncio.sleep(0)

    def kv_capacity(self) -> tuple[int, int, int]:
        return 0, BLOCK, 0

    def speculative_tokens(self) -> int:
        return 0

    def shutdown(self) -> None:
        self._loop.cancel()

    def die(self) -> None:
        """The engine core is killed: every running request fails, as vLLM's do."""
        self.dead = True
        self._loop.cancel()
        for req in self.requests.values():
            if not req.done.done():
                req.done.set_exception(EngineDeadError("vLLM's engine core died"))

    # -- the step loop -----------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            for _ in range(self.rng.randrange(1, 4)):  # let the policy and the test interleave
                await asyncio.sleep(0)
            if self.paused or not (self.running or (self.waiting and not self.draining)):
                if not self.running:
                    self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            self._step()

    def _step(self) -> None:
        self.steps += 1
        if not self.draining:
            while self.waiting and len(self.running) < self.capacity:
                req = self.waiting.pop(0)
                self._reuse_cache(req)
                self.running.append(req)
        for req in list(self.running):
            if self.evict_p and self.rng.random() < self.evict_p:
                self.evictions += 1
                self._end(req, "abort", evicted=True)
                continue
            missing = len(req.ids) + len(req.out) - len(req.kv)  # positions to compute before the next sample
            n = missing if missing == 1 else min(missing, self.rng.randrange(1, self.chunk + 1))  # prefill: in chunks
            req.kv.extend([self.version] * n)
            self._cache_blocks(req)
            if n == missing:
                self._sample(req)

    def _sample(self, req: _Request) -> None:
        if not req.spans or req.spans[-1][1] != self.version:
            req.spans.append((len(req.out), self.version))
        req.lps.append(logprob(self.version, req.kv))
        req.out.append(4 + (req.first_token + 7 * len(req.out)) % 250)
        if len(req.out) >= req.max_tokens:
            self._end(req, "length")

    def _reuse_cache(self, req: _Request) -> None:
        ids = req.ids
        best: list[int] = []
        for b in range(1, (len(ids) - 1) // BLOCK + 1):  # never the whole prompt: its last token is computed
            hit = self.cache.get((req.salt, tuple(ids[: b * BLOCK])))
            if hit is None:
                break
            best = hit
        req.kv = list(best)
        req.cached = len(best)

    def _cache_blocks(self, req: _Request) -> None:
        ids = req.ids + req.out
        for b in range(1, len(req.kv) // BLOCK + 1):
            self.cache.setdefault((req.salt, tuple(ids[: b * BLOCK])), req.kv[: b * BLOCK])

    def _end(self, req: _Request, reason: str, evicted: bool = False) -> None:
        if req.done.done():
            return
        self._cache_blocks(req)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        del self.requests[req.id]
        req.done.set_result(_Finished(list(req.out), list(req.lps), reason, evicted, list(req.spans), req.cached))
        if not self.running:
            self._idle.set()
