"""Weight updates and engine restarts: the two-phase update, epoch allocation, restoring a restarted engine.

Owns: the current epoch (what every healthy engine serves) and the highest epoch ever allocated
(never reused), the update lock that serialises updates and readmissions, the weights of the
current epoch as shared with the engines (what a restarted engine loads), restarted engines
waiting for weights (parked), and the per-update figures (`UpdateStats`). An update runs in two
phases: every engine receives the weights, or is ready to (`stage_weights`; if one cannot,
nothing changes; one found dead there leaves rotation and restarts, and the update goes on without
it), then every engine loads them inside a pause (`commit_weights`); an engine that fails to load
leaves rotation. Two sources: a state dict or directory (`update`: through Ray's
object store), or vLLM's weight-transfer calls from a learner (`rollout.weights.transfer`: the
learner sends, the driver checks metadata and runs the same phases, using what is here).
Restarts: a restarted engine loads the current epoch's exact bytes when the driver holds them (a
state dict in the object store; a directory that has not changed). After a learner's transfer
the bytes live only in the learner: the restarted engine is parked, out of rotation, and loads
the next update, whatever its source; never other bytes under the current epoch. While a
learner holds `rollout serve`'s /pause (`held`), a restarted engine is paused before it rejoins
or parks, so the pause holds until the learner's /resume (`rollout.serve.rl_routes`).
Does not own: checking weights against the model (`rollout.tensors`, `rollout.weights.transfer`),
loading them into vLLM (`policies.vllm_policy`), scheduling (`rollout.scheduling.scheduler`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio

from rollout.aio import fan_out
from rollout.config import Config
from rollout.errors import EngineClosedError, EngineDeadError, WeightSyncError
from rollout.log import get_logger
from rollout.tensors import Manifest, fingerprint, read_manifest
from rollout.types import UpdateStats
from rollout.weights.round import describe, failures
from rollout.weights.update_checks import pack_on_loop

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from rollout.handout.durable import DurableLog
    from rollout.scheduling.protocols import Engine, EnginePool
    from rollout.scheduling.scheduler import Scheduler

log = get_logger(__name__)
SHARE_ON_LOOP_BYTES = 64 << 20  # state dicts up to this size go into the object store on the loop's thread (~10 ms)
# `weights` of an epoch a learner sent (`rollout.weights.transfer`): its bytes live only in the learner
LEARNER = object()


class WeightUpdates:
    """The weight-update side of a `RolloutEngine`; `bind` it once the engines and scheduler run."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.epoch = 0  # the weights every healthy engine serves; +1 per update
        self.history: list[UpdateStats] = []
        self.lock = anyio.Lock()  # updates and readmissions after a restart, one at a time
        self.manifest: Any = None
        self.weights: Any = None  # the latest weights as shared with the engines (restarts load them)
        self.weights_stamp: Any = None  # ... and, for a directory, what it held then (`fingerprint`)
        self.allocated = 0  # the highest epoch any engine may have loaded: the next one is above it
        self._restarts: dict[int, int] = {}
        self._parked: dict[int, Engine] = {}  # restarted, waiting for the next update (after a learner's transfer)
        self.incarnations: dict[int, int] = {}  # engine -> +1 per restart or broken transfer group
        self.held = False  # a learner's /pause (`rollout.serve.rl_routes`) holds every engine, restarted ones too
        self._scheduler: Scheduler | None = None  # admission's epoch, the runner's engines in rotation
        self.pool: EnginePool | None = None
        self.model_path = ""
        self.tg: TaskGroup | None = None
        self._durable: DurableLog | None = None
        self._start_epoch = 0
        self._closed = False  # the engine is shutting down: updates end with EngineClosedError, nothing restarts
        self.returned_early = 0  # the newest epoch an update call returned before its engines loaded it
        self._settling: anyio.Event | None = None  # set when an update that did not wait (`wait=False`) ends
        self._failure: Exception | None = None  # ... its failure, raised once by the next call that waits on it

    def bind(
        self,
        scheduler: Scheduler,
        pool: EnginePool,
        model_path: str,
        tg: TaskGroup,
        durable: DurableLog | None = None,
        start_epoch: int = 0,
    ) -> None:
        """The running scheduler, engine pool, model directory, the task group restarts run in, the
        durable log (which records each allocated epoch: a later run resumes above it) and the
        epoch this run started at."""
        self._scheduler, self.pool, self.model_path, self.tg = scheduler, pool, model_path, tg
        self._durable, self._start_epoch = durable, start_epoch

    def close(self) -> None:
        """The engine is shutting down: an update in flight, or waiting for the lock, raises
        EngineClosedError (its engines are going away), and no engine is restarted."""
        self._closed = True

    async def update(self, weights: Any, wait: bool = True) -> int:
        """`RolloutEngine.update_weights`: see there."""
        try:
            await self.settled()
            if wait:
                return await self._update(weights)
            return await self.tg.start(self._update_later, weights)
        except Exception as e:
            if self._closed:
                raise EngineClosedError(
                    f"the engine was shut down during this weight update ({type(e).__name__}: {e})"
                ) from e
            raise

    async def _update_later(self, weights: Any, task_status: Any) -> None:
        """`update(wait=False)`: what fails before the call returns raises in the caller;
        the rest (every engine receives, then loads) runs here, its failure kept for `settled`."""
        returned = False

        def return_now(epoch: int) -> None:
            nonlocal returned
            returned = True
            task_status.started(epoch)

        self._settling = anyio.Event()
        await self._detached(lambda: self._update(weights, return_now), lambda: returned, self._settling)

    def finish_later(self, epoch: int, work: Callable[[], Awaitable[Any]]) -> None:
        """The caller returns `epoch` now (`return_early`) and `work()` (the update's last phases) runs
        in the background: the next update, and `settled`, wait for it (from now on); its failure
        is raised once by `settled`."""
        self.return_early(epoch)
        self._settling = anyio.Event()
        self.tg.start_soon(self._detached, work, lambda: True, self._settling)

    async def _detached(
        self, work: Callable[[], Awaitable[Any]], returned: Callable[[], bool], done: anyio.Event
    ) -> None:
        try:
            await work()
        except Exception as e:
            if not returned():  # the caller is still waiting: its error
                raise
            self._failure = e
            log.error("weight update that was not waited for failed", error=f"{type(e).__name__}: {e}")
        finally:
            if self._settling is done:
                self._settling = None
            done.set()

    @property
    def learner_epoch(self) -> int:
        """The learner's weights: the newest epoch an update call returned, its engines loading it
        or not (`wait=False`). Staleness counts lag from it at hand-out. Admission counts from the
        epoch the engines serve (`serve`): a group let in for `epoch` before they load it would
        generate with the one before, and lag one more than admission allowed for."""
        return max(self.epoch, self.returned_early)

    def return_early(self, epoch: int) -> None:
        """An update call returns `epoch` before its engines load it: the learner holds it from now."""
        self.returned_early = epoch

    async def settled(self) -> int:
        """Wait for an update that did not wait (`wait=False`) to end; raise its failure once (then
        it is forgotten). Returns the epoch every healthy engine serves."""
        while self._settling is not None:
            await self._settling.wait()
        if (e := self._failure) is not None:
            self._failure = None
            raise WeightSyncError(
                f"an update that was not waited for failed: {e}", list(getattr(e, "failed", []))
            ) from e
        return self.epoch

    async def _update(self, weights: Any, return_now: Any = None) -> int:
        pool = self.pool
        async with self.lock:
            if self._closed:
                raise EngineClosedError("the engine was shut down before this weight update began")
            t0 = time.perf_counter()
            if self.manifest is None:
                self.manifest = await anyio.to_thread.run_sync(read_manifest, self.model_path)
            payload = await pack_on_loop(weights, self.manifest)
            stamp = await anyio.to_thread.run_sync(fingerprint, payload) if isinstance(payload, str) else None
            live = self.members()
            engines = [pool.engines[i] for i in live]
            epoch = self.next_epoch()
            # a copy into the object store: on the loop when small (a worker thread's GIL hand-offs cost more than
            # the copy)
            small = isinstance(payload, str) or payload.nbytes <= SHARE_ON_LOOP_BYTES
            shared = pool.share(payload) if small else await anyio.to_thread.run_sync(pool.share, payload)
            if return_now is not None:  # the caller goes on from here: the epoch is its, failed or not
                await self.allocate(epoch)
                self.return_early(epoch)
                return_now(epoch)
            live, engines, received = await self._stage(epoch, live, engines, shared)
            self.allocated = epoch  # an engine may hold it from here on: never allocated again
            # every engine serves `epoch`, or left rotation, before anyone else looks
            with anyio.CancelScope(shield=True):
                if return_now is None:
                    await self.record(epoch)
                stats, bad = await self._commit(epoch, live, engines, received, payload, prepared=t0)
                if len(bad) < len(live):
                    self.weights, self.weights_stamp = shared, stamp
                    self.serve(epoch, live, bad)
            if len(bad) == len(live):
                raise WeightSyncError(f"epoch {epoch}: every engine failed to load it: {describe(bad)}", list(bad))
            log.info(
                "weights updated", epoch=epoch, seconds=round(stats.seconds, 3), mode=stats.mode, failed=stats.failed
            )
            if bad:
                raise WeightSyncError(
                    f"epoch {epoch}: {describe(bad)}; out of rotation, the others serve epoch {epoch}", list(bad)
                )
            return epoch

    async def _stage(
        self, epoch: int, live: list[int], engines: list[Engine], shared: Any
    ) -> tuple[list[int], list[Any], list[Any]]:
        """Phase 1 of `update`: every engine of `live` receives `shared`. Returns the engines that
        did, with what each received. An engine found dead leaves rotation and the update goes on
        without it: its crash is not the update's failure (the health watch could as well have
        seen it a moment earlier), and its restart loads whatever epoch is current by then. Any
        other failure (a live engine that cannot take the weights), or none left alive, calls the
        update off: WeightSyncError, no engine changed."""
        received = await fan_out(e.stage_weights(epoch, shared) for e in engines)
        bad = failures(live, received)
        dead = {i: bad[i] for i, r in zip(live, received) if isinstance(r, EngineDeadError)}
        for i, reason in dead.items():
            self.lost(i, reason)
        if len(bad) > len(dead) or len(dead) == len(live):
            await fan_out(e.drop_weights(epoch) for i, e in zip(live, engines) if i not in dead)
            raise WeightSyncError(f"epoch {epoch}: weights did not reach {describe(bad)}; no engine changed", list(bad))
        if dead:
            log.warning("engine found dead at a weight update: out of rotation, the update goes on without it",
                        epoch=epoch, engines=sorted(dead), reason=describe(dead))  # fmt: skip
        kept = [k for k, i in enumerate(live) if i not in dead]
        return [live[k] for k in kept], [engines[k] for k in kept], [received[k] for k in kept]

    def lost(self, i: int, reason: str) -> None:
        """Engine `i` is dead or failed to load: out of rotation, and restarted (a parked one again)."""
        if i in self._parked:  # restarted, never back in rotation: restart it again
            del self._parked[i]
            if not self.restart_later(i):
                self._scheduler.runner.give_up(i, reason)
        else:
            self._scheduler.runner.mark_dead(i, reason)

    async def record(self, epoch: int) -> None:
        """With a durable log: `epoch` is allocated, so a later run resuming from the log starts above it."""
        if self._durable is not None:
            await anyio.to_thread.run_sync(self._durable.set_epoch, epoch)

    def failed_transfer(self, i: int) -> None:
        self.incarnations[i] = self.incarnations.get(i, 0) + 1  # its transfer group is broken: the learner inits again

    # -- what a learner's transfer round uses (`rollout.weights.round.Updates`) ----------------------

    def engines(self, ids: list[int]) -> list[Engine]:
        return [self.pool.engines[i] for i in ids]

    def incarnation(self, i: int) -> int:
        return self.incarnations.get(i, 0)

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        self.tg.start_soon(fn, *args)

    def next_epoch(self) -> int:  # above every epoch an engine may have loaded: never one used before
        return max(self.epoch, self.allocated) + 1

    async def allocate(self, epoch: int) -> None:  # an engine may hold `epoch` from here on: never reused
        self.allocated = epoch
        await self.record(epoch)

    def model_manifest(self) -> Manifest:
        """The model's tensors (names, dtypes, shapes), read once from its safetensors headers."""
        if self.manifest is None:
            self.manifest = read_manifest(self.model_path)
        return self.manifest

    def learner_serves(self, epoch: int, live: list[int], bad: dict[int, str]) -> None:
        """`serve` an epoch a learner's transfer loaded: its bytes live only in the learner, so an
        engine restarted from now on waits out of rotation for the next update."""
        self.weights, self.weights_stamp = LEARNER, None
        self.serve(epoch, live, bad)

    def members(self) -> list[int]:
        """The engines an update goes to: every healthy one, and restarted ones waiting for weights."""
        live = sorted({i for i, load in enumerate(self._scheduler.runner.loads) if load.healthy} | set(self._parked))
        if not live:
            raise EngineDeadError("every engine is dead")
        return live

    def serve(self, epoch: int, live: list[int], bad: dict[int, str]) -> None:
        """`epoch` is served: by every engine of `live` not in `bad`; parked ones rejoin rotation."""
        self.epoch = epoch
        # admission counts the groups started in this run, so it counts epochs from the run's start
        self._scheduler.admission.set_epoch(epoch - self._start_epoch)
        for i in [i for i in live if i in self._parked and i not in bad]:
            self._scheduler.runner.revive(i, self._parked.pop(i))

    async def _commit(
        self,
        epoch: int,
        live: list[int],
        engines: list[Any],
        received: list[Any],
        payload: Any,
        prepared: float | None = None,
    ) -> tuple[UpdateStats, dict[int, str]]:
        """Phase 2 of an update on every engine that received it; failed ones leave rotation.
        `prepared`: when the update began (its figures split at phase 2)."""
        mode, timeout = self.cfg.weight_sync.mode, self.cfg.weight_sync.timeout_s
        t0 = time.perf_counter()
        # drain: the engine first waits for its running requests (bounded by their max_tokens) and
        # times the load itself; a slow generation is not a failed load.
        wait = None if mode == "drain" else timeout

        results = await fan_out(asyncio.wait_for(e.commit_weights(epoch), wait) for e in engines)
        bad = failures(live, results, f"no answer within weight_sync.timeout_s={timeout}")
        for i in bad:
            self.lost(i, bad[i])
        stats = UpdateStats(
            epoch=epoch,
            mode=mode,
            bytes=getattr(payload, "nbytes", 0),
            bytes_received=sum(r for r in received if isinstance(r, int)),
            seconds=time.perf_counter() - t0,
            prepare_s=t0 - prepared if prepared is not None else 0.0,
            stall_s={i: r["stall_s"] for i, r in zip(live, results) if isinstance(r, dict)},
            load_s={i: r["load_s"] for i, r in zip(live, results) if isinstance(r, dict)},
            recomputed_tokens={
                i: int(r.get("recomputed_tokens", 0)) for i, r in zip(live, results) if isinstance(r, dict)
            },
            failed=sorted(bad),
        )
        self.history.append(stats)
        return stats, bad

    def restart_later(self, i: int) -> bool:
        """The scheduler lost engine `i`: restart it in the background, unless it used up its restarts."""
        n = self._restarts.get(i, 0)
        if self._closed or n >= self.cfg.engines.max_restarts or not hasattr(self.pool, "restart"):
            return False
        self._restarts[i] = n + 1
        self.tg.start_soon(self._restart, i, n + 1)
        return True

    async def _restart(self, i: int, n: int) -> None:
        """Restart engine `i` (the `n`-th time), load the current epoch's weights, readmit it."""
        scheduler = self._scheduler
        await anyio.sleep(self.cfg.engines.restart_backoff_s * 2 ** (n - 1))
        try:
            log.warning("restarting engine", engine=i, restart=n, of=self.cfg.engines.max_restarts)
            engine = await self.pool.restart(i)
            self.incarnations[i] = self.incarnations.get(i, 0) + 1  # new worker processes: not in the learner's group
            async with self.lock:  # no update may slip between loading and readmission
                if self.weights is LEARNER:
                    await self._hold(engine)
                    self._parked[i] = engine
                    log.warning(
                        "engine restarted; it waits out of rotation for the next weight update (the current epoch came "
                        "from a learner's transfer, and its bytes live only in the learner)",
                        engine=i, epoch=self.epoch,
                    )  # fmt: skip
                    return
                if self.weights is not None:  # none yet (a resumed run): it serves the model's, like the others
                    await self._restore(engine)
                await self._hold(engine)
                scheduler.runner.revive(i, engine)
        except Exception as e:
            reason = f"restart {n} failed: {type(e).__name__}: {e}"
            if not self.restart_later(i):
                scheduler.runner.give_up(i, reason)
            else:
                log.error("engine restart failed; trying again", engine=i, reason=reason)

    async def hold(self, paused: bool, mode: str = "keep") -> list[Any]:
        """A learner's /pause (`paused`, vLLM's pause `mode`) or /resume: every live engine (in
        rotation, or restarted and parked for the next update) pauses or resumes, and stays so
        until the next call, restarted ones included (`_hold`). Returns each engine's answer;
        raises EngineDeadError naming the first engine that failed."""
        self.held = paused  # before the engines are listed: a restart ending meanwhile matches it
        return await self.on_live("pause_generation", mode) if paused else await self.on_live("resume_generation")

    async def on_live(self, method: str, *args: Any) -> list[Any]:
        """vLLM's `method` on every live engine at once; raises the first failure (naming the engine)."""
        live = [(i, self.pool.engines[i]) for i in self.members()]
        got = await fan_out(e.call(method, *args) for _, e in live)
        for (i, _), r in zip(live, got):
            if isinstance(r, BaseException):
                raise EngineDeadError(f"{method}: engine {i}: {type(r).__name__}: {r}") from r
        return got

    async def _hold(self, engine: Engine) -> None:
        """Pause a restarted engine while a learner's /pause holds (`held`), or resume it after a
        /resume that came meanwhile. The last check runs with no await before the engine rejoins
        (or parks), so a /pause or /resume (which sets `held`, then calls the engines it sees) finds
        it there or has it matched here."""
        paused = False
        while self.held != paused:
            paused = self.held
            await (engine.call("pause_generation", "keep") if paused else engine.call("resume_generation"))

    async def _restore(self, engine: Engine) -> None:
        """Load the current epoch's weights, exactly those bytes, into a restarted engine, within
        `weight_sync.timeout_s` (the receive and the load). Raises WeightSyncError when a weights
        directory changed since it was loaded as this epoch."""
        if (
            self.weights_stamp is not None
            and await anyio.to_thread.run_sync(fingerprint, self.weights) != self.weights_stamp
        ):
            raise WeightSyncError(
                f"weights directory {self.weights} changed since it was loaded as epoch {self.epoch}: "
                "a restarted engine would serve other weights under that epoch; update_weights again to readmit it", []
            )  # fmt: skip
        with anyio.fail_after(self.cfg.weight_sync.timeout_s):
            await engine.stage_weights(self.epoch, self.weights)
            await engine.commit_weights(self.epoch)
