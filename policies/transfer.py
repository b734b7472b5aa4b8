"""The weight plane's wire protocol: what the learner's ranks declare, how it is cut into buckets,
and how an engine's model worker puts the tensors back together as their bytes arrive.

Owns: shard metadata (`ShardMeta`: a tensor a learner rank holds, or a dim-0 slice of one, under
its HF name), the plan (`Plan`: every tensor's bytes cut into buckets of at most `bucket_bytes`,
each bucket from one learner rank, ranks interleaved), the check of the learners' declarations
against the model (`make_plan`: every checkpoint tensor covered exactly once, shapes and dtypes as
the checkpoint's; InvalidWeightsError naming each problem, before any engine changes), a round's
ticket and store keys, and the assembly of received bytes into whole tensors (`Assembler`).
Only metadata crosses the driver; bytes go learner -> worker (`policies.transports`).
Does not own: moving bytes (`policies.transports`), the worker's receive loop
(`policies.plane_worker`), epochs and engines (`rollout.updates`), the learner (`rollout.plane`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import msgspec

from policies.weights import Manifest, TensorSpec, spec_problems
from rollout.errors import InvalidWeightsError

BACKENDS = ("gloo", "nccl", "shm", "cuda_ipc")
GROUP_BACKENDS = ("gloo", "nccl")  # bytes by broadcast in a process group; the others through shared slots
OK, ABORT = 0, 1  # bucket header status


class ShardMeta(msgspec.Struct, frozen=True, array_like=True):
    """One tensor a learner rank sends: all of it, or dim-0 rows [start, start + rows) of it."""

    name: str  # the HF (checkpoint) name, after the learner's name map
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]  # of the whole tensor
    start: int = 0
    rows: int = -1  # -1: the whole tensor
    source: str = ""  # the learner's own name, when the name map changed it


class RankMeta(msgspec.Struct, frozen=True):
    """What learner rank `rank` declares for one round."""

    rank: int
    shards: list[ShardMeta] = []
    backend: str = "gloo"
    bucket_bytes: int = 0  # its buckets' size (shm / cuda_ipc: its slots')
    slots: list[Any] = []  # shm / cuda_ipc: the handles of its shared slots
    error: str = ""  # the rank refused its own weights (NaN, meta tensors, ...): InvalidWeightsError's message


class Piece(msgspec.Struct, frozen=True, array_like=True):
    tensor: int  # index into Plan.tensors
    offset: int  # first byte in the tensor
    at: int  # first byte in the bucket
    nbytes: int


class Bucket(msgspec.Struct, frozen=True, array_like=True):
    src: int  # the learner rank that sends it
    nbytes: int
    pieces: list[Piece]


class Entry(msgspec.Struct, frozen=True, array_like=True):
    name: str
    dtype: str
    shape: tuple[int, ...]


class Plan(msgspec.Struct, frozen=True):
    tensors: list[Entry]
    buckets: list[Bucket]
    bucket_bytes: int

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def describe(self, b: int) -> str:
        """Bucket `b` for an error message: its number and the tensors it carries."""
        names = list(dict.fromkeys(self.tensors[p.tensor].name for p in self.buckets[b].pieces))
        shown = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}" if names else "no tensor"
        return f"bucket {b + 1}/{len(self.buckets)} ({shown}) from learner rank {self.buckets[b].src}"


class EngineEntry(msgspec.Struct, frozen=True, array_like=True):
    engine: int
    workers: int  # model workers of the engine (tensor x pipeline parallel); each receives everything
    group: str  # group backends: engines with one key share a process group with each learner rank


class Ticket(msgspec.Struct, frozen=True):
    """The driver's answer to a round's declarations: the plan and who takes part, or why not."""

    round: int
    epoch: int = -1
    error: str = ""  # the declarations were refused (InvalidWeightsError's message)
    backend: str = "gloo"
    ranks: int = 1
    plan: Plan | None = None
    engines: list[EngineEntry] = []
    slots: dict[int, list[Any]] = {}  # learner rank -> its slot handles
    timeout_s: float = 300.0
    ready_timeout_s: float | None = 300.0  # for engines to pause and start receiving (None: drain, unbounded)


class Header(msgspec.Struct, frozen=True, array_like=True):
    """What a learner rank says about a bucket before its bytes: sent (in which slot) or aborted."""

    status: int = OK
    nbytes: int = 0
    slot: int = 0
    reason: str = ""


class Outcome(msgspec.Struct, frozen=True):
    """How a round ended, as the driver saw it: the epoch engines serve now, the engines that failed."""

    epoch: int = -1  # -1: no engine serves a new epoch
    failed: list[int] = []
    error: str = ""


class PlaneStage(msgspec.Struct, frozen=True):
    """What an engine is handed in phase 1 of a plane update: where to find round `round`'s ticket."""

    host: str
    port: int
    session: str
    round: int
    engine: int
    timeout_s: float = 300.0


