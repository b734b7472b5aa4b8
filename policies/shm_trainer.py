"""The learner's side of the `shm` weight-transfer backend (`policies.shm_transfer` registers it):
the ring in one anonymous shared-memory file, the socket every worker joins at
`init_weight_transfer_engine`, and each round's bytes through the ring (`policies.shm_transfer`
describes the protocol).

Owns: `ShmTrainerWeightTransferEngine`. Does not own: the workers' side (`policies.shm_transfer`),
the infos and the stream's layout (`policies.shm_wire`).
"""

from __future__ import annotations

import os
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine, WeightSource

from policies.shm_wire import ABORT, MSG, ShmInitInfo, ShmTrainerInitInfo, ShmUpdateInfo, layout, recv_msg, ring


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
            engine.ring = ring(fd, i.slots * i.slot_bytes)
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
            rank, _ = recv_msg(conn)
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
            if (got := recv_msg(sock)) != (self.round, chunk):
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
