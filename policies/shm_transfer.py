"""The `shm` weight-transfer backend: vLLM's `WeightTransferEngine` / `TrainerWeightTransferEngine`
over shared memory, for a learner on the same node as the engines (`gloo` stays the path across
nodes). Engines started with `shm` serve either: a learner joining with gloo's init info
(`GlooTrainerInitInfo`, NeMo RL's `init_collective`, a learner on another node) gets gloo's worker
engine for its rounds, so the learner, which knows where it runs, picks the transport.

Owns: `ShmWeightTransferEngine` (inside each vLLM worker), `ShmTrainerWeightTransferEngine` (in
the learner), their init and update infos, the ring's layout (`layout`), and `register`, which
puts both engines in vLLM's factories under "shm" (the `vllm.general_plugins` entry point in
pyproject.toml, as `gloo`).
The bytes: the round's tensors, in metadata order, are one byte stream (each tensor at an offset
aligned to `ALIGN`), cut into chunks of `slot_bytes`. The learner owns a ring of `slots` slots of
`slot_bytes` in one anonymous shared-memory file (`memfd_create`: no name in /dev/shm, so nothing
to leak: its memory goes with the last process that maps it, whatever kills them), handed to
every worker over a Unix socket (`SCM_RIGHTS`) at `init_weight_transfer_engine`. Footprint:
`slots x slot_bytes`, whatever the model size. Per chunk the learner copies the tensors' bytes
into a free slot and tells every worker (16 bytes over its socket); each worker copies the slot
into its staging buffer and acks; a slot is refilled once every worker acked it, so the learner
fills the next slot while the workers drain this one. The socket is also the liveness check: a
learner gone mid-transfer closes it (the worker's round fails at once, naming the chunk and its
tensors, the model untouched), a worker gone is dropped by the learner (its engine's own call
fails), and no message within `timeout_s` fails the round.
A round, as `gloo` (the engines keep generating while the bytes come; the pause holds the load
alone): `start_weight_update` changes nothing; `update_weights` (names, dtypes, shapes, checked by
`rollout.weights.transfer` before any worker is called) starts each worker's drain thread and returns;
`finish_weight_update`, inside the engine's pause, waits for it and loads the staging into the
model inside vLLM's layerwise reload. The staging buffer is kept between rounds (a copy of the
weights per worker): into touched pages a copy runs several times faster than into fresh ones.
Does not own: the two-phase guarantee and epochs (`rollout.weights.transfer`, `rollout.weights.updates`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import struct
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
)

from policies.gloo_transfer import (
    DISCARD,
    SETTLE,
    GlooInitInfo,
    GlooUpdateInfo,
    GlooWeightTransferEngine,
    register_engines,
)

BACKEND = "shm"
ALIGN = 64  # each tensor's offset in the stream: any dtype's view, on a cache line
MSG = struct.Struct("<qq")  # (round, chunk): learner -> worker "chunk in its slot", worker -> learner "drained"
ABORT = -1  # chunk of a round the learner gave up (its source disagreed with its metadata)


def register() -> None:
    """Put the shm engines in vLLM's factories (idempotent: vLLM loads plugins in every process)."""
    register_engines(BACKEND, __name__, "ShmWeightTransferEngine", "ShmTrainerWeightTransferEngine")


@dataclass(kw_only=True)
class ShmInitInfo(WeightTransferInitInfo):
    """Worker side: the learner's socket (an abstract Unix address), this worker's place, the ring."""

    address: str
    rank_offset: int
    world_size: int
    slots: int
    slot_bytes: int
    timeout_s: float = 300.0


ShmUpdateInfo = GlooUpdateInfo  # one round: what the trainer sends, in order (the same metadata as gloo's)


@dataclass
class ShmTrainerInitInfo(TrainerInitInfo):
    """Trainer side. `world_size`: 1 + every model worker of every engine (`client.world_size()`
    of rollout's client). The ring holds `slots` x `slot_bytes` of shared memory."""

    backend: ClassVar[str] = BACKEND

    world_size: int
    slots: int = 4
    slot_bytes: int = 32 << 20
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.slots < 2 or self.slot_bytes < ALIGN:
            raise ValueError(
                f"shm transfer: slots {self.slots} (at least 2, to fill one while another drains), "
                f"slot_bytes {self.slot_bytes} (at least {ALIGN})"
            )


