"""One learner rank of a weight plane: declare what it holds, then stream it to every engine's workers.

Owns: `PlaneSender`, usable in any learner process (the driver's own, or each rank of a sharded
learner): the rank's side of a round. 1) Declare: every tensor it holds (or a dim-0 slice of one),
under its HF name (the name map's), checked here (a tensor, not on `meta`, finite); the driver
checks the declarations of all ranks against the model. 2) Wait for the driver's ticket (the plan,
the epoch, the engines) and join the data path. 3) On `go`, stream its buckets in plan order:
header first (a tensor that changed since it was declared aborts the stream there, naming it),
then the bytes (a broadcast per engine group, or a shared slot reused once every engine acked it).
An engine that stops answering is dropped from the stream; the others go on. 4) Return the epoch
the driver reports, or raise what it reports.
Learner rank 0 hosts the plane's store. Does not own: epochs or engines (the driver,
`rollout.updates`), the wire format (`policies.transfer`), the transports (`policies.transports`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from policies.transfer import ABORT, BACKENDS, GROUP_BACKENDS, OK, Header, Keys, Outcome, RankMeta, ShardMeta, Ticket, my_buckets, pack_bucket
from policies.transports import Groups, Slots, connect, wait_key
from policies.weights import check_finite, tensor_spec
from rollout.errors import InvalidWeightsError, WeightSyncError

DEFAULT_BUCKET_BYTES = 64 << 20
NameMap = Callable[[str], "str | None"]


class PlaneSender:
    """Learner rank `rank` of `ranks` on the plane whose store is at (`host`, `port`).

    Rank 0 hosts the store (`port` 0: a free one, see `.port`). `name_map(trainer_name)` gives the
    HF name, or None to leave the tensor out. `device`: the CUDA device of nccl / cuda_ipc buffers.
    `check_finite`: refuse NaN/inf before any engine changes (one read of every tensor).
    """

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, *, rank: int = 0, ranks: int = 1, session: str = "rollout",
        backend: str = "gloo", bucket_bytes: int = DEFAULT_BUCKET_BYTES, slots: int = 2, name_map: NameMap | None = None,
        timeout_s: float = 300.0, device: Any = None, check_finite: bool = True,
    ):  # fmt: skip
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
        if not 0 <= rank < ranks:
            raise ValueError(f"rank: expected 0 <= rank < ranks={ranks}, got {rank}")
        if bucket_bytes < 1 or slots < 1:
            raise ValueError(f"bucket_bytes and slots: expected >= 1, got {bucket_bytes} and {slots}")
        self.rank, self.ranks, self.session, self.backend = rank, ranks, session, backend
        self.bucket_bytes, self.timeout_s, self.device = bucket_bytes, timeout_s, device
        self.name_map, self.check_finite = name_map, check_finite
        self.store = connect(host, port, timeout_s, master=rank == 0)
        self.host, self.port = host, self.store.port if rank == 0 else port
        self.keys = Keys(session)
        self._round = int(self.store.get(self.keys.last())) if self.store.check([self.keys.last()]) else 0
        self._groups = Groups(backend, self.store, timeout_s, device) if backend in GROUP_BACKENDS else None
        self._slots: Slots | None = None  # shm / cuda_ipc: made at the first send, no larger than the weights
        self._slot_count = slots
        self._staging: list[Any] = []

    def send(self, weights: Mapping[str, Any], shards: Mapping[str, tuple[int, tuple[int, ...]]] | None = None) -> int:
        """Send this rank's tensors as the next round; blocks until the driver ends it. Returns the
        epoch every healthy engine now serves.

        `weights`: trainer name -> tensor (on any device but `meta`). `shards`: trainer name ->
        (first row, whole shape) for a tensor that is dim-0 rows of a larger one (an FSDP shard);
        the ranks together must send every row once. Raises InvalidWeightsError (this rank's or
        another's tensors do not fit the model; no engine changed), WeightSyncError (engines
        failed: the message names them; those that loaded nothing still serve the old epoch).
        """
        n = self._round = self._round + 1
        try:
            return self._send(n, weights, shards or {})
        except (InvalidWeightsError, WeightSyncError):
            raise
        except BaseException as e:  # this rank cannot go on: say so, so that nobody waits for it
            self._tell(self.keys.lfail(n, self.rank), f"learner rank {self.rank}: {type(e).__name__}: {e}")
            raise

    def _send(self, n: int, weights: Mapping[str, Any], shards: Mapping[str, tuple[int, tuple[int, ...]]]) -> int:
        keys, store = self.keys, self.store
        try:
            held, metas = self._declare(weights, shards)
            bucket = min(self.bucket_bytes, max(1, sum(h[0].numel() for h in held.values())))
            if self._groups is None and (self._slots is None or self._slots.nbytes < bucket):
                if self._slots is not None:
                    self._slots.close()
                tag = f"{self.session}-{uuid.uuid4().hex[:8]}"
                self._slots = Slots(self.backend, tag, self.rank, self._slot_count, bucket, self.device)
            bucket = self._slots.nbytes if self._slots is not None else bucket
            meta = RankMeta(self.rank, metas, self.backend, bucket, self._slots.handles if self._slots else [])
        except InvalidWeightsError as e:
            store.set(keys.meta(n, self.rank), msgspec.msgpack.encode(RankMeta(self.rank, error=str(e))))
            raise
        store.set(keys.meta(n, self.rank), msgspec.msgpack.encode(meta))
        ticket = msgspec.msgpack.decode(self._wait(keys.ticket(n), "the driver's ticket", n), type=Ticket)
        if ticket.error:
            raise InvalidWeightsError(ticket.error)
        assert ticket.plan is not None
        index = {t.name: i for i, t in enumerate(ticket.plan.tensors)}
        held = {index[name]: h for name, h in held.items()}
        if self._groups is not None:
            self._join_groups(ticket)
        store.set(keys.joined(n, f"L{self.rank}"), b"")
        if (go := self._wait(keys.go(n), "the driver's go", n)) != b"go":
            raise WeightSyncError(f"round {n} called off before any engine changed: {go.decode()}", [])
        live = {e.engine: e for e in ticket.engines}
        self._stream(n, ticket, held, live)
        outcome = msgspec.msgpack.decode(self._wait(keys.done(n), "the driver's outcome", n, final=True), type=Outcome)
        if outcome.error:
            raise WeightSyncError(outcome.error, outcome.failed)
        return outcome.epoch

    def _declare(self, weights: Mapping[str, Any], shards: Mapping[str, tuple[int, tuple[int, ...]]]) -> tuple[dict[str, Any], list[ShardMeta]]:
        import torch

        if not isinstance(weights, Mapping) or not weights:
            raise InvalidWeightsError(f"weights: expected a non-empty state dict, got {type(weights).__name__ if not isinstance(weights, Mapping) else 'an empty one'}")
        held: dict[str, Any] = {}
        metas, sources = [], {}
        for source, t in weights.items():
            name = self.name_map(source) if self.name_map is not None else source
            if name is None:
                continue
            if name in sources:
                raise InvalidWeightsError(f"weights: {sources[name]!r} and {source!r} both map to {name!r}")
            sources[name] = source
            spec = tensor_spec(source, t)
            if self.check_finite:
                check_finite(source, t)
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            if source in shards:
                start, whole = shards[source]
                if not t.dim() or tuple(whole[1:]) != tuple(t.shape[1:]):
                    raise InvalidWeightsError(f"weights[{source!r}]: shape {list(t.shape)} is not dim-0 rows of {list(whole)}")
                metas.append(ShardMeta(name, spec.dtype, tuple(whole), start, t.shape[0], source))
                held[name] = (flat, start * (flat.numel() // t.shape[0] if t.shape[0] else 0), t, spec)
            else:
                metas.append(ShardMeta(name, spec.dtype, spec.shape, source=source))
                held[name] = (flat, 0, t, spec)
        if unknown := set(shards) - set(weights):
            raise InvalidWeightsError(f"shards: {sorted(unknown)} are not in the weights")
        return held, metas

    def _join_groups(self, ticket: Ticket) -> None:
        assert self._groups is not None
        groups: dict[str, int] = {}
        for e in ticket.engines:
            groups[e.group] = groups.get(e.group, 1) + e.workers
        wanted = {f"{g}/{self.rank}" for g in groups}
        self._groups.keep(wanted)
        for g in sorted(groups):
            self._groups.get(f"{g}/{self.rank}", 0, groups[g])

    def _stream(self, n: int, ticket: Ticket, held: dict[int, Any], live: dict[int, Any]) -> None:
        """Every bucket of this rank, in plan order, to every live engine."""
        import torch

        plan, keys, store = ticket.plan, self.keys, self.store
        assert plan is not None
        mine = list(my_buckets(plan, self.rank))

        def ready() -> None:  # each engine paused and receiving (a drain may take long: ready_timeout_s)
            for e in list(live):
                for w in range(live[e].workers):
                    self._engine_wait(n, live, e, keys.ready(n, e, w), "word that it paused and receives", ticket.ready_timeout_s)

        if self._slots is not None:
            count = len(self._slots.views)
            for k, b in enumerate(mine):
                if k == count:
                    ready()  # the first `count` buckets went out while the engines were pausing
                if k >= count:
                    for e in list(live):
                        self._engine_wait(n, live, e, keys.ack(n, mine[k - count], e), f"ack of bucket {mine[k - count] + 1}", ticket.timeout_s)
                slot = self._slots.views[k % count]
                self._pack(n, ticket, b, held, slot)
                if slot.is_cuda:  # cuda_ipc: the copies are only queued; done before the header lets an engine read the slot
                    torch.cuda.current_stream(slot.device).synchronize()
                store.set(keys.hdr(n, b), msgspec.msgpack.encode(Header(OK, plan.buckets[b].nbytes, k % count)))
            return
        assert self._groups is not None
        if ticket.ready_timeout_s is None:
            ready()  # drain: an engine may take long to start receiving, longer than a broadcast may wait
        # Otherwise the broadcasts go out now, and complete as each engine pauses and receives: a
        # learner thread that first waited for every engine woke up late (the driver's event loop
        # holds the GIL), adding tens of ms to every engine's stall on a small model.
        if not self._staging or self._staging[0].numel() < plan.bucket_bytes:
            self._staging = [self._groups.staging(plan.bucket_bytes) for _ in range(2)]
        works: list[dict[int, Any]] = []
        for k, b in enumerate(mine):
            if k >= 2:
                self._finish(n, live, works[k - 2])
            buf = self._staging[k % 2][: plan.buckets[b].nbytes]
            self._pack(n, ticket, b, held, buf)
            store.set(keys.hdr(n, b), msgspec.msgpack.encode(Header(OK, plan.buckets[b].nbytes)))
            works.append({})
            for e, entry in list(live.items()):
                try:
                    works[k][e] = self._groups.broadcast(self._groups.groups[f"{entry.group}/{self.rank}"], buf)
                except Exception as err:
                    self._drop(n, live, e, f"{type(err).__name__}: {err}")
        for w in works[-2:]:
            self._finish(n, live, w)

    def _pack(self, n: int, ticket: Ticket, b: int, held: dict[int, Any], out: Any) -> None:
        plan = ticket.plan
        assert plan is not None
        for p in plan.buckets[b].pieces:
            flat, base, t, spec = held[p.tensor]
            if t.shape != spec.shape or str(t.dtype).removeprefix("torch.") != spec.dtype or t.is_meta:
                reason = f"{plan.tensors[p.tensor].name} changed since it was declared: {t.dtype} {list(t.shape)}, declared {spec.dtype} {list(spec.shape)}"
                self.store.set(self.keys.hdr(n, b), msgspec.msgpack.encode(Header(ABORT, reason=reason)))
                self._tell(self.keys.lfail(n, self.rank), f"learner rank {self.rank}: {reason}")
                raise InvalidWeightsError(f"{plan.describe(b)}: {reason}; engines that loaded earlier buckets left rotation")
        pack_bucket(plan, b, {i: held[i][:2] for i in {p.tensor for p in plan.buckets[b].pieces}}, out)

    def _finish(self, n: int, live: dict[int, Any], works: dict[int, Any]) -> None:
        for e, work in works.items():
            if e in live:
                try:
                    work.wait()
                except Exception as err:
                    self._drop(n, live, e, f"{type(err).__name__}: {err}")

    def _engine_wait(self, n: int, live: dict[int, Any], e: int, key: str, what: str, timeout_s: float | None) -> None:
        if e not in live:
            return
        try:
            wait_key(self.store, key, timeout_s, f"{what} from engine {e}", lambda: self._gone(n, e))
        except (TimeoutError, WeightSyncError) as err:
            self._drop(n, live, e, str(err))

    def _gone(self, n: int, e: int) -> str | None:
        """Why engine `e` left round `n` (the driver saw it fail, or the round ended), or None."""
        for key in (self.keys.dropped(n, e), self.keys.done(n)):
            if self.store.check([key]):
                return f"engine {e} left round {n}"
        return None

    def _drop(self, n: int, live: dict[int, Any], e: int, reason: str) -> None:
        live.pop(e, None)
        self._tell(self.keys.dropped(n, e), f"engine {e}: learner rank {self.rank} dropped it: {reason}")

    def _tell(self, key: str, message: str) -> None:
        try:
            if not self.store.check([key]):
                self.store.set(key, message.encode())
        except Exception:  # the store is gone: everyone finds out on their own
            pass

    def _wait(self, key: str, what: str, n: int, final: bool = False) -> bytes:
        abort = None if final else (lambda: self._called_off(n))
        return wait_key(self.store, key, self.timeout_s, f"{what} for round {n}", abort)

    def _called_off(self, n: int) -> str | None:
        if self.store.check([self.keys.done(n)]):
            out = msgspec.msgpack.decode(self.store.get(self.keys.done(n)), type=Outcome)
            return out.error or f"round {n} ended"
        return None

    def close(self) -> None:
        """Leave the groups, remove the shared slots, close the store (rank 0: the plane's store)."""
        if self._groups is not None:
            self._groups.keep(set())
        if self._slots is not None:
            self._slots.close()
        self._staging, self._groups, self._slots = [], None, None
        self.store = None  # rank 0: the plane's store stops with its last reference
