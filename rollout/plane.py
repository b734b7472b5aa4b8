"""The learner's handle on the weight plane: tensors go from the learner's process (or ranks) straight
to every engine's model workers, in buckets, loaded as they arrive; the driver carries metadata only.

    plane = await engine.weight_plane(backend="gloo")          # once; SyncRolloutEngine.weight_plane too
    epoch = await plane.send(model.state_dict())                # every step: the new epoch

Owns: `WeightPlane` (the driver's side of a plane: its store client, round numbers, group keys per
engine incarnation, and for a learner in this process its `PlaneSender`), `SyncWeightPlane`.
A round: every learner rank declares its tensors (names, shapes, dtypes; per shard), the driver
checks them against the model and answers with a ticket (plan, epoch, engines); phase 1: every
engine's workers join the data path (`joined`) or the round is called off with no engine changed;
phase 2 (`go`): each engine pauses, receives and loads, resumes (`rollout.updates`).
A learner with ranks in other processes: `weight_plane(port=P, ranks=S, local=False)` here, a
`rollout.plane_sender.PlaneSender(host, P, rank=r, ranks=S)` in each rank (rank 0 hosts the
store), and `await plane.update()` here while they `send` (NeMo RL's `init_collective` /
`update_weights_from_collective`, see `rollout.generation`).
Does not own: epochs and engine rotation (`rollout.updates`), the wire format
(`policies.transfer`), the worker side (`policies.plane_worker`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from policies.transfer import BACKENDS, GROUP_BACKENDS, EngineEntry, Keys, Outcome, PlaneStage, RankMeta, Ticket
from policies.transports import connect, wait_key
from rollout.errors import InvalidWeightsError, WeightSyncError
from rollout.plane_sender import DEFAULT_BUCKET_BYTES, NameMap, PlaneSender

if TYPE_CHECKING:
    from rollout.engine import RolloutEngine


class WeightPlane:
    """The driver's side of a weight plane, and with `local` (default) the learner's single rank too.

    `backend` (of the local learner; ranks elsewhere choose theirs, the same for all): gloo (CPU,
    any host), shm (CPU engines on this host: shared-memory slots), nccl (GPU), cuda_ipc (an
    engine on this process's GPU).
    `bucket_bytes` x `slots`: what a learner rank holds in flight (for shm: its /dev/shm
    footprint, whatever the model's size); with ranks elsewhere, theirs count.
    `name_map(trainer_name) -> HF name | None`, `check_finite`: see `PlaneSender`.
    `timeout_s`: every wait on a peer (one bucket, one ack, a join); default a quarter of
    `weight_sync.timeout_s`, so that a hung engine is dropped from the stream while the others
    still have time to finish loading.
    """

    def __init__(
        self, engine: RolloutEngine, *, backend: str = "gloo", bucket_bytes: int = DEFAULT_BUCKET_BYTES, slots: int = 2,
        name_map: NameMap | None = None, timeout_s: float | None = None, host: str = "127.0.0.1", port: int = 0,
        ranks: int = 1, local: bool = True, session: str = "rollout", check_finite: bool = True, device: Any = None,
    ):  # fmt: skip
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
        if not local and not port:
            raise ValueError("a plane whose learner ranks live elsewhere needs their store's port (rank 0 hosts it)")
        self.engine, self.ranks, self.session = engine, ranks, session
        self.timeout_s = timeout_s or engine.cfg.weight_sync.timeout_s / 4
        self.sender = None
        if local:
            self.sender = PlaneSender(
                host, port, rank=0, ranks=ranks, session=session, backend=backend, bucket_bytes=bucket_bytes, slots=slots,
                name_map=name_map, timeout_s=self.timeout_s, device=device, check_finite=check_finite,
            )  # fmt: skip
            host, port = self.sender.host, self.sender.port
        self.host, self.port = host, port
        self.store = connect(host, port, self.timeout_s)
        self.keys = Keys(session)
        self._round = int(self.store.get(self.keys.last())) if self.store.check([self.keys.last()]) else 0
        self._closed = False

    @property
    def address(self) -> tuple[str, int]:
        """Where the plane's store listens: what learner ranks in other processes connect to."""
        return self.host, self.port

    async def send(self, weights: Mapping[str, Any], shards: Mapping[str, tuple[int, tuple[int, ...]]] | None = None) -> int:
        """Load `weights` (trainer name -> tensor) into every healthy engine; returns the new epoch.
        Only with a local learner. Raises what `RolloutEngine.update_weights` raises; see
        `PlaneSender.send` for `shards`."""
        if self.sender is None:
            raise RuntimeError("this plane's learner ranks live in other processes: await plane.update() while they send")
        self._check_open()
        result: dict[str, Any] = {}

        async def learner() -> None:
            try:
                await anyio.to_thread.run_sync(self.sender.send, weights, shards)  # type: ignore[union-attr]
            except Exception as e:  # the driver's error says it better (and names the engines)
                result["learner"] = e

        async with anyio.create_task_group() as tg:
            tg.start_soon(learner)
            try:
                result["epoch"] = await self.engine._updates.plane_round(self)
            except Exception as e:
                result["driver"] = e
        if "driver" in result:
            raise result["driver"]
        return result["epoch"]

    async def update(self) -> int:
        """The driver's side of one round whose learner ranks `send` elsewhere; returns the new epoch."""
        self._check_open()
        return await self.engine._updates.plane_round(self)

    async def close(self) -> None:
        """Leave the plane: this learner's groups and slots go (rank 0: its store too)."""
        if self._closed:
            return
        self._closed = True
        if self.sender is not None:
            await anyio.to_thread.run_sync(self.sender.close)
        self.store = None  # the last reference: the client disconnects now, not whenever it is collected

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the weight plane is closed")

    # -- the driver's side of a round (`rollout.updates.WeightUpdates.plane_round`) ------------------

    def begin(self) -> int:
        self._round += 1
        return self._round

    def collect(self, n: int) -> list[RankMeta]:
        """Every learner rank's declarations for round `n` (blocking; a rank that fails says so)."""
        return [
            msgspec.msgpack.decode(self._wait(self.keys.meta(n, r), f"learner rank {r}'s declarations", n), type=RankMeta)
            for r in range(self.ranks)
        ]

    def ticket(
        self, n: int, epoch: int, plan: Any, engines: list[int], workers: int, metas: list[RankMeta],
        ready_timeout_s: float | None, incarnations: dict[int, int],
    ) -> Ticket:  # fmt: skip
        """Publish round `n`'s ticket: the plan, the epoch, each engine with its data group."""
        backend = metas[0].backend  # the learner ranks' (`_plan` checked they agree)
        entries = [EngineEntry(e, workers, self._group(backend, e, engines, incarnations)) for e in engines]
        slots = {m.rank: m.slots for m in metas if m.slots}
        t = Ticket(n, epoch, "", backend, self.ranks, plan, entries, slots, self.timeout_s, ready_timeout_s)
        self.store.set(self.keys.ticket(n), msgspec.msgpack.encode(t))
        return t

    def refuse(self, n: int, error: str) -> None:
        self.store.set(self.keys.ticket(n), msgspec.msgpack.encode(Ticket(n, error=error)))

    def stage(self, n: int, engine: int) -> PlaneStage:
        return PlaneStage(self.host, self.port, self.session, n, engine, self.timeout_s)

    def joined(self, n: int, ticket: Ticket) -> dict[int, str]:
        """Phase 1: engine -> why it cannot receive (timeout or its own report); raises
        WeightSyncError when a learner rank cannot send."""
        for r in range(self.ranks):
            if (got := self._wait(self.keys.joined(n, f"L{r}"), f"join from learner rank {r}", n)) != b"":
                raise WeightSyncError(got.decode(), [])
        bad: dict[int, str] = {}
        for e in ticket.engines:
            for w in range(e.workers):
                try:
                    got = self._wait(self.keys.joined(n, f"{e.engine}.{w}"), f"join from engine {e.engine}", n)
                except TimeoutError as err:
                    got = str(err).encode()
                if got:
                    bad.setdefault(e.engine, got.decode())
        return bad

    def go(self, n: int, reason: str = "go") -> None:
        self.store.set(self.keys.go(n), reason.encode())

    def drop(self, n: int, engine: int, reason: str) -> None:
        """Engine `engine` failed in round `n`: the learner stops sending to it."""
        if not self.store.check([self.keys.dropped(n, engine)]):
            self.store.set(self.keys.dropped(n, engine), f"engine {engine}: {reason}".encode())

    def finish(self, n: int, outcome: Outcome, plan: Any = None, engines: list[int] = ()) -> None:
        """Round `n` is over: tell the learner ranks, and clear its per-bucket keys."""
        self.store.set(self.keys.done(n), msgspec.msgpack.encode(outcome))
        self.store.set(self.keys.last(), str(n).encode())
        for b in range(len(plan.buckets) if plan is not None else 0):
            self.store.delete_key(self.keys.hdr(n, b))
            for e in engines:
                self.store.delete_key(self.keys.ackc(n, b, e))
                self.store.delete_key(self.keys.ack(n, b, e))

    @staticmethod
    def _group(backend: str, engine: int, engines: list[int], incarnations: dict[int, int]) -> str:
        """gloo: a group per engine (a failed engine breaks only its own); nccl: one group over all
        engines (NCCL's pipelined broadcast), new whenever the engines or their incarnations change."""
        if backend == "gloo":
            return f"e{engine}.{incarnations.get(engine, 0)}"
        members = ",".join(f"{e}.{incarnations.get(e, 0)}" for e in sorted(engines))
        return "all." + hashlib.sha1(members.encode()).hexdigest()[:12]

    def _wait(self, key: str, what: str, n: int) -> bytes:
        lfail = [self.keys.lfail(n, r) for r in range(self.ranks)]

        def learner_failed() -> str | None:
            return next((self.store.get(k).decode() for k in lfail if self.store.check([k])), None)

        return wait_key(self.store, key, self.timeout_s, f"{what} for round {n}", learner_failed)


class SyncWeightPlane:
    """`WeightPlane` for blocking code (`SyncRolloutEngine.weight_plane`)."""

    def __init__(self, portal: Any, plane: WeightPlane):
        self._portal, self.plane = portal, plane

    @property
    def address(self) -> tuple[str, int]:
        return self.plane.address

    def send(self, weights: Mapping[str, Any], shards: Mapping[str, tuple[int, tuple[int, ...]]] | None = None) -> int:
        return self._portal.call(self.plane.send, weights, shards)

    def update(self) -> int:
        return self._portal.call(self.plane.update)

    def close(self) -> None:
        self._portal.call(self.plane.close)


__all__ = ["GROUP_BACKENDS", "InvalidWeightsError", "PlaneSender", "SyncWeightPlane", "WeightPlane"]
