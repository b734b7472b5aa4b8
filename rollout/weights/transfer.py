"""vLLM's trainer API on this engine: its four weight-transfer calls, wrapped in our guarantees.

    client = engine.weight_sync_client()          # vLLM's VLLMWeightSyncClient methods
    trainer = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(world_size=1 + client.world_size(), rank=0), client=client, source=source)
    trainer.send_weights()                        # every step (from a thread of the learner's)
    engine.epoch                                  # the epoch finish_weight_update started

Owns: `WeightTransfer`, the driver's side of vLLM's calls on every engine (each engine runs vLLM's
own call on its workers: `policies.weight_loading`), made by the blocking `VLLMWeightSyncClient`
a learner hands to vLLM's `TrainerWeightTransferEngine` (ours, `gloo`, on CPU; vLLM's `nccl` /
`ipc` on GPUs; the client is `rollout.weights.sync_client.WeightSyncClient`). It reaches the
engine's epochs and engines through `rollout.weights.round.Updates` alone. What we add to vLLM's calls:
1) `init_weight_transfer_engine`: every healthy engine joins, each at its own rank (`rank_offset`
   + k x its model workers); `world_size` is checked against them. Our backends' `timeout_s`
   (each of a worker's waits: connect, rendezvous, receive) is capped at `weight_sync.timeout_s`,
   whatever the learner asked (the errors say so). Their workers check the info and answer at
   once: the rendezvous with the learner runs in a thread of each worker, so an engine core
   never waits inside the call for a learner that is not there, and init's answer means "every
   engine took the info", not "every engine joined" (vLLM's `nccl` / `ipc` join inside the call).
   A rendezvous that failed costs the learner's next round: its finish (whose settle waits
   for a rendezvous still running, within the init's deadline) calls it off, nothing loaded,
   every engine in rotation on the epoch before; the error names the address and the cap. An
   engine that does not answer the init within twice `weight_sync.timeout_s` (plus a margin) is
   stuck inside the call: it leaves rotation and restarts. A failed init leaves no engine
   joined; the next init starts afresh, closing whatever rendezvous the last one left running.
2) `start_weight_update`: takes the update lock (no other update runs until the round ends) and
   fixes the engines and the epoch the round would load (`max(epoch, allocated) + 1`). No engine
   changes yet.
3) `update_weights`: the update's names, dtypes and shapes are checked against the model first,
   each name once per round, and, where one call carries the whole round (`ONE_CALL_ROUND`: vLLM's
   `nccl` trainer and ours send every name in it; vLLM's `ipc` trainer one call per packed chunk,
   so its completeness is known only at finish), every parameter of the model
   (InvalidWeightsError naming the tensor; no engine changed). Then every engine runs vLLM's
   `start_weight_update` (vLLM's `nccl` / `ipc`: after pausing as `weight_sync.mode` says; our
   `gloo` stages the bytes, so its engines keep generating); if one cannot, the started ones go
   back to their old weights and nothing changes. Only then is the epoch allocated (never used
   again) and the bytes received (`gloo`: into a staging copy in each worker, the model
   untouched); an engine that fails or exceeds `weight_sync.timeout_s` leaves rotation (it may
   hold torn weights; it refuses work and restarts).
4) `finish_weight_update`: a staging backend's engines first wait for every staged byte (a
   settle); then every engine (`gloo`: pausing now, as `weight_sync.mode` says, for the load
   alone) finishes the load, tags the epoch and resumes: the new epoch starts here, and is
   returned and recorded (`engine.weight_updates`). Without every checkpoint tensor received, no
   engine serves the round. Tokens produced before an engine's pause carry the old epoch.
A round refused after its engines started (a later call's bad metadata, bytes that did not all
arrive, no learner call for `weight_sync.timeout_s`) is called off: a staging backend's engines
hold the bytes beside the model, so each drops them and goes on serving the epoch before, in
rotation (the learner inits again); an engine that cannot drop them, or a backend that loads as
the bytes come (vLLM's `nccl`, `ipc`: the engines hold part of the round), leaves rotation and
restarts, and the error names which. Restarts: the epoch's bytes
live only in the learner, so a restarted engine waits out of rotation for the next update
(`rollout.weights.updates`); it joins the learner's group at the next
`init_weight_transfer_engine`.
The update's checks and the init's cap live in `rollout.weights.update_checks`; the round's state
in `rollout.weights.round`.
Does not own: moving bytes (vLLM's engines, `policies.gloo_transfer`), epochs and restarts
(`rollout.weights.updates`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anyio

from rollout.aio import fan_out
from rollout.errors import EngineDeadError, InvalidWeightsError, WeightSyncError
from rollout.log import get_logger
from rollout.transfer_backend import stages
from rollout.types import UpdateStats
from rollout.weights.round import Round, Updates, add_label, describe, failures
from rollout.weights.update_checks import capped_infos, check_update

SETTLE = "settle"  # the update info asking a staging backend's engine to wait for its bytes (`policies.weight_loading`)

log = get_logger(__name__)


class WeightTransfer:
    """The driver's side of vLLM's weight-transfer calls (see the module docstring)."""

    def __init__(self, updates: Updates):
        self.u = updates  # the engine's epochs and engines, through `Updates` only
        self.members: list[int] | None = None  # engines that joined the learner's group
        self.incarnations: dict[int, int] = {}
        self.round: Round | None = None
        self.versions: dict[str, int] = {}  # weight_version label -> epoch, the newest last (`_label`)
        self.capped = ""  # the last init's cap of the learner's timeout_s, said in the errors of its rendezvous
        self.confirmed = False  # a round since the last init loaded: the engines' rendezvous held

    def world_size(self) -> int:
        """Model workers over every engine an update goes to (the learner's group adds itself)."""
        return len(self.u.members()) * model_workers(self.u.cfg)

    async def init(self, init_info: dict[str, Any]) -> None:
        """vLLM's `init_weight_transfer_engine` on every engine, each at its own ranks."""
        await self.u.settled()
        if self.round is not None:
            raise WeightSyncError("init_weight_transfer_engine called during a weight update", [])
        async with self.u.lock:
            live, workers = self.u.members(), model_workers(self.u.cfg)
            offset = int(init_info.get("rank_offset", 0))
            if "world_size" in init_info and int(init_info["world_size"]) != offset + len(live) * workers:
                raise WeightSyncError(
                    f"init_weight_transfer_engine: world_size {init_info['world_size']}, but the learner's "
                    f"{offset} rank(s) and {len(live)} engines x {workers} model workers make "
                    f"{offset + len(live) * workers}", [],
                )  # fmt: skip
            infos = [
                {**init_info, "rank_offset": offset + k * workers} if "rank_offset" in init_info else init_info
                for k in range(len(live))
            ]
            infos, capped = capped_infos(self.u.cfg, infos)
            engines, bound = self.u.engines(live), 2 * self.u.cfg.weight_sync.timeout_s + 5
            got = await fan_out(asyncio.wait_for(e.call("init_transfer", info), bound)
                                for e, info in zip(engines, infos))  # fmt: skip
            if bad := failures(live, got, f"no answer within {bound:g} s"):
                self.members = None
                hung = [i for i, r in zip(live, got) if isinstance(r, TimeoutError)]
                for i in hung:  # its engine core is still inside the call: it cannot be trusted
                    self.u.failed_transfer(i)
                    self.u.lost(i, f"init_weight_transfer_engine: {bad[i]}")
                raise WeightSyncError(f"init_weight_transfer_engine failed on {describe(bad)}"
                                      f"{f'; engines {hung} out of rotation, restarting' if hung else ''}{capped}",
                                      sorted(bad))  # fmt: skip
            self.members, self.incarnations = live, {i: self.u.incarnation(i) for i in live}
            self.capped, self.confirmed = capped, not stages(self.u.cfg)

    async def start(self) -> None:
        """vLLM's `start_weight_update`: the round's lock, engines and epoch; no engine changes.
        A round whose finish did not wait (`wait=False`) ends first; its failure raises here, once."""
        await self.u.settled()
        if self.round is not None:
            raise WeightSyncError(
                "start_weight_update called while a weight update is active: finish_weight_update first", []
            )
        if self.members is None:
            raise WeightSyncError("start_weight_update called before init_weight_transfer_engine", [])
        rnd = self.round = Round(0, [], [])
        self.u.start_soon(self._hold, rnd)
        await rnd.locked.wait()
        try:
            live = self.u.members()
            gone = [i for i in self.members if i not in live or self.u.incarnation(i) != self.incarnations[i]]
            if gone or set(live) != set(self.members):
                raise WeightSyncError(
                    f"start_weight_update: engines {sorted(set(gone) | (set(live) - set(self.members)))} restarted or "
                    "left since init_weight_transfer_engine: call it again (the learner's trainer_init); "
                    "no engine changed",
                    sorted(gone),
                )  # fmt: skip
        except BaseException:
            self._close(rnd)
            raise
        rnd.live, rnd.engines = live, self.u.engines(live)
        rnd.epoch = self.u.next_epoch()

    async def update(self, update_info: Any) -> None:
        """vLLM's `update_weights` on every engine of the round, after the checks (module docstring)."""
        rnd = self._active("update_weights")
        rnd.busy += 1
        rnd.poke.set()
        try:
            with anyio.CancelScope(shield=rnd.started):
                await self._update(rnd, update_info)
        finally:
            rnd.busy -= 1
            rnd.poke.set()

    async def _update(self, rnd: Round, update_info: Any) -> None:
        names, problems, nbytes = check_update(self.u.model_manifest(), self.u.cfg, rnd.names, update_info)
        rnd.nbytes += nbytes
        if problems:
            shown = "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
            if not rnd.started:
                self._close(rnd)
                raise InvalidWeightsError(f"the learner's weights do not fit the model: {shown}; no engine changed")
            raise InvalidWeightsError(f"the learner's weights do not fit the model: {shown}; "
                                      f"{await self._call_off(rnd, f'update_weights: {shown}')}")  # fmt: skip
        if not rnd.started:
            await self._start_engines(rnd)
        rnd.names |= set(names)
        with anyio.CancelScope(shield=True):  # engines load from here on: they end loaded or out of rotation
            await self._transfer(rnd, update_info)

    async def _start_engines(self, rnd: Round) -> None:
        """Every engine starts vLLM's update (pausing first unless its backend stages the bytes:
        `policies.weight_loading`), or none stays changed."""
        got = await fan_out(e.call("start_transfer", rnd.epoch) for e in rnd.engines)
        if bad := failures(rnd.live, got):
            ok = [e for e, r in zip(rnd.engines, got) if not isinstance(r, BaseException)]
            await fan_out(e.call("finish_transfer", rnd.epoch, False) for e in ok)
            for i, r in zip(rnd.live, got):
                if isinstance(r, EngineDeadError):
                    self.u.lost(i, bad[i])
            self._close(rnd)
            raise WeightSyncError(
                f"epoch {rnd.epoch}: {describe(bad)} could not start the update; no engine changed", sorted(bad)
            )
        rnd.started = True
        await self.u.allocate(rnd.epoch)  # an engine may hold it from here on: never allocated again

    async def _transfer(self, rnd: Round, update_info: Any) -> None:
        live = [i for i in rnd.live if i not in rnd.bad]
        engines = [e for i, e in zip(rnd.live, rnd.engines) if i not in rnd.bad]
        got = await fan_out(e.call("transfer", update_info) for e in engines)
        for i, reason in failures(live, got).items():
            rnd.bad[i] = reason
            self.u.failed_transfer(i)
            self.u.lost(i, reason)
        if len(rnd.bad) == len(rnd.live):
            self._close(rnd)
            raise WeightSyncError(
                f"epoch {rnd.epoch}: every engine failed to receive it: {describe(rnd.bad)}; out of rotation, "
                f"the epoch stays {self.u.epoch}", sorted(rnd.bad),
            )  # fmt: skip

    async def finish(self, weight_version: str | None = None, wait: bool = True) -> int:
        """vLLM's `finish_weight_update`: the new epoch starts on every engine that loaded it; returns it.
        `wait=False`: returns the round's epoch once every tensor was sent; the engines finish
        (pause, load, tag, resume) in the background, and the next call waits for them."""
        rnd = self._active("finish_weight_update")
        rnd.busy += 1
        if not wait and rnd.started:
            try:
                await self._complete(rnd)
            except BaseException:
                rnd.busy -= 1
                raise
            rnd.finishing = True
            self.u.finish_later(rnd.epoch, lambda: self._finish_closing(rnd, weight_version))
            return rnd.epoch
        return await self._finish_closing(rnd, weight_version)

    async def _finish_closing(self, rnd: Round, weight_version: str | None) -> int:
        try:
            with anyio.CancelScope(shield=True):
                return await self._finish(rnd, weight_version)
        finally:
            rnd.busy -= 1
            self._close(rnd)

    async def _complete(self, rnd: Round) -> None:
        """Every checkpoint tensor was sent, or no engine serves the round: InvalidWeightsError.
        (A round sent in one call was checked whole there: this catches rounds of several calls.)"""
        if missing := sorted(set(self.u.model_manifest()) - rnd.names):
            sent = f"the learner sent no {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
            raise InvalidWeightsError(f"epoch {rnd.epoch}: {sent}; {await self._call_off(rnd, sent)}")

    async def _settle(self, rnd: Round) -> None:
        """A staging backend's round: every engine has every byte staged, or none loads it and
        each goes on serving its weights (WeightSyncError); an engine that does not answer leaves rotation."""
        live = [i for i in rnd.live if i not in rnd.bad]
        got = await fan_out(e.call("transfer", {SETTLE: True}) for i, e in zip(rnd.live, rnd.engines) if i in live)
        for i, reason in failures(live, got).items():
            rnd.bad[i] = reason
            self.u.lost(i, reason)
        if short := {i: r for i, r in zip(live, got) if isinstance(r, str)}:
            said = await self._call_off(rnd, "bytes missing", skip=short)
            capped = "" if self.confirmed else self.capped  # a rendezvous of the init's may be why
            raise WeightSyncError(
                f"epoch {rnd.epoch}: bytes missing on {describe(short)}{capped}; {said}", sorted(short)
            )

    async def _finish(self, rnd: Round, weight_version: str | None) -> int:
        if not rnd.started:  # nothing was sent: no engine changed
            return self.u.epoch
        await self._complete(rnd)
        if stages(self.u.cfg):
            await self._settle(rnd)
        live = [i for i in rnd.live if i not in rnd.bad]
        engines = [e for i, e in zip(rnd.live, rnd.engines) if i not in rnd.bad]
        t0 = time.perf_counter()
        got = await fan_out(e.call("finish_transfer", rnd.epoch) for e in engines)
        for i, reason in failures(live, got).items():
            rnd.bad[i] = reason
            self.u.lost(i, reason)
        done = {i: r for i, r in zip(live, got) if isinstance(r, dict)}
        self.u.history.append(UpdateStats(
            epoch=rnd.epoch, mode=self.u.cfg.weight_sync.mode, bytes=rnd.nbytes, bytes_received=rnd.nbytes * len(done),
            seconds=time.perf_counter() - t0, prepare_s=t0 - rnd.t0, stall_s={i: r["stall_s"] for i, r in done.items()},
            load_s={i: r["load_s"] for i, r in done.items()},
            recomputed_tokens={i: int(r["recomputed_tokens"]) for i, r in done.items()},
            failed=sorted(rnd.bad),
        ))  # fmt: skip
        if not done:
            raise WeightSyncError(
                f"epoch {rnd.epoch}: every engine failed to load it: {describe(rnd.bad)}; "
                f"the epoch stays {self.u.epoch}",
                sorted(rnd.bad),
            )
        self.u.learner_serves(rnd.epoch, rnd.live, rnd.bad)  # restarts wait for the next update
        self.confirmed = True  # the engines received every byte: their rendezvous holds
        if weight_version is not None:
            add_label(self.versions, weight_version, rnd.epoch)
        log.info("weights updated", epoch=rnd.epoch, failed=sorted(rnd.bad), source="weight transfer")
        if rnd.bad:
            raise WeightSyncError(
                f"epoch {rnd.epoch}: {describe(rnd.bad)}; out of rotation, the others serve epoch {rnd.epoch}",
                sorted(rnd.bad),
            )
        return rnd.epoch

    def label(self, version: str) -> int:
        """vLLM's `update_weight_version`: `version` names the current epoch (weights do not change)."""
        add_label(self.versions, version, self.u.epoch)
        return self.u.epoch

    def _active(self, call: str) -> Round:
        if self.round is None or not self.round.locked.is_set() or self.round.finishing:
            raise WeightSyncError(f"{call} called without start_weight_update; the epoch stays {self.u.epoch}", [])
        return self.round

    async def _call_off(self, rnd: Round, reason: str, skip: Any = ()) -> str:
        """Ends a started round no engine may serve; says where each engine stands. A staging
        backend's engines (all but `skip`, whose vLLM update already ended) drop the bytes and go
        on with their weights; the learner inits again. Otherwise the engines hold part of the
        round: out of rotation, restarted."""
        if not stages(self.u.cfg):
            self._fail_all(rnd, reason)
            return f"engines {rnd.live} had loaded part of epoch {rnd.epoch}: out of rotation, restarting"
        self._close(rnd)  # no call of the learner's joins the round from here on
        live = [i for i in rnd.live if i not in rnd.bad and i not in skip]
        engines = [e for i, e in zip(rnd.live, rnd.engines) if i in live]
        got = await fan_out(e.call("finish_transfer", rnd.epoch, False) for e in engines)
        for i in rnd.live:
            self.u.failed_transfer(i)  # their groups may be mid-round: the learner inits again
        for i, why in failures(live, got).items():
            rnd.bad[i] = f"could not drop epoch {rnd.epoch}: {why}"
            self.u.lost(i, rnd.bad[i])
        out = f"; {describe(rnd.bad)}: out of rotation, restarting" if rnd.bad else ""
        return f"no engine loaded epoch {rnd.epoch}; every engine serves epoch {self.u.epoch}{out}"

    def _fail_all(self, rnd: Round, reason: str) -> None:
        for i in rnd.live:
            if i not in rnd.bad:
                rnd.bad[i] = reason
                self.u.failed_transfer(i)
                self.u.lost(i, f"epoch {rnd.epoch}: {reason}")
        self._close(rnd)

    def _close(self, rnd: Round) -> None:
        if self.round is rnd:
            self.round = None
        rnd.closed.set()
        rnd.poke.set()

    async def _hold(self, rnd: Round) -> None:
        """The update lock for the round's lifetime; ends a round idle for `weight_sync.timeout_s`."""
        async with self.u.lock:
            rnd.locked.set()
            while not rnd.closed.is_set():
                rnd.poke.clear()
                try:
                    await asyncio.wait_for(rnd.poke.wait(), self.u.cfg.weight_sync.timeout_s)
                except TimeoutError:
                    if rnd.busy or rnd.closed.is_set():
                        continue
                    log.error(
                        "weight transfer: no call for weight_sync.timeout_s; the round ends",
                        epoch=rnd.epoch,
                        started=rnd.started,
                    )
                    if rnd.started:
                        why = f"the learner made no call for weight_sync.timeout_s={self.u.cfg.weight_sync.timeout_s}"
                        said = await self._call_off(rnd, why)
                        log.error("weight transfer: round called off", epoch=rnd.epoch, outcome=said)
                    self._close(rnd)


def model_workers(cfg: Any) -> int:
    """Model workers per engine: each one receives every tensor (vLLM shards them itself)."""
    v = cfg.engines.vllm
    return int(v.get("tensor_parallel_size", 1)) * int(v.get("pipeline_parallel_size", 1))


__all__ = ["WeightTransfer"]
