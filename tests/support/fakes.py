"""Fakes at the one external edge of `rollout/`: the generation engines (`rollout.scheduling.protocols`).

`FakeEngine` implements the `Engine` protocol without vLLM or Ray. It generates deterministic
tokens (a function of the prompt, the sample index and the position) with one logprob each,
honours `max_tokens`, `min_tokens` and `stop_token_ids`, and records what the scheduler did to it:
every request, the most requests it held at once, and every cancelled request. Tests steer it
with events, never sleeps: `gate` holds every request until set, `dead` makes it raise
`EngineDeadError`, and `wait_until(predicate)` waits for a condition on its counters.
`HeldEngine` holds chosen prompts' requests until released (a slow sample of an older epoch).
A streamed request (`Request.stream`) sends its first `streamed_early` tokens as deltas before
the gate, one per token, and the rest after it, as an engine's steps would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import msgspec

from rollout.aio import as_finished
from rollout.epochs import append_run
from rollout.errors import EngineDeadError
from rollout.types import Delta, EngineStats, Request, SpecCounters, Trajectory

VOCAB_SIZE = 260  # the tiny model's: 4 special ids, then 256 bytes
EOS_ID = 2
FIRST_BYTE_ID = 4


def fake_token(prompt_ids: list[int], sample_index: int, position: int) -> int:
    """The token the fake generates at `position`: never a special id, so only `eos_at` stops it."""
    seed = sum(prompt_ids) * 31 + sample_index * 7 + position * 13
    return FIRST_BYTE_ID + seed % (VOCAB_SIZE - FIRST_BYTE_ID)


def fake_logprob(token: int, position: int) -> float:
    return -0.5 - (token % 7) / 10 - position / 1000


def text_ids(text: str) -> list[int]:
    """How the tiny model's byte-level tokenizer maps text: byte b -> id 4 + b."""
    return [FIRST_BYTE_ID + b for b in text.encode()]