def layout(info: ShmUpdateInfo) -> tuple[list[tuple[str, torch.dtype, list[int], int, int]], int]:
    """The round's tensors in the stream: (name, dtype, shape, offset, bytes) each, and its length.
    Both sides compute it alike from the same metadata."""
    out, at = [], 0
    for name, dtype_name, shape in zip(info.names, info.dtype_names, info.shapes):
        dtype = getattr(torch, dtype_name)
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        at = -(-at // ALIGN) * ALIGN
        out.append((name, dtype, list(shape), at, nbytes))
        at += nbytes
    return out, at


def _spanning(tensors: list[tuple[str, Any, Any, int, int]], lo: int, hi: int) -> str:
    names = [t[0] for t in tensors if t[3] < hi and t[3] + t[4] > lo]
    return ", ".join(names) if len(names) <= 2 else f"{names[0]} .. {names[-1]}"


def _recv(sock: socket.socket) -> tuple[int, int]:
    data = b""
    while len(data) < MSG.size:
        got = sock.recv(MSG.size - len(data))
        if not got:
            raise ConnectionError("connection closed by the peer")
        data += got
    return MSG.unpack(data)


def _ring(fd: int, nbytes: int) -> torch.Tensor:
    """The shared file mapped here, as bytes (the mapping outlives the fd, closed by the caller)."""
    return torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """Worker side: maps the learner's ring; each round a thread copies every chunk out of it into
    the staging buffer while the engine keeps serving; `finish_weight_update` (the engine's pause)
    waits for it and loads, inside vLLM's layerwise reload (so CPU kernels are repacked there).
    A learner that joins with gloo's init info is served by gloo's worker engine (`self.gloo`)."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    gloo_cls = GlooWeightTransferEngine

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.info: ShmInitInfo | None = None
        self.sock: socket.socket | None = None
        self.ring: torch.Tensor | None = None
        self.staging = torch.empty(0, dtype=torch.uint8)
        self.pending: tuple[threading.Thread, list[Any], ShmUpdateInfo] | None = None  # the drain, its error, its round
        self.gloo: GlooWeightTransferEngine | None = None  # the learner joined with gloo's init info

    def _via_gloo(self) -> GlooWeightTransferEngine | None:
        if self.gloo is not None and self.gloo.pg is not None:
            self.gloo.model, self.gloo.model_config = self.model, self.model_config  # vLLM's current target
            return self.gloo
        return None

    def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
        if "master_address" not in init_dict:
            return super().parse_init_info(init_dict)
        if self.gloo is None:
            self.gloo = self.gloo_cls(self.config, self.vllm_config, self.device, self._default_model)
        return self.gloo.parse_init_info(init_dict)

    def init_transfer_engine(self, init_info: ShmInitInfo | GlooInitInfo) -> None:
        self.shutdown()
        if isinstance(init_info, GlooInitInfo):
            assert self.gloo is not None  # made by parse_init_info
            self.gloo.init_transfer_engine(init_info)
            return
        p = self.parallel_config
        rank = p.data_parallel_index * p.world_size + p.rank + init_info.rank_offset
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(init_info.timeout_s)
        try:
            sock.connect("\0" + init_info.address)
            sock.sendall(MSG.pack(rank, 0))
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            if not fds:
                raise ConnectionError("the learner closed the socket before handing over the ring")
            try:
                self.ring = _ring(fds[0], init_info.slots * init_info.slot_bytes)
            finally:
                os.close(fds[0])
        except Exception as e:
            sock.close()
            raise RuntimeError(
                f"shm transfer: worker rank {rank} could not join the learner at {init_info.address} "
                f"within timeout_s={init_info.timeout_s:g}: {type(e).__name__}: {e}"
            ) from e
        self.sock, self.info = sock, init_info

    def start_weight_update(self) -> None:
        if gloo := self._via_gloo():
            gloo.start_weight_update()  # the model is untouched until finish_weight_update
        elif self.pending is not None:
            # a round ended without finish_weight_update (its send failed): the learner starts the
            # next only after its own end of that one, so the receiver is ending too; nothing of it is loaded
            self.pending[0].join(self.info.timeout_s if self.info is not None else None)
            if self.pending[0].is_alive():
                raise RuntimeError("shm transfer: start_weight_update while the last round's bytes are still coming")
            self.pending = None

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        if self.sock is None or self.info is None:
            raise RuntimeError("shm weight transfer not initialized: call init_weight_transfer_engine first")
        if self.pending is not None:
            raise RuntimeError(
                "shm transfer: update_weights called twice in one round (or without start_weight_update)"
            )
        tensors, total = layout(update_info)
        if self.staging.numel() != total:
            self.staging = torch.empty(total, dtype=torch.uint8)
        errors: list[Any] = []
        thread = threading.Thread(
            target=self._drain, args=(update_info.round, tensors, total, errors), daemon=True, name="shm-drain"
        )
        thread.start()
        self.pending = (thread, errors, update_info)

    def _drain(self, round: int, tensors: list[Any], total: int, errors: list[Any]) -> None:
        assert self.sock is not None and self.ring is not None and self.info is not None
        size, chunks = self.info.slot_bytes, -(-total // self.info.slot_bytes)
        chunk = 0
        try:
            for chunk in range(chunks):
                got_round, got = _recv(self.sock)
                if got == ABORT:
                    errors.append(f"chunk {chunk + 1}/{chunks}: the learner ended the round (an error of its own)")
                    return
                if (got_round, got) != (round, chunk):
                    raise RuntimeError(
                        f"expected round {round} chunk {chunk}, the learner sent round {got_round} chunk {got}"
                    )
                lo, n, slot = chunk * size, min(size, total - chunk * size), (chunk % self.info.slots) * size
                self.staging[lo : lo + n].copy_(self.ring[slot : slot + n])
                self.sock.sendall(MSG.pack(round, chunk))
        except Exception as e:
            lo = chunk * size
            why = (
                f"the learner is gone ({type(e).__name__}: {e})"
                if isinstance(e, ConnectionError)
                else f"{type(e).__name__}: {e}"
            )
            errors.append(f"chunk {chunk + 1}/{chunks} ({_spanning(tensors, lo, lo + size)}): {why}")
            self._close()  # the stream is out of step: this worker needs init_weight_transfer_engine again

    def finish_weight_update(self) -> None:
        if gloo := self._via_gloo():
            gloo.finish_weight_update()
            return
        pending, self.pending = self.pending, None
        if pending is None:
            return
        thread, errors, info = pending
        thread.join()
        if errors:
            raise RuntimeError(f"shm transfer: {errors[0]}; the model is unchanged")
        tensors, _ = layout(info)
        self._reload(
            [(name, self.staging[at : at + n].view(dtype).view(shape)) for name, dtype, shape, at, n in tensors]
        )

    def _reload(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's layerwise reload of `pairs` (what its NCCL backend does across its calls)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self.model.load_weights(pairs)
        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if gloo := self._via_gloo():
            gloo.update_weights(update_info)
        elif update_info.get(SETTLE):
            self.settle()
        elif update_info.get(DISCARD):
            self.discard()
        else:
            self.receive_weights(self.parse_update_info(update_info))  # CPU: nothing to synchronize

    def settle(self) -> None:
        """Waits for the drain. A round whose bytes did not all arrive is dropped (its socket already
        closed: the learner inits again) and raises naming the chunk; the model is untouched."""
        if self.pending is not None:
            self.pending[0].join()
            if errors := self.pending[1]:
                self.pending = None
                raise RuntimeError(f"shm transfer: {errors[0]}; the model is unchanged")

    def discard(self) -> None:
        """Drops the round's staging unloaded; a drain still running closes the socket (the
        learner's stream is out of step: it inits again)."""
        if self.pending is not None and self.pending[0].is_alive():
            self.shutdown()
        self.pending = None

    def _close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = self.ring = None

    def shutdown(self) -> None:
        if self.gloo is not None:
            self.gloo.shutdown()
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes a drain waiting on it
        if self.pending is not None:
            self.pending[0].join()
        self._close()
        self.pending, self.info = None, None


class ShmTrainerWeightTransferEngine(TrainerWeightTransferEngine[ShmTrainerInitInfo]):
    """Trainer side: owns the ring and the socket every worker joins, drives the round through any
    `VLLMWeightSyncClient` (rollout's, vLLM's Ray or HTTP one). Non-sender ranks of a sharded
    learner only iterate the source (its gathers are collectives), as with vLLM's NCCL backend."""

    init_info_cls = ShmTrainerInitInfo

    def __init__(
        self,
        *,
        client: Any,
        source: WeightSource | None = None,
        is_sender: bool = True,
        info: ShmTrainerInitInfo | None = None,
    ):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.ring: torch.Tensor | None = None
        self.workers: dict[int, socket.socket] = {}  # worker rank -> its socket
        self.round = 0

    @classmethod
    def trainer_init(
        cls, init_info: ShmTrainerInitInfo, *, client: Any, source: WeightSource | None = None
    ) -> ShmTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("shm trainer weight transfer requires a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if not engine.is_sender:
            return engine
        i, address = init_info, f"rollout-shm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fd = os.memfd_create(address, os.MFD_CLOEXEC)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            os.ftruncate(fd, i.slots * i.slot_bytes)
            engine.ring = _ring(fd, i.slots * i.slot_bytes)
            listener.bind("\0" + address)
            listener.listen(i.world_size)
            listener.settimeout(i.timeout_s)
            joined = exe.submit(engine._accept, listener, fd, i.world_size - 1)
            client.init_weight_transfer_engine(asdict(ShmInitInfo(
                address=address, rank_offset=1, world_size=i.world_size, slots=i.slots, slot_bytes=i.slot_bytes,
                timeout_s=i.timeout_s,
            )))  # fmt: skip
            joined.result()
        except BaseException:
            engine.shutdown()
            raise
        finally:
            exe.shutdown(wait=False)
            listener.close()  # a worker joins only at init: the listener, and its name, go now
            os.close(fd)
        return engine

    def _accept(self, listener: socket.socket, fd: int, count: int) -> None:
        while len(self.workers) < count:
            conn, _ = listener.accept()
            conn.settimeout(self.info.timeout_s if self.info else None)
            rank, _ = _recv(conn)
            socket.send_fds(conn, [b"r"], [fd])
            self.workers[rank] = conn

    def send_weights(self) -> None:
        assert self.source is not None and self.info is not None
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:  # stay in the learner's own collectives (FSDP gathers)
                pass
            return
        self.round += 1
        info = ShmUpdateInfo(
            [m.name for m in meta],
            [str(m.dtype).removeprefix("torch.") for m in meta],
            [list(m.shape) for m in meta],
            self.round,
        )
        self.client.start_weight_update()
        self.client.update_weights(asdict(info))  # checked, and every worker draining (the engines keep serving)
        self._send(info)
        self.client.finish_weight_update()  # the engines pause for the load alone

    def _send(self, info: ShmUpdateInfo) -> None:
        """The round's bytes through the ring (module docstring). A worker whose socket fails is
        dropped (its engine's own call fails and leaves rotation); raises when none is left."""
        assert self.source is not None and self.info is not None and self.ring is not None
        tensors, total = layout(info)
        size, slots, ring, errors = self.info.slot_bytes, self.info.slots, self.ring, []
        chunks = -(-total // size)

        def each(fn: Any) -> None:
            for rank, sock in list(self.workers.items()):
                try:
                    fn(sock)
                except Exception as e:
                    sock.close()
                    del self.workers[rank]
                    errors.append(f"worker rank {rank}: {type(e).__name__}: {e}")
            if not self.workers:
                raise RuntimeError(f"shm transfer: no worker left: {errors[0] if errors else 'none joined'}")

        def drained(sock: socket.socket, chunk: int) -> None:
            if (got := _recv(sock)) != (self.round, chunk):
                raise RuntimeError(f"acked {got}, expected {(self.round, chunk)}")

        acked = 0  # chunks every worker acked (a slot is free once its last chunk is acked)

        def ack_until(end: int) -> None:
            nonlocal acked
            for c in range(acked, end):
                each(lambda sock, c=c: drained(sock, c))
            acked = max(acked, end)

        pairs = iter(self.source)
        chunk = 0  # the chunk being filled
        try:
            for name, dtype, shape, at, nbytes in tensors:
                got, t = next(pairs)
                if got != name or t.dtype != dtype or list(t.shape) != shape:
                    raise ValueError(
                        f"WeightSource yielded {got!r} {t.dtype} {list(t.shape)}, "
                        f"metadata() declared {name!r} {dtype} {shape}"
                    )
                flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                done = 0
                while done < nbytes:
                    pos = at + done
                    if pos >= (chunk + 1) * size:  # this chunk is full: out to the workers, on to the next slot
                        each(lambda sock: sock.sendall(MSG.pack(self.round, chunk)))
                        chunk += 1
                        ack_until(chunk + 1 - slots)
                        continue
                    n = min(nbytes - done, (chunk + 1) * size - pos)
                    slot = (chunk % slots) * size + pos - chunk * size
                    ring[slot : slot + n].copy_(flat[done : done + n])
                    done += n
        except Exception:
            if self.workers:  # end the workers' rounds now (not at their timeout), their sockets in step
                ack_until(chunk)
                each(lambda sock: sock.sendall(MSG.pack(self.round, ABORT)))
            raise
        for c in range(chunk, chunks):
            each(lambda sock, c=c: sock.sendall(MSG.pack(self.round, c)))
        ack_until(chunks)  # every worker has every chunk

    def shutdown(self) -> None:
        for sock in self.workers.values():
            sock.close()
        self.workers, self.ring = {}, None


register()
