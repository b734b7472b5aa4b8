"""The `shm` weight-transfer backend: vLLM's `WeightTransferEngine` / `TrainerWeightTransferEngine`
over shared memory, for a learner on the same node as the engines (`gloo` stays the path across
nodes). Engines started with `shm` serve either: a learner joining with gloo's init info
(`GlooTrainerInitInfo`, NeMo RL's `init_collective`, a learner on another node) gets gloo's worker
engine for its rounds, so the learner, which knows where it runs, picks the transport.

Owns: `ShmWeightTransferEngine` (inside each vLLM worker) and `register`, which puts it and
`ShmTrainerWeightTransferEngine` (in the learner: `policies.shm_trainer`) in vLLM's factories under
"shm" (the `vllm.general_plugins` entry point in pyproject.toml, as `gloo`); the infos and the
stream's layout live in `policies.shm_wire`; all are importable from here.
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
A worker's init returns once its info is checked: joining the learner's socket and mapping the
ring run in a thread of the worker (`policies.transfer_join`), so the engine core generates while
the learner's side is not there; the round's drain waits for it, and a join that failed is
raised, naming the address and `timeout_s`, by the round's settle or finish.
Does not own: the two-phase guarantee and epochs (`rollout.weights.transfer`, `rollout.weights.updates`);
the learner's engine (`policies.shm_trainer`); the infos, layout and messages (`policies.shm_wire`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from policies.gloo_transfer import (
    DISCARD,
    JOINED,
    SETTLE,
    GlooInitInfo,
    GlooWeightTransferEngine,
    register_engines,
)
from policies.shm_trainer import ShmTrainerWeightTransferEngine  # noqa: F401 -- registered from here
from policies.shm_wire import (  # noqa: F401 -- re-exported: the backend's callers name them here
    ABORT,
    ALIGN,
    BACKEND,
    MSG,
    ShmInitInfo,
    ShmTrainerInitInfo,
    ShmUpdateInfo,
    layout,
    recv_msg,
    ring,
    spanning,
)
from policies.transfer_join import Join


def register() -> None:
    """Put the shm engines in vLLM's factories (idempotent: vLLM loads plugins in every process)."""
    register_engines(BACKEND, __name__, "ShmWeightTransferEngine", "ShmTrainerWeightTransferEngine")


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """Worker side: maps the learner's ring; each round a thread copies every chunk out of it into
    the staging buffer while the engine keeps serving; `finish_weight_update` (the engine's pause)
    waits for it and loads, inside vLLM's layerwise reload (so CPU kernels are repacked there).
    `init_transfer_engine` checks the info and returns; the join (socket, ring) runs in a
    `policies.transfer_join.Join` thread, and the round's drain waits for it.
    A learner that joins with gloo's init info is served by gloo's worker engine (`self.gloo`)."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    gloo_cls = GlooWeightTransferEngine

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.info: ShmInitInfo | None = None
        self.join: Join | None = None  # the join of the last init: (socket, ring) once joined
        self.staging = torch.empty(0, dtype=torch.uint8)
        self.pending: tuple[threading.Thread, list[Any], ShmUpdateInfo] | None = None  # the drain, its error, its round
        self.gloo: GlooWeightTransferEngine | None = None  # the learner joined with gloo's init info

    @property
    def sock(self) -> socket.socket | None:
        return joined[0] if self.join is not None and (joined := self.join.peek()) else None

    @property
    def ring(self) -> torch.Tensor | None:
        return joined[1] if self.join is not None and (joined := self.join.peek()) else None

    def _via_gloo(self) -> GlooWeightTransferEngine | None:
        if self.gloo is not None and self.gloo.join is not None:
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
        """Starts the join (the learner's socket, the ring) in a thread and returns: its waits are
        bounded by `timeout_s` (the engine caps it: `rollout.weights.transfer`). A failure leaves
        nothing joined and is raised, naming the address and `timeout_s`, by the round's settle or
        finish (`update_weights({"joined": true})` asks without waiting). A
        previous init's join, pending or joined, is closed first."""
        self.shutdown()
        if isinstance(init_info, GlooInitInfo):
            assert self.gloo is not None  # made by parse_init_info
            self.gloo.init_transfer_engine(init_info)
            return
        p, i = self.parallel_config, init_info
        rank = p.data_parallel_index * p.world_size + p.rank + i.rank_offset
        what = (f"shm transfer: worker rank {rank} could not join the learner at {i.address} "
                f"within timeout_s={i.timeout_s:g}")  # fmt: skip
        self.info = i
        self.join = Join(what, i.timeout_s, lambda join: _connect(i, rank, join), lambda got: got[0].close())

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
        if self.join is None or self.info is None:
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
            target=self._drain,
            args=(self.join, update_info.round, tensors, total, errors),
            daemon=True,
            name="shm-drain",
        )
        thread.start()
        self.pending = (thread, errors, update_info)

    def _drain(self, join: Join, round: int, tensors: list[Any], total: int, errors: list[Any]) -> None:
        """The round's chunks into the staging, once joined (the wait is this thread's, not the
        engine core's); errors, each a full message, go to `errors`."""
        assert self.info is not None
        try:
            sock, ring = join.wait()
        except RuntimeError as e:
            errors.append(str(e))
            return
        size, chunks = self.info.slot_bytes, -(-total // self.info.slot_bytes)
        chunk = 0
        try:
            for chunk in range(chunks):
                got_round, got = recv_msg(sock)
                if got == ABORT:
                    errors.append(
                        f"shm transfer: chunk {chunk + 1}/{chunks}: the learner ended the round (an error of its own)"
                    )
                    return
                if (got_round, got) != (round, chunk):
                    raise RuntimeError(
                        f"expected round {round} chunk {chunk}, the learner sent round {got_round} chunk {got}"
                    )
                lo, n, slot = chunk * size, min(size, total - chunk * size), (chunk % self.info.slots) * size
                self.staging[lo : lo + n].copy_(ring[slot : slot + n])
                sock.sendall(MSG.pack(round, chunk))
        except Exception as e:
            lo = chunk * size
            why = (
                f"the learner is gone ({type(e).__name__}: {e})"
                if isinstance(e, ConnectionError)
                else f"{type(e).__name__}: {e}"
            )
            errors.append(f"shm transfer: chunk {chunk + 1}/{chunks} ({spanning(tensors, lo, lo + size)}): {why}")
            join.close()  # the stream is out of step: this worker needs init_weight_transfer_engine again

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
            raise RuntimeError(f"{errors[0]}; the model is unchanged")
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
        elif update_info.get(JOINED):
            self.joined()
        elif update_info.get(SETTLE):
            self.settle()
        elif update_info.get(DISCARD):
            self.discard()
        else:
            self.receive_weights(self.parse_update_info(update_info))  # CPU: nothing to synchronize

    def joined(self) -> None:
        """Raises, without waiting, why the join failed (the round dropped: the learner inits
        again); returns while it runs or once it joined."""
        if self.join is not None and (why := self.join.failure()) is not None:
            self.shutdown()
            raise RuntimeError(f"{why}; the model is unchanged")

    def settle(self) -> None:
        """Waits for the drain (which waits for a join still running, within its init's deadline).
        A round whose join failed or whose bytes did not all arrive is dropped (the socket closed:
        the learner inits again) and raises naming the address or the chunk; the model is untouched."""
        if self.pending is not None:
            self.pending[0].join()
            if errors := self.pending[1]:
                self.pending = None
                raise RuntimeError(f"{errors[0]}; the model is unchanged")

    def discard(self) -> None:
        """Drops the round's staging unloaded; a drain still running closes the socket (the
        learner's stream is out of step: it inits again)."""
        if self.pending is not None and self.pending[0].is_alive():
            self.shutdown()
        self.pending = None

    def shutdown(self) -> None:
        """Closes the join (a pending one stops; its thread closes what it joins later) and the
        socket, which wakes a drain waiting on it; returns once the drain ended."""
        if self.gloo is not None:
            self.gloo.shutdown()
        if (sock := self.sock) is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a drain waiting on it
        if self.join is not None:
            self.join.close()  # a drain waiting for the join wakes too
        if self.pending is not None:
            self.pending[0].join()
        self.join = self.pending = self.info = None


def _connect(i: ShmInitInfo, rank: int, join: Join) -> tuple[socket.socket, torch.Tensor]:
    """Joins the learner's socket as worker `rank` and maps the ring it hands over."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    join.hold(sock)  # closed by a close of the join: a wait on it below wakes at once
    sock.settimeout(i.timeout_s)
    try:
        sock.connect("\0" + i.address)
        sock.sendall(MSG.pack(rank, 0))
        _, fds, _, _ = socket.recv_fds(sock, 1, 1)
        if not fds:
            raise ConnectionError("the learner closed the socket before handing over the ring")
        try:
            return sock, ring(fds[0], i.slots * i.slot_bytes)
        finally:
            os.close(fds[0])
    except BaseException:
        sock.close()
        raise


register()