class FakeEngine:
    def __init__(self, engine_id: int = 0, *, eos_at: int | None = None, epoch: int = 0):
        self.engine_id = engine_id
        self.eos_at = eos_at  # emit EOS_ID at this generated position (it stops only if asked to)
        self.epoch = epoch
        self.gate: anyio.Event | None = None  # when set to an unset event, requests wait for it
        self.dead = False  # raise EngineDeadError (after the gate, if any)
        self.requests: list[Request] = []  # every request received, in order
        self.inflight = 0
        self.max_inflight = 0
        self.finished = 0
        self.cancelled = 0
        self.failed = 0
        self.prefix_cache_resets = 0
        self.fail_stage = False  # weight updates: fail to receive, fail to load, or never answer
        self.fail_commit = False
        self.hang_commit = False
        self.commit_gate: anyio.Event | None = None  # when set to an unset event, commits wait for it
        self.staged: dict[int, object] = {}
        self.reported_tokens = 0  # progress(): how many tokens of a held request it reports
        self.hang_progress = False
        self.held: dict[str, Request] = {}  # requests in flight, by id
        self.killed = False
        self.commits: list[int] = []
        self.pauses: list[str] = []  # pause_generation modes and "resume", in order
        self.worker: Any = None  # vLLM's weight-transfer engine of its model worker
        self.spec = SpecCounters(engine_id=engine_id)  # what spec_counters() reports; tests set it
        self.preemptions = 0  # what stats() reports; tests set it
        self.spec_per_request: tuple[int, int, int, list[int]] | None = None  # added to `spec` per finished request
        self.streamed_early = 1  # a streamed request's tokens sent as deltas before the gate
        self._changed = anyio.Event()
        self._batch = [0.0, time.monotonic(), 0]  # running request-seconds, at, requests then (`batch`)

    def block(self) -> anyio.Event:
        """Hold every request from now on until the returned event is set."""
        self.gate = anyio.Event()
        return self.gate

    @property
    def prompt_ids(self) -> list[str]:
        """Distinct prompt ids received, in arrival order."""
        return list(dict.fromkeys(r.prompt_id for r in self.requests))

    async def wait_until(self, predicate: Callable[[FakeEngine], bool]) -> None:
        """Wait until `predicate(self)` holds; re-checked whenever a counter changes."""
        while not predicate(self):
            changed = self._changed
            await changed.wait()

    async def generate(self, request: Request, on_delta: Callable[[Delta], None] | None = None) -> Trajectory:
        self.requests.append(request)
        self.held[request.request_id] = request
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        self._notify()
        stream = on_delta if request.stream else None
        sent = len(request.resume.token_ids) if request.resume else 0
        try:
            if stream is not None:
                sent = self._stream(request, stream, sent, sent + self.streamed_early)
            if self.gate is not None:
                await self.gate.wait()
            if self.dead:
                self.failed += 1
                raise EngineDeadError(f"fake engine {self.engine_id} is dead")
            if stream is not None:
                self._stream(request, stream, sent, None)
            traj = self._trajectory(request)
            self.finished += 1
            if self.spec_per_request is not None:
                self.spec.add(*self.spec_per_request)
            return traj
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise
        finally:
            self.inflight -= 1
            self.held.pop(request.request_id, None)
            self._notify()

    async def generate_group(
        self, requests: list[Request], on_delta: Callable[[Delta], None] | None = None
    ) -> AsyncIterator[Trajectory]:
        """Like the real policy: the group's requests run together, each yielded as it finishes."""
        runs = (self.generate(r, on_delta) if on_delta is not None else self.generate(r) for r in requests)
        async for traj in as_finished(runs):
            yield traj

    def start_group(
        self, requests: list[Request], deliver: Callable[[list[Trajectory] | Exception], None]
    ) -> Callable[[], None]:
        """Like the real engine's handle (`actors.handle.RayEngine.start_group`): the group's
        requests run together, and `deliver` gets, from a loop callback (no task, as the data path's
        reader calls it), the samples that finished in one turn of the loop together (one results
        frame), then what ended the group if anything did (the rest are cancelled). Returns the
        call that aborts what has not finished: nothing is delivered after it."""
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self.generate(r)) for r in requests]
        frame: list[Trajectory] = []
        ended: list[Exception] = []  # what ended the group, once
        over = False  # aborted, or its end delivered
        looking = False  # a `flush` is on the loop

        def abort() -> None:
            nonlocal over
            over = True
            for t in tasks:
                t.cancel()

        def finished(task: asyncio.Task) -> None:
            nonlocal looking
            if over or ended or task.cancelled():
                return
            if (error := task.exception()) is not None:
                ended.append(error)
                for t in tasks:
                    t.cancel()
            else:
                frame.append(task.result())
            if not looking:
                looking = True
                loop.call_soon(flush)

        def flush() -> None:
            nonlocal looking, over
            looking = False
            if over:
                return
            if frame:
                got = frame[:]
                frame.clear()
                deliver(got)
            if ended and not over:
                over = True
                deliver(ended[0])

        for t in tasks:
            t.add_done_callback(finished)
        return abort

    def _stream(self, request: Request, on_delta: Callable[[Delta], None], sent: int, end: int | None) -> int:
        """Send a streamed request's tokens from `sent` up to `end` (None: all), one delta each."""
        t = self._trajectory(request)
        stop = len(t.token_ids) if end is None else min(end, len(t.token_ids))
        for k in range(sent, stop):
            runs = [(s, e) for s, e in t.policy_epochs if s <= k]
            part = Trajectory(request_id=request.request_id, prompt_id=request.prompt_id,
                              sample_index=request.sample_index, token_ids=[t.token_ids[k]],
                              logprobs=[t.logprobs[k]], policy_epochs=runs, engine_id=self.engine_id)  # fmt: skip
            on_delta(Delta("", k, part))
        return max(sent, stop)

    async def stats(self) -> EngineStats:
        return EngineStats(
            engine_id=self.engine_id,
            epoch=self.epoch,
            running=self.inflight,
            requests_finished=self.finished,
            tokens_generated=0,
            requests_failed=self.failed,
            preemptions=self.preemptions,
        )

    async def progress(self) -> dict[str, Trajectory]:
        if self.hang_progress:
            await anyio.sleep_forever()
        if self.dead:
            raise EngineDeadError(f"fake engine {self.engine_id} is dead")
        out = {}
        for r in self.held.values():
            t = self._trajectory(r)
            keep = min(len(t.token_ids), max(self.reported_tokens, len(r.resume.token_ids) if r.resume else 0))
            t.token_ids, t.logprobs, t.finish_reason, t.finished_at = t.token_ids[:keep], t.logprobs[:keep], "stop", 0.0
            t.policy_epochs = [(s, e) for s, e in t.policy_epochs if s < keep]
            t.kv_recomputes = [(j, e) for j, e in t.kv_recomputes if j < keep]
            out[t.request_id] = t
        return out

    async def kill(self) -> None:
        self.dead = self.killed = True
        if self.gate is not None:
            self.gate.set()

    async def batch(self) -> tuple[float, float, float]:
        """Like the real policy's: every request in flight counts as running (no queue here)."""
        self._sample_batch()
        return self._batch[0], 0.0, self._batch[1]

    def _sample_batch(self) -> None:
        now = time.monotonic()
        self._batch = [self._batch[0] + self._batch[2] * (now - self._batch[1]), now, self.inflight]

    async def reset_prefix_cache(self) -> None:
        if self.dead:
            raise EngineDeadError(f"fake engine {self.engine_id} is dead")
        self.prefix_cache_resets += 1

    async def stage_weights(self, epoch: int, weights: object) -> int:
        if self.dead:
            raise EngineDeadError(f"fake engine {self.engine_id} is dead")
        if self.fail_stage:
            raise RuntimeError("no space left on device")
        self.staged[epoch] = weights
        return 100

    async def drop_weights(self, epoch: int) -> None:
        self.staged.pop(epoch, None)

    async def commit_weights(self, epoch: int) -> dict[str, float]:
        if self.commit_gate is not None:
            await self.commit_gate.wait()
        if self.hang_commit:
            await anyio.sleep_forever()
        if self.fail_commit:
            raise RuntimeError("reload failed")
        self.staged.pop(epoch)
        self.commits.append(epoch)
        self.epoch = epoch
        self._notify()
        return {"pause_s": 0.001, "load_s": 0.002, "stall_s": 0.003}

    # -- vLLM's weight-transfer calls (`rollout.weights.transfer`): the real gloo worker engine ----------

    async def call(self, method: str, *args: object) -> object:
        if self.dead:
            raise EngineDeadError(f"fake engine {self.engine_id} is dead")
        return await getattr(self, method)(*args)

    async def pause_generation(self, mode: str) -> None:  # a learner's /pause (`rollout serve`)
        self.pauses.append(mode)

    async def resume_generation(self) -> None:
        self.pauses.append("resume")

    async def is_paused(self) -> bool:
        return bool(self.pauses) and self.pauses[-1] != "resume"

    async def init_transfer(self, info: dict) -> None:
        self.worker = transfer_worker(self.engine_id)
        await anyio.to_thread.run_sync(lambda: self.worker.init_transfer_engine(self.worker.parse_init_info(info)))

    async def start_transfer(self, epoch: int) -> None:
        if self.fail_stage:
            raise RuntimeError("cannot start the update")
        self.worker.start_weight_update()

    async def transfer(self, update_info: dict) -> None:
        await anyio.to_thread.run_sync(self.worker.update_weights, update_info, abandon_on_cancel=True)

    async def finish_transfer(self, epoch: int, loaded: bool = True) -> dict[str, float]:
        if self.fail_commit and loaded:
            raise RuntimeError("reload failed")
        if loaded:
            await anyio.to_thread.run_sync(self.worker.finish_weight_update)  # waits for the staged bytes
            self.commits.append(epoch)
            self.epoch = epoch
        else:
            self.worker.model.pending.clear()  # vLLM puts the old tensors back
        self._notify()
        return {"pause_s": 0.001, "load_s": 0.002, "stall_s": 0.003, "recomputed_tokens": 0}

    async def run_raw(self, requests: list[Request], outputs: bool = False) -> dict:
        start = time.time()
        trajectories = [await self.generate(r) for r in requests]
        result = {
            "tokens": sum(len(t.token_ids) for t in trajectories),
            "trajectories": len(trajectories),
            "start": start,
            "end": time.time(),
        }
        return (
            {**result, "outputs": [(t.token_ids, t.logprobs, t.finish_reason) for t in trajectories]}
            if outputs
            else result
        )

    async def spec_counters(self) -> SpecCounters:
        if self.dead:
            raise EngineDeadError(f"fake engine {self.engine_id} is dead")
        return msgspec.structs.replace(self.spec, accepted_per_pos=list(self.spec.accepted_per_pos))

    def _trajectory(self, request: Request) -> Trajectory:
        """What this engine generates for `request`: deterministic per position, so a sample resumed
        on another engine ends with the same tokens as one that ran through."""
        s, resume = request.sampling, request.resume
        prompt_ids = list(request.token_ids) if request.token_ids is not None else text_ids(request.text or "")
        tokens: list[int] = list(resume.token_ids) if resume else []
        finish = "length"
        for pos in range(len(tokens), s.max_tokens):
            tok = EOS_ID if pos == self.eos_at else fake_token(prompt_ids, request.sample_index, pos)
            tokens.append(tok)  # like vLLM, the stop token is part of the output
            if tok in s.stop_token_ids and len(tokens) > s.min_tokens:
                finish = "stop"
                break
        now = time.time()
        done = len(resume.token_ids) if resume else 0
        epochs = list(resume.policy_epochs) if resume else []
        recomputes = list(resume.kv_recomputes) if resume else []
        if len(tokens) > done:
            append_run(epochs, done, self.epoch)
        if done:
            recomputes.append((done, self.epoch))
        return Trajectory(
            request_id=request.request_id,
            prompt_id=request.prompt_id,
            sample_index=request.sample_index,
            prompt_token_ids=prompt_ids,
            token_ids=tokens,
            logprobs=[fake_logprob(t, i) for i, t in enumerate(tokens)],
            finish_reason=finish,
            policy_epochs=epochs,
            kv_recomputes=recomputes,
            num_preemptions=len(recomputes),
            engine_id=self.engine_id,
            cache_salt=request.cache_salt or "",  # as the real policy carries it on to the next turn
            submitted_at=now,
            first_token_at=now,
            finished_at=now,
        )

    def _notify(self) -> None:
        self._sample_batch()
        self._changed.set()
        self._changed = anyio.Event()