class Keys:
    """The store keys of one plane (one session); a round's keys carry its number."""

    def __init__(self, session: str):
        self.prefix = f"rollout-plane/{session}"

    def _key(self, *parts: Any) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def last(self) -> str:  # the number of the last round the driver finished
        return self._key("last")

    def meta(self, n: int, rank: int) -> str:  # learner rank's declarations (RankMeta)
        return self._key("meta", n, rank)

    def ticket(self, n: int) -> str:  # the driver's Ticket
        return self._key("ticket", n)

    def joined(self, n: int, who: str) -> str:  # "" once joined, else why not ("L<rank>" or "<engine>.<worker>")
        return self._key("joined", n, who)

    def go(self, n: int) -> str:  # b"go", or why the round was called off
        return self._key("go", n)

    def ready(self, n: int, engine: int, worker: int) -> str:  # paused and receiving
        return self._key("ready", n, engine, worker)

    def hdr(self, n: int, b: int) -> str:  # bucket b's Header
        return self._key("hdr", n, b)

    def ackc(self, n: int, b: int, engine: int) -> str:  # an engine's workers done with bucket b (count)
        return self._key("ackc", n, b, engine)

    def ack(self, n: int, b: int, engine: int) -> str:  # ... all of them: its slot may be reused
        return self._key("ack", n, b, engine)

    def dropped(self, n: int, engine: int) -> str:  # the engine left the round: why
        return self._key("dropped", n, engine)

    def lfail(self, n: int, rank: int) -> str:  # a learner rank gave up: why
        return self._key("lfail", n, rank)

    def done(self, n: int) -> str:  # the driver's Outcome
        return self._key("done", n)


def itemsize(dtype: str) -> int:
    import torch

    return getattr(torch, dtype).itemsize


def shard_bytes(s: ShardMeta) -> tuple[int, int]:
    """(first byte, byte count) of a shard within its whole tensor."""
    total = math.prod(s.shape) * itemsize(s.dtype)
    if s.rows < 0:
        return 0, total
    row = total // s.shape[0] if s.shape[0] else 0
    return s.start * row, s.rows * row


def make_plan(metas: list[RankMeta], manifest: Manifest, bucket_bytes: int) -> Plan:
    """Check every rank's declarations against the model and cut them into buckets.

    Raises InvalidWeightsError naming every problem: a name the model does not have (with the
    learner's own name when a name map changed it), a checkpoint tensor nobody sends, a shape or
    dtype unlike the checkpoint's, ranks disagreeing about a tensor, a slice out of range, rows
    sent twice or not at all.
    """
    if bucket_bytes < 1:
        raise InvalidWeightsError(f"bucket_bytes: expected >= 1, got {bucket_bytes}")
    problems: list[str] = []
    merged: Manifest = {}
    spans: dict[str, list[tuple[int, int, int, bool]]] = {}  # name -> (first row, rows, rank, whole)
    for meta in metas:
        for s in meta.shards:
            label = f"{s.name} (learner name {s.source})" if s.source and s.source != s.name else s.name
            if s.name not in manifest:
                problems.append(f"unknown {label} from rank {meta.rank}")
                continue
            spec = TensorSpec(s.dtype, tuple(s.shape))
            if merged.setdefault(s.name, spec) != spec:
                other = merged[s.name]
                problems.append(f"{label}: rank {meta.rank} declares {s.dtype} {list(s.shape)}, another rank {other.dtype} {list(other.shape)}")
                continue
            n = s.shape[0] if s.shape else 0
            if s.rows >= 0 and (not s.shape or s.start < 0 or s.start + s.rows > n):
                problems.append(f"{label}: rank {meta.rank} sends rows {s.start}..{s.start + s.rows} of a tensor of shape {list(s.shape)}")
                continue
            whole = s.rows < 0
            spans.setdefault(s.name, []).append((0, n, meta.rank, True) if whole else (s.start, s.rows, meta.rank, False))
    problems += spec_problems(merged, manifest)  # merged holds known names only: missing, shapes, dtypes
    for name, got in spans.items():
        if len(got) > 1 and any(whole for *_, whole in got):
            problems.append(f"{name}: sent by ranks {sorted(r for _, _, r, _ in got)}, one of them whole")
            continue
        n, at = (merged[name].shape[0] if merged[name].shape else 0), 0
        for start, count, rank, _ in sorted(got):
            if start < at:
                problems.append(f"{name}: rows {start}..{start + count} from rank {rank} were already sent")
            elif start > at:
                problems.append(f"{name}: rows {at}..{start} are sent by no rank")
            at = max(at, start + count)
        if at < n:
            problems.append(f"{name}: rows {at}..{n} are sent by no rank")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
        raise InvalidWeightsError(f"the learner's weights do not fit the model: {shown}")
    return _cut(metas, bucket_bytes)


