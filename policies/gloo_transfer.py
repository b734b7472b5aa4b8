"""The `gloo` weight-transfer backend: vLLM's `WeightTransferEngine` / `TrainerWeightTransferEngine`
on CPU, so CPU engines take the same path as vLLM's own `nccl` and `ipc` backends on GPUs.

Owns: `GlooWeightTransferEngine` (inside each vLLM worker), `GlooTrainerWeightTransferEngine` (in
the learner), their init and update infos, `StateDictSource` (a state dict as vLLM's
`WeightSource`, with a name map) and `register`, which puts both engines in vLLM's factories under
"gloo". `register` runs in every vLLM engine and worker process through the
`vllm.general_plugins` entry point (pyproject.toml), and on import of this module in the learner.
A round, as vLLM's NCCL backend does it, except where the bytes wait: 1) the trainer calls
`start_weight_update` (nothing changes in the model), then `update_weights` (names, dtypes,
shapes): each worker posts a receive per bucket into a staging buffer and the call returns, so a
round the engines refuse (bad metadata, an engine that cannot start) fails before any broadcast
and the engines keep generating while the bytes come; 2) buckets of `bucket_bytes`, cut from the
metadata alike on both sides, broadcast over a `ProcessGroupGloo` per worker (trainer + that
worker: the sends run side by side, and a failed worker breaks only its own pair), each tensor
broadcast on its own into its place in the worker's staging (no packing copy on either side),
two buckets on their way per pair; 3) `finish_weight_update`, inside the engine's
pause: each worker waits for its buckets and feeds them to `model.load_weights` inside vLLM's
layerwise reload, so the pause holds the load alone. Before it, the engine asks each worker to
settle (`update_weights({"settle": true})`: every bucket arrived, or the staging and the group
go, the model untouched); a round called off is dropped unloaded (`{"discard": true}`). Every
wait of a worker (connect, rendezvous, each receive) is bounded by its init's `timeout_s`.
Does not own: the two-phase guarantee and epochs (`rollout.weights.transfer`, `rollout.weights.updates`);
the buckets, store and pair groups on the wire (`policies.gloo_wire`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from policies.gloo_wire import (  # noqa: F401 -- re-exported: the backend's callers name them here
    broadcast,
    buckets,
    close_groups,
    offsets,
    pair_group,
    reachable,
    send,
    slices,
    tcp_store,
    wait_ready,
)

BACKEND = "gloo"
DEFAULT_BUCKET_BYTES = 64 << 20
# update infos that move no bytes (`rollout.weights.transfer` sends them through vLLM's update_weights,
# so vLLM ends its update session when they fail): wait for the staged bytes; drop them unloaded
SETTLE, DISCARD = "settle", "discard"


def register() -> None:
    """Put the gloo engines in vLLM's factories (idempotent: vLLM loads plugins in every process)."""
    register_engines(BACKEND, __name__, "GlooWeightTransferEngine", "GlooTrainerWeightTransferEngine")


