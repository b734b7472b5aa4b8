"""The on-disk format of the durable hand-off log (`groups.log`): records, framing, a streaming reader.

Format v2: the line `rollout groups.log v2\\n`, then records `u32 length | u32 crc32(payload) |
u32 crc32(the two fields before) | payload`, the payload a msgpack `Record`. The header has a
checksum of its own, so a damaged length can never pass for the end of the file. Only an
incomplete last record is a torn write (a power cut mid-append): fewer bytes than a header, a
verified header whose payload runs past the end, or zeros from some byte of the last record to the
end of the file (a file whose new size reached the disk before its data reads as zeros: the
tail of a header, or of a verified header's payload). Anything else (a bad checksum, a record that
does not decode, anywhere; a last record whose payload fails its checksum with bytes other than
zeros at its end) raises `DurableLogError` with the byte offset (`_torn_payload` says why).
Files without the v2 line (v1 logs, which had no header checksum) are refused, not read.
Does not own: locking, appending, compaction (see `durable`).
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import msgspec

from rollout.errors import RolloutError
from rollout.types import Group

MAGIC = b"rollout groups.log v2\n"
HEADER = struct.Struct("<III")  # payload length, crc32 of the payload, crc32 of the first 8 bytes
LOG_NAME = "groups.log"


class GroupRecord(msgspec.Struct, array_like=True, tag="group"):
    id: int
    group: Group


class AckRecord(msgspec.Struct, array_like=True, tag="ack"):
    ids: list[int]  # one record per commit: one fsync however many groups it acknowledges


class EpochRecord(msgspec.Struct, array_like=True, tag="epoch"):
    epoch: int  # the engine's epoch from here on; a new run resumes at the latest one


Record = GroupRecord | AckRecord | EpochRecord


class DurableLogError(RolloutError):
    """The durable log cannot be used: damaged (not merely torn at its end), held by another run,
    or a directory or disk that refuses to be written."""


def frame(payload: bytes) -> bytes:
    head = struct.pack("<II", len(payload), zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head)) + payload


class LogReader:
    """The records of a log file, one at a time: `for offset, size, record in LogReader(f, path)`.

    Raises DurableLogError (with the byte offset) for anything but a torn last record; after
    iterating, `end` is where the last whole record ends and `torn_bytes` what follows it.
    """

    def __init__(self, f: BinaryIO, path: Path):
        self.f, self.path = f, path
        self.size = os.fstat(f.fileno()).st_size
        self.end = 0
        self.zero_filled = False  # the torn record is a verified header with a zero-filled payload tail
        self._decoder = msgspec.msgpack.Decoder(Record)

    @property
    def torn_bytes(self) -> int:
        return self.size - self.end

    @property
    def torn(self) -> str:
        """What was cut off the end ("" when nothing was), for the warning."""
        if not self.torn_bytes:
            return ""
        return "zero-filled payload" if self.zero_filled else "incomplete record or zeros"

    def __iter__(self) -> Iterator[tuple[int, int, Record]]:
        f, size = self.f, self.size
        f.seek(0)
        if size == 0:
            return
        if f.read(len(MAGIC)) != MAGIC:
            raise DurableLogError(
                f"{self.path}: not a v2 groups log (no {MAGIC[:-1].decode()!r} line): "
                "an older rollout's log or not ours; "
                "hand out its groups with the version that wrote it, or move it away"
            )
        pos = self.end = len(MAGIC)
        while pos < size:
            head = f.read(HEADER.size)
            if len(head) < HEADER.size:
                return  # torn: part of a header
            length, crc, head_crc = HEADER.unpack(head)
            if zlib.crc32(head[:8]) != head_crc:
                if self._zeros_from(pos + HEADER.size - 1):
                    # torn: the file's new size reached the disk, its data (from some byte of this header on) did not
                    return
                raise self._damaged(pos, "header checksum mismatch")
            if pos + HEADER.size + length > size:
                return  # torn: a verified header whose payload never fully reached the disk
            payload = f.read(length)
            if zlib.crc32(payload) != crc:
                if self._torn_payload(payload, pos + HEADER.size + length):
                    self.zero_filled = True
                    return  # torn: the header reached the disk, the end of its payload did not
                raise self._damaged(pos, "payload checksum mismatch")
            try:
                record = self._decoder.decode(payload)
            except msgspec.DecodeError as e:
                raise self._damaged(pos, f"not a durable-log record: {e}") from e
            yield pos, HEADER.size + length, record
            pos = self.end = pos + HEADER.size + length

    def _torn_payload(self, payload: bytes, end: int) -> bool:
        """A payload that fails its checksum is torn when it ends in zeros and only zeros follow
        it to the end of the file; any other bytes make it damage.

        Why this rule: the log writes each record with one write and fsyncs it before the next
        (`DurableLog._write`), so only the last record can be unsynced at a crash, and file systems
        (ext4 in its default data=ordered mode, xfs) show the blocks of a write that never reached
        the disk as zeros. Non-zero bytes that fail the checksum were changed after they were
        written (the medium, another writer; or stale blocks under ext4 data=writeback): the record
        may be an fsync'd group the run promised to keep, so a person decides. A group record never
        ends in a zero byte (msgpack of its last field, `error`, is nil or a string); an ack or
        epoch record can, and one damaged elsewhere then reads as torn, which drops what a crash
        before its fsync would have dropped (its groups are handed out again: at least once)."""
        return payload.endswith(b"\0") and self._zeros_from(end)

    def _zeros_from(self, pos: int) -> bool:
        self.f.seek(pos)
        while chunk := self.f.read(1 << 16):
            if chunk.count(0) != len(chunk):
                return False
        return True

    def _damaged(self, pos: int, why: str) -> DurableLogError:
        return DurableLogError(
            f"{self.path}: record at byte {pos} is damaged ({why}), not a torn write at the end; nothing was "
            f"recovered or changed. To give up that record and every one after it, truncate the file to {pos} bytes"
        )


@dataclass
class LiveRecord:
    """An unacknowledged group record: where it is in the file, and the group it holds (the
    reference also keeps `id(group)`, the key it is found by, from being reused)."""

    id: int
    offset: int
    size: int
    group: Group


@dataclass
class LogState:
    """What a log holds: its unacknowledged groups (in log order), its latest epoch, and the next record id."""

    live: dict[int, LiveRecord] = field(default_factory=dict)
    epoch: int = 0
    next_id: int = 0
    torn_bytes: int = 0  # cut off the end: a torn last record
    torn: str = ""  # ... and what it was (`LogReader.torn`)


def read_log(path: Path) -> LogState:
    """Stream a log file (memory: its unacknowledged groups, not its size). Raises DurableLogError, OSError."""
    state = LogState()
    if not path.exists():
        return state
    with open(path, "rb") as f:
        reader = LogReader(f, path)
        for offset, size, record in reader:
            if isinstance(record, GroupRecord):
                state.live[record.id] = LiveRecord(record.id, offset, size, record.group)
                state.next_id = max(state.next_id, record.id + 1)
            elif isinstance(record, AckRecord):
                for rid in record.ids:
                    state.live.pop(rid, None)
            else:
                state.epoch = record.epoch
        state.torn_bytes, state.torn = reader.torn_bytes, reader.torn
    return state
