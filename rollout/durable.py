"""Durable hand-off (`queue.durable_dir`): finished groups survive a crash of the driver.

Owns one append-only file, `groups.log`, of framed records: `u32 length | u32 crc32 | msgpack
Record`, a Record being `("group", id, Group)` or `("ack", id)`. A group is appended and
fsync'd before it can be handed out; it is acknowledged (an fsync'd ack record) when the learner
takes it. Opening the directory again recovers the groups without an ack, in the order they were
logged, to be handed out before anything new, and rewrites the log with only those (atomic
rename), so the file never grows past what is unacknowledged plus one run's traffic.

A torn record at the end (a power cut mid-write: short header, short payload, bad checksum) is
skipped with a warning and cut off; a bad record in the middle means the file is not ours or is
damaged beyond a torn write, and raises `DurableLogError`.
Does not own: groups still generating at a crash; the learner's prompt source feeds those again.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Any

import msgspec

from rollout.errors import RolloutError
from rollout.log import get_logger
from rollout.types import Group

log = get_logger(__name__)

HEADER = struct.Struct("<II")  # payload length, crc32 of the payload
LOG_NAME = "groups.log"


class Record(msgspec.Struct, array_like=True):
    kind: str  # "group" or "ack"
    id: int
    group: Group | None = None


class DurableLogError(RolloutError):
    """The durable log cannot be read (damaged before its last record) or written."""


class DurableLog:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.path = self.dir / LOG_NAME
        self._encoder = msgspec.msgpack.Encoder()
        self._ids: dict[int, int] = {}  # id(group object) -> record id, until acknowledged
        self._next_id = 0
        self._file: Any = None
        self.recovered: list[Group] = []
        self.torn_bytes = 0  # bytes cut off the end of the log when it was opened

    def open(self) -> list[Group]:
        """Recover the unacknowledged groups (oldest first), compact the log, open it for appending."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            groups, acked, self.torn_bytes = read_log(self.path)
        except OSError as e:
            raise DurableLogError(f"queue.durable_dir: cannot use {str(self.dir)!r}: {e}") from e
        if self.torn_bytes:
            log.warning("durable log: torn last record skipped", path=str(self.path), bytes=self.torn_bytes)
        pending = [(rid, g) for rid, g in groups.items() if rid not in acked]
        self._next_id = max(groups, default=-1) + 1
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            for rid, g in pending:
                f.write(self._frame(Record("group", rid, g)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.dir)
        self._file = open(self.path, "ab")
        self.recovered = [g for _, g in pending]
        for rid, g in pending:
            self._ids[id(g)] = rid
        if pending:
            log.info("durable log: unacknowledged groups recovered", groups=len(pending), path=str(self.path))
        return self.recovered

    def append(self, group: Group) -> None:
        """Log `group` durably (returns after fsync)."""
        rid = self._next_id
        self._next_id += 1
        self._write(Record("group", rid, group))
        self._ids[id(group)] = rid

    def ack(self, group: Group) -> None:
        """The learner took `group` (the same object `append` or `open` gave): never recover it again."""
        rid = self._ids.pop(id(group), None)
        if rid is not None:
            self._write(Record("ack", rid))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, record: Record) -> None:
        assert self._file is not None, "DurableLog.open() first"
        self._file.write(self._frame(record))
        self._file.flush()
        os.fsync(self._file.fileno())

    def _frame(self, record: Record) -> bytes:
        payload = self._encoder.encode(record)
        return HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def read_log(path: Path) -> tuple[dict[int, Group], set[int], int]:
    """(groups by record id in log order, acknowledged ids, torn bytes at the end) of a log file."""
    groups: dict[int, Group] = {}
    acked: set[int] = set()
    if not path.exists():
        return groups, acked, 0
    data = path.read_bytes()
    decoder = msgspec.msgpack.Decoder(Record)
    pos = 0
    while pos < len(data):
        if pos + HEADER.size > len(data):
            break  # torn header
        length, crc = HEADER.unpack_from(data, pos)
        end = pos + HEADER.size + length
        payload = data[pos + HEADER.size : end]
        if end > len(data) or zlib.crc32(payload) != crc:
            if end >= len(data):
                break  # torn last record
            raise DurableLogError(f"{path}: damaged record at byte {pos} (checksum mismatch), not a torn write")
        try:
            record = decoder.decode(payload)
        except msgspec.DecodeError as e:
            raise DurableLogError(f"{path}: record at byte {pos} is not a durable-log record: {e}") from e
        if record.kind == "group" and record.group is not None:
            groups[record.id] = record.group
        elif record.kind == "ack":
            acked.add(record.id)
        else:
            raise DurableLogError(f"{path}: record at byte {pos} has unknown kind {record.kind!r}")
        pos = end
    truncated = len(data) - pos
    if truncated:
        with open(path, "r+b") as f:
            f.truncate(pos)
    return groups, acked, truncated


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