class FakePool:
    """The `EnginePool` protocol over fake engines; records whether it was shut down."""

    def __init__(self, engines: list[FakeEngine] | int = 2, **engine_kwargs):
        if isinstance(engines, int):
            engines = [FakeEngine(i, **engine_kwargs) for i in range(engines)]
        self.engines = engines
        self.shutdown_calls = 0
        self.shared: list[object] = []
        self.restarts: list[int] = []
        self.fail_restart = False
        self.restart_gate: anyio.Event | None = None  # when set to an unset event, restarts wait for it

    def share(self, payload: object) -> object:
        self.shared.append(payload)
        return payload

    async def restart(self, i: int) -> FakeEngine:
        if self.restart_gate is not None:
            await self.restart_gate.wait()
        if self.fail_restart:
            raise RuntimeError("engine failed to start")
        self.restarts.append(i)
        if self.engines[i].worker is not None:  # its worker processes are gone with it
            self.engines[i].worker.shutdown()
        self.engines[i] = FakeEngine(i, eos_at=self.engines[i].eos_at)
        return self.engines[i]

    async def shutdown(self) -> None:
        self.shutdown_calls += 1
        for e in self.engines:
            if e.worker is not None:
                e.worker.shutdown()


def transfer_worker(engine_id: int) -> object:
    """A fake engine's model worker with vLLM's weight-transfer engine: the real gloo one, over a
    module whose `loaded` holds what the last finished update loaded."""
    import types

    import torch

    from policies.gloo_transfer import GlooWeightTransferEngine

    class Model(torch.nn.Module):
        """What vLLM's layerwise reload does, in short: loads are held until the update finishes."""

        def __init__(self) -> None:
            super().__init__()
            self.loaded: dict[str, torch.Tensor] = {}
            self.pending: dict[str, torch.Tensor] = {}

        def load_weights(self, pairs: list) -> None:
            for name, t in pairs:
                self.pending[name] = t.clone()

    class Worker(GlooWeightTransferEngine):
        def _reload(self, pairs: list) -> None:  # vLLM's layerwise reload needs a vLLM model
            self.model.load_weights(pairs)
            self.model.loaded, self.model.pending = {**self.model.loaded, **self.model.pending}, {}

    parallel = types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    cfg = types.SimpleNamespace(parallel_config=parallel, model_config=None)
    return Worker(types.SimpleNamespace(backend="gloo"), cfg, torch.device("cpu"), Model())


class HeldEngine(FakeEngine):
    """Holds the requests of the prompts in `hold` until `release` is set; every request's tokens
    carry the epoch it arrived at (a slow sample whose tokens came from the weights of its start)."""

    def __init__(self, engine_id: int, hold: set[str], release: anyio.Event):
        super().__init__(engine_id)
        self.hold, self.release = hold, release
        self.arrived: dict[str, int] = {}

    async def generate(self, request, on_delta=None):
        self.arrived[request.request_id] = self.epoch
        if request.prompt_id in self.hold or "*" in self.hold:
            await self.release.wait()
        return await super().generate(request, on_delta)

    def _trajectory(self, request):
        traj = super()._trajectory(request)
        traj.policy_epochs = [(0, self.arrived.get(request.request_id, self.epoch))]
        return traj