def register_engines(backend: str, module: str, worker_cls: str, trainer_cls: str) -> None:
    """`backend`'s worker and trainer engines (classes of `module`) in vLLM's factories, once."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, cls in ((WeightTransferEngineFactory, worker_cls), (WeightTransferTrainerFactory, trainer_cls)):
        if backend not in factory._registry:  # vLLM's registries refuse a second registration
            factory.register_engine(backend, module, cls)


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    """Worker side: where the trainer's store is, and this worker's place in the group."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    session: str = "rollout"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 300.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One round: what the trainer sends, in order (vLLM's NCCL update info, plus the round)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    round: int = 0


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer side. `world_size`: 1 + every model worker of every engine (`client.world_size()`
    of rollout's client). `master_port` 0: a free port."""

    backend: ClassVar[str] = BACKEND

    world_size: int
    master_address: str = "127.0.0.1"
    master_port: int = 0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 300.0
    hand_off: bool = (
        False  # send_weights returns once every engine receives and the weights are copied (`send_weights`)
    )


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Worker side: joins the trainer's gloo group; stages each round's bytes while the engine keeps
    serving, and loads them only at `finish_weight_update` (the engine's pause), inside vLLM's
    layerwise reload (so CPU kernels are repacked there).

    `start_weight_update` changes nothing; `update_weights` posts a receive per bucket into a fresh
    staging buffer and returns at once (gloo's own threads receive: vLLM's engine core, blocked
    in this call otherwise, keeps stepping); `finish_weight_update` waits for them (a failure
    names the bucket and leaves the model untouched), then loads. Cost: a staging copy of the
    weights per worker from `update_weights` to the end of the load."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.info: GlooInitInfo | None = None
        self.store: Any = None
        self.pg: Any = None
        self.rank = 0
        self.staged: list[
            tuple[str, list[tuple[str, torch.dtype, list[int], int]], list[torch.Tensor], list[Any]]
        ] = []  # (what, bucket, its tensors' bytes, works)

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Joins the trainer's store and this worker's pair group, each wait within `timeout_s`
        (the engine caps it: `rollout.weights.transfer`). A failure leaves nothing joined."""
        self.shutdown()
        p, i = self.parallel_config, init_info
        self.rank = p.data_parallel_index * p.world_size + p.rank + i.rank_offset
        try:
            reachable(i.master_address, i.master_port, i.timeout_s)
            self.store = tcp_store(i.master_address, i.master_port, i.timeout_s)
            self.pg = pair_group(self.store, i.session, self.rank, i.timeout_s, trainer=False)
        except Exception as e:
            self.shutdown()
            raise RuntimeError(
                f"gloo transfer: worker rank {self.rank} could not join the learner's group at "
                f"{i.master_address}:{i.master_port} within timeout_s={i.timeout_s:g}: {type(e).__name__}: {e}"
            ) from e
        self.info = init_info

    def start_weight_update(self) -> None:
        self.staged = []  # the model is untouched until finish_weight_update

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.pg is None or self.info is None:
            raise RuntimeError("gloo weight transfer not initialized: call init_weight_transfer_engine first")
        cut = buckets(update_info.names, update_info.dtype_names, update_info.shapes, self.info.bucket_bytes)
        for k, bucket in enumerate(cut):
            buf = torch.empty(offsets(bucket)[1], dtype=torch.uint8)
            names = bucket[0][0] if len(bucket) == 1 else f"{bucket[0][0]} .. {bucket[-1][0]}"
            parts = slices(buf, bucket)
            self.staged.append(
                (f"bucket {k + 1}/{len(cut)} ({names})", bucket, parts, [broadcast(self.pg, part) for part in parts])
            )
        self.store.set(f"{self.info.session}/ready/{update_info.round}/{self.rank}", b"")

    def finish_weight_update(self) -> None:
        staged, self.staged = self.staged, []
        pairs: list[tuple[str, torch.Tensor]] = []
        for what, bucket, parts, works in staged:
            try:
                for work in works:
                    work.wait()
            except Exception as e:
                raise RuntimeError(f"gloo transfer: {what}: {type(e).__name__}: {e}; the model is unchanged") from e
            pairs += [(name, part.view(dtype).view(shape)) for (name, dtype, shape, _), part in zip(bucket, parts)]
        if pairs:
            self._reload(pairs)

    def _reload(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's layerwise reload of `pairs` (what its NCCL backend does across its calls)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self.model.load_weights(pairs)
        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if update_info.get(SETTLE):
            self.settle()
        elif update_info.get(DISCARD):
            self.discard()
        else:
            self.receive_weights(self.parse_update_info(update_info))  # CPU: nothing to synchronize

    def settle(self) -> None:
        """Waits for every staged bucket. One that did not arrive drops the staging and the group
        (the learner inits again) and raises naming it; the model is untouched either way."""
        for what, _, _, works in self.staged:
            try:
                for work in works:
                    work.wait()
            except Exception as e:
                self.shutdown()
                raise RuntimeError(f"gloo transfer: {what}: {type(e).__name__}: {e}; the model is unchanged") from e

    def discard(self) -> None:
        """Drops the round's staging unloaded. Receives still posted close the group: the learner's
        next round would meet them out of step, so it inits again."""
        if any(not work.is_completed() for *_, works in self.staged for work in works):
            self.shutdown()
        self.staged = []

    def shutdown(self) -> None:
        close_groups([self.pg] if self.pg is not None else [])
        self.pg = self.store = self.info = None
        self.staged = []


class StateDictSource(WeightSource):
    """A state dict as vLLM's `WeightSource`. `name_map(trainer name) -> HF name | None` (None
    leaves the tensor out): a sharded or renamed learner's hook. `update(weights)` swaps in the
    next step's tensors (same names, shapes and dtypes)."""

    def __init__(self, weights: Mapping[str, torch.Tensor], name_map: Callable[[str], str | None] | None = None):
        self.name_map = name_map
        self.update(weights)

    def update(self, weights: Mapping[str, torch.Tensor]) -> None:
        pairs = [(self.name_map(k) if self.name_map else k, v) for k, v in weights.items()]
        self.pairs = [(k, v) for k, v in pairs if k is not None]

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(k, v.dtype, tuple(v.shape)) for k, v in self.pairs]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from vllm.distributed.weight_transfer.base import materialize_full_tensor

        for k, v in self.pairs:
            yield k, materialize_full_tensor(v)


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side: hosts the rendezvous store, is rank 0 of the group, drives the round through
    any `VLLMWeightSyncClient` (rollout's, vLLM's Ray or HTTP one). Non-sender ranks of a sharded
    learner only iterate the source (its gathers are collectives), as with vLLM's NCCL backend.
    With `hand_off` the learner does not wait for the bytes to go out (`send_weights`)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(
        self,
        *,
        client: Any,
        source: WeightSource | None = None,
        is_sender: bool = True,
        info: GlooTrainerInitInfo | None = None,
    ):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.store: Any = None
        self.pgs: list[Any] = []  # one pair group per worker rank
        self.session = f"rollout-gloo-{uuid.uuid4().hex[:8]}"
        self.round = 0
        self._sending: Future[None] | None = None  # a handed-off round's send and finish_weight_update
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gloo-send")

    @classmethod
    def trainer_init(
        cls, init_info: GlooTrainerInitInfo, *, client: Any, source: WeightSource | None = None
    ) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("gloo trainer weight transfer requires a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if not engine.is_sender:
            return engine
        i = init_info
        store = tcp_store(i.master_address, i.master_port, i.timeout_s, master=True)
        worker = GlooInitInfo(master_address=i.master_address, master_port=store.port, rank_offset=1,
                              world_size=i.world_size, session=engine.session, bucket_bytes=i.bucket_bytes,
                              timeout_s=i.timeout_s)  # fmt: skip
        exe = ThreadPoolExecutor(max_workers=1)
        try:  # the workers wait inside init for the group's rendezvous, and so does rank 0
            joined = exe.submit(
                lambda: [
                    pair_group(store, engine.session, r, i.timeout_s, trainer=True) for r in range(1, i.world_size)
                ]
            )
            client.init_weight_transfer_engine(asdict(worker))
            engine.pgs = joined.result()
        finally:
            exe.shutdown(wait=False)
        engine.store = store
        return engine

    def send_weights(self) -> None:
        """start, update (metadata checked, every worker receiving), the bytes, finish. `hand_off`:
        returns after update with the tensors copied (kept until sent); a thread of this engine
        sends and finishes, and the next call (or `settle`) waits for it, raising its error once."""
        assert self.source is not None and self.info is not None
        self.settle()
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:  # stay in the learner's own collectives (FSDP gathers)
                pass
            return
        self.round += 1
        info = GlooUpdateInfo(
            [m.name for m in meta],
            [str(m.dtype).removeprefix("torch.") for m in meta],
            [list(m.shape) for m in meta],
            self.round,
        )
        self.client.start_weight_update()
        self.client.update_weights(
            asdict(info)
        )  # checked, and every worker's receives posted (the engines keep serving)
        if not self.info.hand_off:
            self._send(iter(self.source), info)
            return
        copied = [
            (name, t.detach().to("cpu", copy=True)) for name, t in self.source
        ]  # gathers run here, on the learner's thread
        self._sending = self._sender.submit(self._send, iter(copied), info)

    def _send(self, pairs: Iterator[tuple[str, torch.Tensor]], info: GlooUpdateInfo) -> None:
        send(self.pgs, pairs, info, self.info.bucket_bytes)  # type: ignore[union-attr]
        self.client.finish_weight_update()  # the engines pause for the load alone

    def settle(self) -> None:
        """Wait for a handed-off round's bytes and finish_weight_update; raises its error, once."""
        sending, self._sending = self._sending, None
        if sending is not None:
            sending.result()

    def shutdown(self) -> None:
        try:
            self.settle()
        finally:
            self._sender.shutdown(wait=False)
            close_groups(self.pgs)
            self.pgs, self.store = [], None


class GlooCollective:
    """One rank of a NeMo RL-style trainer on the gloo group: no client; the rollout side drives the
    engines (`RolloutGeneration.init_collective` / `update_weights_from_collective`) while rank 0
    `broadcast`s, in the order given to `prepare_refit_info`. Ranks 0..train_world_size-1 are
    the trainer's, the engines' workers follow; rank 0 hosts the store at (`ip`, `port`)."""

    def __init__(self, ip: str, port: int, world_size: int, *, rank: int, train_world_size: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 300.0,
                 session: str = "rollout"):  # fmt: skip
        self.rank, self.workers_from, self.world_size, self.session = rank, train_world_size, world_size, session
        self.bucket_bytes, self.timeout_s, self.round = bucket_bytes, timeout_s, 0
        self.store = tcp_store(ip, port, timeout_s, master=rank == 0)
        self.pgs = (
            [pair_group(self.store, session, r, timeout_s, trainer=True) for r in range(train_world_size, world_size)]
            if rank == 0
            else []
        )

    def broadcast(self, weights: Mapping[str, torch.Tensor]) -> None:
        """This round's tensors (HF name -> tensor) to every engine; ranks other than 0 return."""
        self.round += 1
        if self.rank:
            return
        info = GlooUpdateInfo(list(weights), [str(t.dtype).removeprefix("torch.") for t in weights.values()],
                              [list(t.shape) for t in weights.values()], self.round)  # fmt: skip
        wait_ready(self.store, self.session, self.round, range(self.workers_from, self.world_size), self.timeout_s)
        send(self.pgs, iter(weights.items()), info, self.bucket_bytes)

    def shutdown(self) -> None:
        close_groups(self.pgs)
        self.pgs, self.store = [], None


register()
