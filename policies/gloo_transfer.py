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
wait of a worker (connect, rendezvous, each receive) is bounded by its init's `timeout_s`. A
worker's init returns once its info is checked: the rendezvous runs in a thread of the worker
(`policies.transfer_join`), so the engine core generates while the learner's side is not there,
and the round's first call that needs the group waits for it or raises why it failed.
Does not own: the two-phase guarantee and epochs (`rollout.weights.transfer`, `rollout.weights.updates`);
the infos, buckets, store and pair groups on the wire, `GlooCollective` (`policies.gloo_wire`).
"""

from __future__ import annotations

import threading
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
)

from policies.gloo_wire import (  # noqa: F401 -- re-exported: the backend's callers name them here
    DEFAULT_BUCKET_BYTES,
    DISCARD,
    JOINED,
    SETTLE,
    GlooCollective,
    GlooInitInfo,
    GlooUpdateInfo,
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
from policies.transfer_join import Join

BACKEND = "gloo"


def register() -> None:
    """Put the gloo engines in vLLM's factories (idempotent: vLLM loads plugins in every process)."""
    register_engines(BACKEND, __name__, "GlooWeightTransferEngine", "GlooTrainerWeightTransferEngine")


def register_engines(backend: str, module: str, worker_cls: str, trainer_cls: str) -> None:
    """`backend`'s worker and trainer engines (classes of `module`) in vLLM's factories, once."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, cls in ((WeightTransferEngineFactory, worker_cls), (WeightTransferTrainerFactory, trainer_cls)):
        if backend not in factory._registry:  # vLLM's registries refuse a second registration
            factory.register_engine(backend, module, cls)


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

    `init_transfer_engine` checks the info and returns: the rendezvous (the trainer's store, this
    worker's pair group) runs in a `policies.transfer_join.Join` thread, so vLLM's engine core,
    blocked in the call otherwise, keeps generating while the learner's side is not there.
    `start_weight_update` changes nothing; `update_weights` posts a receive per bucket into a fresh
    staging buffer and returns at once (gloo's own threads receive; a rendezvous still running
    posts them when it completes, from its own thread); `finish_weight_update` waits for them (a
    failure, a rendezvous that failed included, names the bucket or the address and leaves the
    model untouched), then loads. Cost: a staging copy of the weights per worker from
    `update_weights` to the end of the load."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.info: GlooInitInfo | None = None
        self.join: Join | None = None  # the rendezvous of the last init: (store, pair group) once joined
        self.rank = 0
        self.staged: list[
            tuple[str, list[tuple[str, torch.dtype, list[int], int]], list[torch.Tensor], list[Any]]
        ] = []  # (what, bucket, its tensors' bytes, works)
        self.posting: threading.Thread | None = None  # posts the round's receives once the rendezvous completes
        self.post_error: str | None = None

    @property
    def store(self) -> Any:
        return joined[0] if self.join is not None and (joined := self.join.peek()) else None

    @property
    def pg(self) -> Any:
        return joined[1] if self.join is not None and (joined := self.join.peek()) else None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Starts the rendezvous (the trainer's store, this worker's pair group) in a thread and
        returns: each of its waits within `timeout_s` (the engine caps it:
        `rollout.weights.transfer`), all of it by the init's deadline. A failure leaves nothing
        joined and is raised, naming the address and `timeout_s`, by the round's settle or finish
        (`update_weights({"joined": true})` asks without waiting). A previous init's rendezvous,
        pending or joined, is closed first."""
        self.shutdown()
        p, i = self.parallel_config, init_info
        self.rank = p.data_parallel_index * p.world_size + p.rank + i.rank_offset
        what = (f"gloo transfer: worker rank {self.rank} could not join the learner's group at "
                f"{i.master_address}:{i.master_port} within timeout_s={i.timeout_s:g}")  # fmt: skip
        self.info = init_info
        self.join = Join(what, i.timeout_s, lambda join: self._connect(i, join), lambda got: close_groups([got[1]]))

    def _connect(self, i: GlooInitInfo, join: Join) -> tuple[Any, Any]:
        reachable(i.master_address, i.master_port, i.timeout_s, join.stop)
        store = tcp_store(i.master_address, i.master_port, i.timeout_s)
        return store, pair_group(store, i.session, self.rank, i.timeout_s, trainer=False)

    def start_weight_update(self) -> None:
        self._posted()
        self.staged, self.post_error = [], None  # the model is untouched until finish_weight_update

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.join is None or self.info is None:
            raise RuntimeError("gloo weight transfer not initialized: call init_weight_transfer_engine first")
        cut = buckets(update_info.names, update_info.dtype_names, update_info.shapes, self.info.bucket_bytes)
        if (joined := self.join.peek()) is not None:
            self._post(joined, cut, update_info.round)
            return
        join = self.join  # not joined yet (or failed): its own thread posts them; the engine core goes on

        def post() -> None:
            try:
                self._post(join.wait(), cut, update_info.round)
            except Exception as e:
                self.post_error = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"

        self.posting = threading.Thread(target=post, daemon=True, name="gloo-post")
        self.posting.start()

    def _post(self, joined: tuple[Any, Any], cut: list[Any], round: int) -> None:
        store, pg = joined
        for k, bucket in enumerate(cut):
            buf = torch.empty(offsets(bucket)[1], dtype=torch.uint8)
            names = bucket[0][0] if len(bucket) == 1 else f"{bucket[0][0]} .. {bucket[-1][0]}"
            parts = slices(buf, bucket)
            self.staged.append(
                (f"bucket {k + 1}/{len(cut)} ({names})", bucket, parts, [broadcast(pg, part) for part in parts])
            )
        store.set(f"{self.info.session}/ready/{round}/{self.rank}", b"")  # type: ignore[union-attr]

    def _posted(self) -> None:
        """Waits for a round's receives posted by the rendezvous's thread (bounded by its deadline)."""
        posting, self.posting = self.posting, None
        if posting is not None:
            posting.join()

    def finish_weight_update(self) -> None:
        self._posted()
        staged, self.staged = self.staged, []
        if self.post_error is not None:
            why, self.post_error = self.post_error, None
            raise RuntimeError(f"{why}; the model is unchanged")
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
        if update_info.get(JOINED):
            self.joined()
        elif update_info.get(SETTLE):
            self.settle()
        elif update_info.get(DISCARD):
            self.discard()
        else:
            self.receive_weights(self.parse_update_info(update_info))  # CPU: nothing to synchronize

    def joined(self) -> None:
        """Raises, without waiting, why the rendezvous failed (the round's staging and the group
        dropped: the learner inits again); returns while it runs or once it joined."""
        if self.join is not None and (why := self.join.failure()) is not None:
            self.shutdown()
            raise RuntimeError(f"{why}; the model is unchanged")

    def settle(self) -> None:
        """Waits for every staged bucket (and a rendezvous still running, within its init's
        deadline: the learner's side may be joining while the engine's side settles). One that
        did not arrive, or a rendezvous that failed, drops the staging and the group (the learner
        inits again) and raises naming it; the model is untouched either way."""
        self._posted()
        if self.post_error is not None:
            why = self.post_error
            self.shutdown()
            raise RuntimeError(f"{why}; the model is unchanged")
        for what, _, _, works in self.staged:
            try:
                for work in works:
                    work.wait()
            except Exception as e:
                self.shutdown()
                raise RuntimeError(f"gloo transfer: {what}: {type(e).__name__}: {e}; the model is unchanged") from e

    def discard(self) -> None:
        """Drops the round's staging unloaded. Receives still posted (or still to be posted) close
        the group: the learner's next round would meet them out of step, so it inits again."""
        if self.posting is not None or any(not work.is_completed() for *_, works in self.staged for work in works):
            self.shutdown()
        self.staged, self.post_error = [], None

    def shutdown(self) -> None:
        """Closes the rendezvous (a running one stops; its thread closes what it joins later)
        and the group; returns without waiting on the learner."""
        if self.join is not None:
            self.join.close()
        self._posted()  # the join is closed: its wait, and the posting, end at once
        self.join = self.info = None
        self.staged, self.post_error = [], None


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


register()
