"""An engine model worker's end of the weight plane: join a round, then stream its tensors.

Owns: `PlaneReceiver`, which a vLLM worker extension (`policies.vllm_adapter.worker`) holds, and
tests drive directly. Phase 1 (`stage`): read the round's ticket from the store and join its data
path (process groups with every learner rank, or the learners' shared slots) in a thread of its
own, so the engine keeps generating meanwhile; report `joined` (or why not) in the store. Phase 2
(`stream`, called inside the engine's pause): say `ready`, then for every bucket in plan order
take its header (a learner that aborts says so there), its bytes, copy them into whole tensors
and yield each tensor as its last byte arrives; vLLM's layerwise reload loads it from there.
Every failure names the engine and the bucket with its tensors.
Does not own: the plan (`policies.transfer`), moving bytes (`policies.transports`), loading into
vLLM (`reload_weights`, in the worker extension).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import msgspec

from policies.transfer import ABORT, GROUP_BACKENDS, Assembler, Header, Keys, PlaneStage, Ticket
from policies.transports import Groups, connect, open_slots, sweep_orphan_slots, wait_key


class TransferError(RuntimeError):
    """A transfer failed on this worker; the message names the engine and the bucket."""


class PlaneReceiver:
    """One model worker's plane state: its store client, groups or slot views, staged rounds.

    `worker`: this worker's rank within its engine; `workers`: the engine's model workers;
    `device`: where received tensors go (the worker's device).
    """

    def __init__(self, worker: int = 0, workers: int = 1, device: Any = "cpu"):
        self.worker, self.workers, self.device = worker, workers, device
        self._store: Any = None
        self._address: tuple[str, int, str] | None = None
        self._groups: Groups | None = None
        self._slots: dict[int, tuple[list[Any], list[Any]]] = {}  # learner rank -> (handles, views)
        self._staged: dict[int, tuple[PlaneStage, threading.Thread, list[Any]]] = {}  # round -> (stage, join, [ticket | error])

    def stage(self, stage: PlaneStage) -> None:
        """Phase 1: join round `stage.round` in a thread; its outcome goes to the store (`joined`)."""
        box: list[Any] = []
        thread = threading.Thread(target=self._join, args=(stage, box), name=f"rollout-plane-join-{stage.round}", daemon=True)
        self._staged[stage.round] = (stage, thread, box)
        thread.start()

    def drop(self, round: int) -> None:
        """Forget a staged round that will not be loaded (phase 1 failed elsewhere)."""
        if (staged := self._staged.pop(round, None)) is not None:
            staged[1].join(staged[0].timeout_s)

    def _join(self, stage: PlaneStage, box: list[Any]) -> None:
        keys, me = Keys(stage.session), f"{stage.engine}.{self.worker}"
        try:
            store = self._connect(stage)
            ticket = msgspec.msgpack.decode(wait_key(store, keys.ticket(stage.round), stage.timeout_s, "ticket"), type=Ticket)
            entry = next((e for e in ticket.engines if e.engine == stage.engine), None)
            if entry is None or ticket.plan is None:
                raise TransferError(f"engine {stage.engine} is not part of round {stage.round}")
            if entry.workers != self.workers:
                raise TransferError(f"engine {stage.engine} has {self.workers} model workers, the ticket says {entry.workers}")
            if ticket.backend in GROUP_BACKENDS:
                self._join_groups(ticket, entry.group, stage.engine, store)
            else:
                for src, handles in ticket.slots.items():
                    if src not in self._slots or self._slots[src][0] != handles:
                        self._slots[src] = (handles, open_slots(ticket.backend, handles, self.device))
            box.append(ticket)
            store.set(keys.joined(stage.round, me), b"")
        except BaseException as e:
            box.append(e)
            if self._store is not None:
                try:
                    self._store.set(keys.joined(stage.round, me), f"engine {stage.engine}: {type(e).__name__}: {e}".encode())
                except Exception:  # the store is gone: the driver times out on this engine
                    pass

    def _connect(self, stage: PlaneStage) -> Any:
        address = (stage.host, stage.port, stage.session)
        if self._address != address:
            self.close()
            self._store, self._address = connect(stage.host, stage.port, stage.timeout_s), address
        return self._store

    def _join_groups(self, ticket: Ticket, group: str, engine: int, store: Any) -> None:
        members = [e for e in ticket.engines if e.group == group]
        world = 1 + sum(e.workers for e in members)
        rank = 1 + sum(e.workers for e in members[: [e.engine for e in members].index(engine)]) + self.worker
        if self._groups is None or self._groups.store is not store:
            self._groups = Groups(ticket.backend, store, ticket.timeout_s, self.device)
        wanted = {f"{group}/{src}" for src in range(ticket.ranks)}
        self._groups.keep(wanted)  # an old group (a restart, a failed transfer) is left first
        for key in sorted(wanted):
            self._groups.get(key, rank, world)

    def stream(self, round: int) -> Iterator[tuple[str, Any]]:
        """Phase 2: every tensor of round `round` as (HF name, tensor), each once its bytes are in.
        Raises TransferError naming the engine and the bucket (its tensors) that failed."""
        import torch

        stage, thread, box = self._staged.pop(round)
        thread.join(stage.timeout_s)
        if not box or isinstance(box[0], BaseException):
            cause = box[0] if box else TimeoutError("joining took longer than the plane's timeout")
            raise TransferError(f"engine {stage.engine} did not join round {round}: {cause}") from (cause if box else None)
        ticket: Ticket = box[0]
        plan, keys, store = ticket.plan, Keys(stage.session), self._store
        assert plan is not None
        assembler = Assembler(plan, self.device)
        group = next(e.group for e in ticket.engines if e.engine == stage.engine)
        buf = self._groups.staging(max((b.nbytes for b in plan.buckets), default=0)) if ticket.backend in GROUP_BACKENDS else None
        watch = [keys.dropped(round, stage.engine), *(keys.lfail(round, r) for r in range(ticket.ranks))]

        def called_off() -> str | None:  # the learner dropped this engine or gave up, or the driver ended the round
            for key in watch:
                if store.check([key]):
                    return store.get(key).decode()
            return f"round {round} ended before this engine had every bucket" if store.check([keys.done(round)]) else None

        store.set(keys.ready(round, stage.engine, self.worker), b"")
        for b, bucket in enumerate(plan.buckets):
            try:
                what = f"header of {plan.describe(b)}"
                # Twice the learner's own wait on a peer: a learner giving up on a hung engine first is late, not gone.
                header = msgspec.msgpack.decode(wait_key(store, keys.hdr(round, b), 2 * ticket.timeout_s, what, called_off), type=Header)
                if header.status == ABORT:
                    raise TransferError(f"the learner aborted the transfer: {header.reason}")
                if header.nbytes != bucket.nbytes:
                    raise TransferError(f"the learner sends {header.nbytes} bytes, the plan says {bucket.nbytes}")
                if buf is not None:
                    assert self._groups is not None
                    data = buf[: bucket.nbytes]
                    self._groups.broadcast(self._groups.groups[f"{group}/{bucket.src}"], data).wait()
                else:
                    data = self._slots[bucket.src][1][header.slot][: bucket.nbytes]
                done = assembler.add(b, data)
                if buf is None and data.is_cuda:  # cuda_ipc: the copies out of the slot are only queued;
                    # they must be done before the ack lets the learner write the slot again
                    torch.cuda.current_stream(data.device).synchronize()
                if reason := called_off():  # checked after the copy: a slot is reused only after the drop is set
                    raise TransferError(reason)
                if buf is None and store.add(keys.ackc(round, b, stage.engine), 1) == self.workers:
                    store.set(keys.ack(round, b, stage.engine), b"")  # the engine's last worker frees the slot
            except Exception as e:
                if self._groups is not None and buf is not None:
                    self._groups.drop(f"{group}/{bucket.src}")  # broken: the next round joins a new one
                if ticket.backend == "shm":
                    sweep_orphan_slots()  # a learner killed mid-round leaves its slots behind
                raise TransferError(f"engine {stage.engine}: {plan.describe(b)}: {type(e).__name__}: {e}") from e
            yield from done
        if missing := assembler.missing():
            raise TransferError(f"engine {stage.engine}: the plan left {missing[:4]} incomplete")

    def close(self) -> None:
        """Leave every group, let go of every slot and the store."""
        if self._groups is not None:
            self._groups.keep(set())
        self._groups, self._slots, self._store, self._address = None, {}, None, None
