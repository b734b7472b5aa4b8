"""How a `VLLMPolicy` takes new weights: received first (phase 1), then loaded inside a pause (phase 2).

Owns: `WeightLoading`, the weight-update methods of `policies.vllm_policy.VLLMPolicy` (a base
class of it: it reads the policy's frontend `_vllm`, its pieces and samples, its open gate, its
epoch). A state dict or directory: phase 1 (`stage_weights`): a state dict from Ray's object
store is written as safetensors to a staging directory; a directory is taken as is. Phase 2
(`commit_weights`): pause as `weight_sync.mode` says, load (vLLM's layerwise `reload_weights`),
tag the epoch, resume. vLLM's weight-transfer calls (`rollout.weights.transfer` drives them):
`start_transfer` runs vLLM's `start_weight_update` (a staging backend's: with the first
`transfer`), `transfer` its `update_weights`,
`finish_transfer` its `finish_weight_update`, then the epoch tag and resume; the pause (as
`weight_sync.mode` says) comes before `finish_weight_update` when the backend stages the bytes
(ours, `gloo`: the engine generates while they come), else before `start_weight_update`.
A staging round is settled (`transfer({"settle": true})`: every byte arrived, or the engine drops
them and serves its weights as before) before its finish pauses; called off (`finish_transfer`
with `loaded=False`), it is dropped unloaded. An engine that fails to load stays paused and
refuses work, so it never serves torn weights.
Does not own: checking weights (`rollout.tensors`, `rollout.weights.transfer`), moving bytes
(vLLM's weight-transfer engines, `policies.gloo_transfer`), vLLM's internals (`policies.vllm_adapter`).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from typing import Any

from policies.gloo_transfer import DISCARD, SETTLE
from policies.shm import staging_dir
from rollout.tensors import Packed
from rollout.transfer_backend import stages


class WeightLoading:
    """The weight-update calls of the policy (see the module docstring)."""

    cfg: Any
    engine_id: int
    epoch: int
    _vllm: Any
    _open: asyncio.Event
    _broken: str | None
    _pieces: dict[str, Any]
    _samples: dict[str, Any]
    _staged: dict[int, tuple[Any, bool]]  # epoch -> (weights dir, a dir of ours to delete)
    _staging = False  # this weight-transfer round's backend stages the bytes: the pause waits for finish_transfer
    _start: asyncio.Future | None = None  # a staging round's vLLM start, sent with its first update_weights
    # and the policy's `_state(piece)` and `_started(piece)`

    async def stage_weights(self, epoch: int, weights: Packed | str) -> int:
        """Phase 1 of an update: receive the weights (no engine change). Returns bytes received."""
        if isinstance(weights, str):
            self._staged[epoch] = (weights, False)
            return 0
        from rollout.tensors import save_dir, unpack

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

        `weight_sync.timeout_s` bounds the pause and load, not a drain's wait for running requests
        to finish (that is bounded by their max_tokens). If loading fails or times out the engine
        stays paused and refuses work: it never serves torn weights.
        """
        mode = self.cfg.weight_sync.mode
        t0 = time.perf_counter()
        self._open.clear()
        recomputed = 0
        try:
            if mode == "drain":
                await self._vllm.pause("wait", clear_cache=True)
            try:
                async with asyncio.timeout(self.cfg.weight_sync.timeout_s):
                    t1, t2, recomputed = await self._load(epoch, mode)
            except TimeoutError as e:
                raise TimeoutError(f"no load within weight_sync.timeout_s={self.cfg.weight_sync.timeout_s}") from e
        except BaseException as e:
            self._broken = f"engine {self.engine_id} failed to load epoch {epoch}: {type(e).__name__}: {e}"
            with contextlib.suppress(Exception):  # a dead engine has nothing left to abort
                await self._vllm.abort(list(self._pieces))
            raise
        finally:
            await self.drop_weights(epoch)
            self._open.set()
        t3 = time.perf_counter()
        return {"pause_s": t1 - t0, "load_s": t2 - t1, "stall_s": t3 - t0, "recomputed_tokens": recomputed}

    # -- vLLM's weight-transfer calls (`rollout.weights.transfer` drives them on every engine) ---------

    async def init_transfer(self, init_info: dict[str, Any]) -> None:
        """vLLM's `init_weight_transfer_engine`: the workers join the learner's transfer group."""
        await self._vllm.init_transfer(init_info)

    async def start_transfer(self, epoch: int) -> None:
        """vLLM's `start_weight_update`. A backend that stages the bytes before the load (ours,
        `gloo`, `shm`) changes nothing here: the engine keeps generating while the bytes come,
        `finish_transfer` pauses for the load alone, and vLLM's start goes out with the first
        `transfer` (vLLM's engine core runs utility calls between steps: sent back to back, the
        two wait for one step of a generating engine, not two). Others (vLLM's `nccl`,
        `ipc`: the layerwise reload takes the parameters off here) pause first, as
        `weight_sync.mode` says. On failure the engine resumes as it was and this raises."""
        mode, self._transfer_t0, self._transfer_t1, self._recomputed = (
            self.cfg.weight_sync.mode,
            time.perf_counter(),
            None,
            0,
        )
        self._staging, self._start = stages(self.cfg), None
        if self._staging:  # sent with the transfer: both in one gap between the engine's steps, not two
            return
        self._open.clear()
        try:
            if mode == "drain":
                await self._vllm.pause("wait", clear_cache=True)
            async with asyncio.timeout(self.cfg.weight_sync.timeout_s):
                self._recomputed = await self._quiesce(mode)
                await self._vllm.start_update()
        except BaseException:
            with contextlib.suppress(Exception):
                await self._vllm.resume()
            self._open.set()
            raise

    async def transfer(self, update_info: Any) -> str | None:
        """vLLM's `update_weights` (bytes from the learner: staged, or loaded as they come), within
        `weight_sync.timeout_s`. A failure leaves the engine paused and refusing work: it may hold
        torn weights. `{"settle": true}` (a staging backend's round, before `finish_transfer`):
        waits for the staged bytes; returns None when all came, else why not, with the staging
        dropped, vLLM's update ended and the engine serving its weights as before."""
        if isinstance(update_info, dict) and update_info.get(SETTLE):
            return await self._settle()
        self._transfer_t1 = time.perf_counter()
        try:
            async with asyncio.timeout(self.cfg.weight_sync.timeout_s):
                if self._staging and self._start is None:  # vLLM's start and update back to back: its engine
                    self._start = asyncio.ensure_future(self._vllm.start_update())  # core runs both in one gap
                # tasks run in the order made: the start goes out before this update, and before
                # any update of the round's other calls (a sharded learner's ranks) made meanwhile
                update = asyncio.ensure_future(self._vllm.update_weights(update_info))
                await asyncio.gather(asyncio.shield(self._start), update) if self._start else await update
        except BaseException as e:
            if isinstance(e, TimeoutError):
                e = TimeoutError(f"no transfer within weight_sync.timeout_s={self.cfg.weight_sync.timeout_s}")
            await self._break(f"transfer failed: {type(e).__name__}: {e}")
            raise e from None

    async def _settle(self) -> str | None:
        if not self._staging or self._start is None:
            return None
        try:
            async with asyncio.timeout(self.cfg.weight_sync.timeout_s):
                await asyncio.shield(self._start)
                await self._vllm.update_weights({SETTLE: True})
        except TimeoutError:  # the engine core may still be waiting: it cannot be trusted
            why = f"no settle within weight_sync.timeout_s={self.cfg.weight_sync.timeout_s}"
            await self._break(why)
            raise TimeoutError(why) from None
        except Exception as e:  # vLLM ends its update when update_weights raises: the model is untouched
            self._staging, self._start = False, None
            return f"{type(e).__name__}: {e}"
        return None

    async def finish_transfer(self, epoch: int, loaded: bool = True) -> dict[str, float]:
        """vLLM's `finish_weight_update` (staged bytes: pause first, as `weight_sync.mode` says,
        the drain's wait outside `weight_sync.timeout_s`), then the epoch tag and resume.
        `loaded=False` calls a started round off: the epoch stays (vLLM puts the old tensors back
        of a round called off before any transfer; a staging backend drops its staging unloaded)."""
        t2 = time.perf_counter()
        staged = self._staging and loaded
        if self._staging and self._start is None:  # called off before any transfer: vLLM's update never started here
            self._staging = False
            return {"pause_s": 0.0, "load_s": 0.0, "stall_s": 0.0, "recomputed_tokens": 0, "received": 0.0}
        try:
            if staged:
                self._transfer_t0 = t2
                self._open.clear()
                if self.cfg.weight_sync.mode == "drain":
                    await self._vllm.pause("wait", clear_cache=True)
            async with asyncio.timeout(self.cfg.weight_sync.timeout_s):
                if staged:
                    self._recomputed = await self._quiesce(self.cfg.weight_sync.mode)
                    t2 = time.perf_counter()
                elif self._staging:  # vLLM's finish then loads nothing
                    await self._vllm.update_weights({DISCARD: True})
                await self._vllm.finish_update()
                if loaded:
                    await self._vllm.set_epoch(epoch)
                    self.epoch = epoch
                await self._vllm.resume()
        except BaseException as e:
            await self._break(f"finish failed: {type(e).__name__}: {e}")
            raise
        self._open.set()
        t3 = time.perf_counter()
        if staged:  # received: from the transfer call to this one; load: the pause's load, tag and resume
            return {"pause_s": t2 - self._transfer_t0, "load_s": t3 - t2, "stall_s": t3 - self._transfer_t0,
                    "recomputed_tokens": self._recomputed,
                    "received": self._transfer_t0 - (self._transfer_t1 or t2)}  # fmt: skip
        t0, t1 = self._transfer_t0, self._transfer_t1 or t2
        return {
            "pause_s": t1 - t0,
            "load_s": t3 - t1,
            "stall_s": t3 - t0,
            "recomputed_tokens": self._recomputed,
            "received": t2 - t1,
        }

    async def _break(self, why: str) -> None:
        self._broken = f"engine {self.engine_id}: {why}"
        with contextlib.suppress(Exception):  # a dead engine has nothing left to abort
            await self._vllm.abort(list(self._pieces))
        self._open.set()

    async def _quiesce(self, mode: str) -> int:
        """Pause (all but drain) and settle running requests as `mode` says. Returns the KV
        positions running requests must recompute (recompute, abort_resume)."""
        if mode != "drain":
            await self._vllm.pause("keep", clear_cache=mode == "recompute")
        recomputed = 0
        if mode in ("recompute", "abort_resume"):
            for traj, piece, _ in self._samples.values():
                if piece is not None and (state := self._state(piece)) is not None:
                    recomputed += len(traj.prompt_token_ids) + len(traj.token_ids) + len(self._vllm.so_far(state)[0])
        if mode in ("keep", "abort_resume"):
            # keep: a request whose first token is not out may straddle the update with its
            # prompt; rerun it. abort_resume: every request continues as a new one.
            stop = [pid for pid, p in self._pieces.items() if mode == "abort_resume" or not self._started(p)]
            for pid in stop:
                self._pieces[pid].resubmit = True
            if stop:
                await self._vllm.abort(stop)
        return recomputed

    async def _load(self, epoch: int, mode: str) -> tuple[float, float, int]:
        """Pause (all but drain), load, tag, resume. Returns the times the load started and ended,
        and the KV positions running requests must recompute (recompute, abort_resume)."""
        recomputed = await self._quiesce(mode)
        t1 = time.perf_counter()
        await self._vllm.load(self._staged[epoch][0])
        t2 = time.perf_counter()
        await self._vllm.set_epoch(epoch)
        self.epoch = epoch
        await self._vllm.resume()
        return t1, t2, recomputed