def _cut(metas: list[RankMeta], bucket_bytes: int) -> Plan:
    index: dict[str, int] = {}
    tensors: list[Entry] = []
    per_rank: list[list[Bucket]] = []
    for meta in sorted(metas, key=lambda m: m.rank):
        buckets: list[Bucket] = []
        pieces: list[Piece] = []
        used = 0
        for s in meta.shards:
            if s.name not in index:
                index[s.name] = len(tensors)
                tensors.append(Entry(s.name, s.dtype, tuple(s.shape)))
            offset, left = shard_bytes(s)
            while True:
                take = min(left, bucket_bytes - used)
                pieces.append(Piece(index[s.name], offset, used, take))
                used, offset, left = used + take, offset + take, left - take
                if used == bucket_bytes:
                    buckets.append(Bucket(meta.rank, used, pieces))
                    pieces, used = [], 0
                if left == 0:
                    break
        if pieces:
            buckets.append(Bucket(meta.rank, used, pieces))
        per_rank.append(buckets)
    interleaved = [b for k in range(max(map(len, per_rank), default=0)) for bs in per_rank if k < len(bs) for b in [bs[k]]]
    return Plan(tensors, interleaved, bucket_bytes)


class Assembler:
    """Whole tensors out of bucket bytes: each tensor's storage is allocated on its first piece and
    handed out (name, tensor) once its last byte is in. One copy per byte, on `device`."""

    def __init__(self, plan: Plan, device: Any = "cpu"):
        self.plan = plan
        self.device = device
        self._storage: dict[int, Any] = {}
        self._left = {i: math.prod(t.shape) * itemsize(t.dtype) for i, t in enumerate(plan.tensors)}
        self.received = 0

    def add(self, b: int, data: Any) -> list[tuple[str, Any]]:
        """Copy bucket `b`'s bytes (a uint8 tensor) into the tensors; the tensors it completed."""
        import torch

        done = []
        for p in self.plan.buckets[b].pieces:
            entry = self.plan.tensors[p.tensor]
            storage = self._storage.get(p.tensor)
            if storage is None:
                total = math.prod(entry.shape) * itemsize(entry.dtype)
                storage = self._storage[p.tensor] = torch.empty(total, dtype=torch.uint8, device=self.device)
            if p.nbytes:
                storage[p.offset : p.offset + p.nbytes].copy_(data[p.at : p.at + p.nbytes])
            self._left[p.tensor] -= p.nbytes
            self.received += p.nbytes
            if self._left[p.tensor] == 0:
                del self._storage[p.tensor]
                done.append((entry.name, storage.view(getattr(torch, entry.dtype)).view(entry.shape)))
        return done

    def missing(self) -> list[str]:
        return [self.plan.tensors[i].name for i, left in self._left.items() if left]


def pack_bucket(plan: Plan, b: int, held: dict[int, tuple[Any, int]], out: Any) -> None:
    """Copy bucket `b`'s pieces into `out` (a uint8 tensor of at least the bucket's size) from
    `held`: plan tensor index -> (the rank's bytes of it, a flat uint8 tensor; their first byte
    within the whole tensor)."""
    for p in plan.buckets[b].pieces:
        if p.nbytes:
            flat, base = held[p.tensor]
            out[p.at : p.at + p.nbytes].copy_(flat[p.offset - base : p.offset - base + p.nbytes])


def my_buckets(plan: Plan, rank: int) -> Iterator[int]:
    return (b for b, bucket in enumerate(plan.buckets) if bucket.src == rank)
