"""Durable hand-off (`queue.durable_dir`): finished groups survive a crash of the driver or learner.

Owns one directory: `groups.log` (format in `durable_format`) and `lock`, which one run at a time holds
(`fcntl.flock`; the kernel releases it even after SIGKILL), so a second run on the directory is
refused. A finished group is appended and fsync'd before it can be handed out; a group handed out
is taken, and acknowledged (an fsync'd ack record) when the learner commits it (`Commits`).
Opening the directory recovers the unacknowledged groups, in log order, to be handed out before
anything new, and the latest policy epoch, for the run to resume at.

The file stays bounded: it is rewritten (temp file, fsync, atomic rename, directory fsync) with
only the unacknowledged groups at every open and whenever acknowledged records reach
`queue.durable_compact_bytes`; the rewrite copies their bytes, nothing is re-encoded.

Failures: a group the log cannot encode, or could not decode again (one record that does not read
back would make the whole log unreadable), comes back from `append` with `error` set; the log goes
on. A write or fsync that fails (a full disk) marks the log `failed` for the rest of the run: after
a failed fsync the kernel may have dropped the unwritten pages, so nothing written later could be
trusted as durable (PostgreSQL's "fsyncgate"). `check()` raises it; hand-out calls it.
Does not own: groups still generating at a crash; the learner's prompt source feeds those again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import anyio
import msgspec

from rollout.batch import Batch
from rollout.config import QueueConfig
from rollout.handout.durable_format import (
    LOG_NAME,
    MAGIC,
    AckRecord,
    DurableLogError,
    EpochRecord,
    GroupRecord,
    LiveRecord,
    LogReader,
    LogState,
    Record,
    frame,
    read_log,
)
from rollout.log import get_logger
from rollout.packed import wire_hook
from rollout.types import Group

__all__ = ["LOCK_NAME", "LOG_NAME", "Commits", "DurableLog", "DurableLogError", "LogReader", "LogState", "read_log"]

log = get_logger(__name__)

LOCK_NAME = "lock"
COMPACT_BYTES = QueueConfig().durable_compact_bytes


class DurableLog:
    """The log of one run. Thread-safe: the scheduler appends from worker threads while the learner commits."""

    def __init__(self, directory: str | Path, compact_bytes: int = COMPACT_BYTES):
        self.dir = Path(directory)
        self.path = self.dir / LOG_NAME
        self.compact_bytes = compact_bytes
        self.epoch = 0
        self.recovered: list[Group] = []
        self.torn_bytes = 0  # cut off the end of the log when it was opened (a torn last record)
        self.torn_records = 0  # ... the count of those cut-offs (0 or 1 per open)
        self.torn = ""  # ... and what was cut off (`LogReader.torn`), as the warning says
        self.failed: DurableLogError | None = None
        self.compactions = 0  # rewrites since open (not counting open's own)
        self._encoder = msgspec.msgpack.Encoder(enc_hook=wire_hook)  # per-token data packed (`rollout.packed`)
        self._decoder = msgspec.msgpack.Decoder(Record)
        self._mutex = threading.Lock()
        self._live: dict[int, LiveRecord] = {}  # id(group) -> its record, until acknowledged
        self._next_id = 0
        self._size = 0  # of the file
        self._garbage = 0  # bytes of acknowledged groups, acks and old epochs: what a rewrite drops
        self._compact_at = compact_bytes
        self._file: Any = None  # the append handle
        self._lock_fd: int | None = None

    @property
    def size(self) -> int:
        return self._size

    @property
    def unacknowledged(self) -> int:
        return len(self._live)

    def open(self, epoch: int | None = None) -> list[Group]:
        """Lock the directory, recover the unacknowledged groups (oldest first), compact, open for appending.

        `epoch`: the run's starting epoch; None resumes at the log's latest. Raises DurableLogError
        naming the directory (another run holds it, it cannot be created or written, damage).
        """
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._error("cannot create it", e) from e
        self._lock()
        try:
            try:
                state = read_log(self.path)
            except OSError as e:
                raise self._error(f"cannot read {LOG_NAME}", e) from e
            self.torn_bytes, self.torn, self._next_id = state.torn_bytes, state.torn, state.next_id
            self.epoch = state.epoch if epoch is None else epoch
            if self.torn_bytes:
                self.torn_records += 1
                log.warning(
                    "durable log: torn last record cut off", path=str(self.path), bytes=self.torn_bytes, what=state.torn
                )
            self._live = {id(e.group): e for e in state.live.values()}
            try:
                self._rewrite()
            except OSError as e:
                raise self._error(f"cannot rewrite {LOG_NAME}", e) from e
            except _AfterRename as e:
                raise self._error(f"cannot reopen the rewritten {LOG_NAME}", e.cause) from e
        except BaseException:
            self._unlock()
            raise
        self.recovered = [e.group for e in self._live.values()]
        if self.recovered:
            log.info(
                "durable log: unacknowledged groups recovered",
                groups=len(self.recovered),
                epoch=self.epoch,
                path=str(self.path),
            )
        return self.recovered

    def append(self, group: Group) -> None:
        """Log `group` durably (returns after fsync). Never raises: a group the log cannot hold, or
        any group once the log has `failed`, comes back with `error` set, not logged."""
        with self._mutex:
            if self.failed is not None:
                group.error = str(self.failed)
                return
            rid = self._next_id
            try:
                payload = self._encoder.encode(GroupRecord(rid, group))
                self._decoder.decode(payload)  # what would not read back must not reach the log
            except (TypeError, ValueError, OverflowError, msgspec.MsgspecError) as e:
                group.error = (
                    f"queue.durable_dir={self.dir}: this group cannot be logged ({type(e).__name__}: {e}); "
                    "handed out failed"
                )
                log.error("durable log: group cannot be logged", prompt=group.prompt_id, error=str(e))
                return
            self._next_id += 1
            data = frame(payload)
            offset = self._size
            if self._write(data, f"cannot append a finished group to {LOG_NAME}"):
                self._live[id(group)] = LiveRecord(rid, offset, len(data), group)
            else:
                group.error = str(self.failed)

    def ack(self, groups: Iterable[Group]) -> None:
        """The learner committed `groups`: never recover them again. Ones not logged or already
        acknowledged are skipped. Raises DurableLogError when the ack cannot be written (they stay
        unacknowledged, so a new run hands them out again: at least once, never lost)."""
        with self._mutex:
            entries = {id(g): e for g in groups if (e := self._live.get(id(g))) is not None and e.group is g}
            if not entries:
                return
            self.check()
            data = frame(self._encoder.encode(AckRecord([e.id for e in entries.values()])))
            if not self._write(data, f"cannot acknowledge groups in {LOG_NAME}"):
                raise self.failed  # type: ignore[misc]
            for key, e in entries.items():
                del self._live[key]
                self._garbage += e.size
            self._garbage += len(data)
            if self._garbage >= self._compact_at:
                self._compact()

    def set_epoch(self, epoch: int) -> None:
        """Record the engine's new epoch (a new run resumes there). Never raises: a failed write marks the
        log `failed`."""
        with self._mutex:
            self.epoch = epoch
            if self.failed is None:
                data = frame(self._encoder.encode(EpochRecord(epoch)))
                if self._write(data, f"cannot record epoch {epoch} in {LOG_NAME}"):
                    self._garbage += len(data)  # only the latest counts, and a rewrite writes that one

    def check(self) -> None:
        """Raise the failure that stopped the log, if any."""
        if self.failed is not None:
            raise self.failed

    def close(self) -> None:
        """Close the file and release the lock (always). Raises DurableLogError if the file did not
        close cleanly. A write after this (a late worker thread's) logs nothing and says why."""
        with self._mutex:
            f, self._file = self._file, None
            if self.failed is None:
                self.failed = DurableLogError(
                    f"queue.durable_dir={self.dir}: the log was closed (the engine had exited); not logged"
                )
            try:
                if f is not None:
                    f.close()
            except OSError as e:
                raise self._error(f"cannot close {LOG_NAME}", e) from e
            finally:
                self._unlock()

    # -- internals (called with the mutex held, or before anyone else has the log) ----------------

    def _write(self, data: bytes, what: str) -> bool:
        """Append `data` and fsync. False when it failed: the log is `failed` from then on. A
        record cut short by the failure stays at the end as a torn write, cut off at the next open."""
        try:
            view = memoryview(data)
            while view:
                view = view[self._file.write(view) :]
            os.fsync(self._file.fileno())
        except OSError as e:
            self.failed = self._error(what, e, "; groups logged before stay for the next run, later ones fail")
            log.error("durable log failed", error=str(self.failed))
            return False
        self._size += len(data)
        return True

    def _compact(self) -> None:
        """Rewrite the log with only the unacknowledged groups. A failure before the rename keeps
        the old log (tried again after another `compact_bytes`); one after it fails the log."""
        try:
            self._rewrite()
        except _AfterRename as e:
            self.failed = self._error(f"cannot switch to the compacted {LOG_NAME}", e.cause)
            log.error("durable log failed", error=str(self.failed))
        except OSError as e:
            self._compact_at = self._garbage + self.compact_bytes  # try again after as much garbage again
            log.error("durable log: compaction failed; the old log stays in use", path=str(self.path), error=_cause(e))
        else:
            self.compactions += 1

    def _rewrite(self) -> None:
        """The log := the current epoch and the live records, copied byte for byte from the old file.
        Raises OSError with the old log in place, or _AfterRename once the new one replaced it."""
        tmp = self.path.with_name(LOG_NAME + ".tmp")
        moved: dict[int, LiveRecord] = {}
        try:
            with open(tmp, "wb") as out:
                out.write(MAGIC)
                out.write(frame(self._encoder.encode(EpochRecord(self.epoch))))
                if self._live:
                    with open(self.path, "rb") as src:
                        for key, e in self._live.items():
                            data = os.pread(src.fileno(), e.size, e.offset)
                            if len(data) != e.size:
                                raise OSError(
                                    errno.EIO, f"short read of record {e.id} at byte {e.offset}", str(self.path)
                                )
                            moved[key] = LiveRecord(e.id, out.tell(), e.size, e.group)
                            out.write(data)
                out.flush()
                os.fsync(out.fileno())
                size = out.tell()
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        try:
            _fsync_dir(self.dir)
            new = open(self.path, "ab", buffering=0)  # noqa: SIM115 - held until close; unbuffered: nothing left to flush there
        except OSError as e:
            raise _AfterRename(e) from e
        old, self._file = self._file, new
        if old is not None:
            with contextlib.suppress(OSError):
                old.close()  # the replaced file: nothing of it is needed any more
        self._live, self._size, self._garbage = moved, size, 0
        self._compact_at = self.compact_bytes

    def _lock(self) -> None:
        lock_path = self.dir / LOCK_NAME
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise self._error("cannot open its lock file", e) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DurableLogError(
                    f"queue.durable_dir={self.dir}: another run holds it (lock {lock_path}, pid {holder}); "
                    "two runs on one log would hand out and acknowledge each other's groups. "
                    "Give each run its own directory"
                ) from e
            raise self._error("cannot lock it", e) from e
        with contextlib.suppress(OSError):  # only for the message above: a full disk must not stop the run here
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    def _error(self, what: str, e: OSError, more: str = "") -> DurableLogError:
        return DurableLogError(f"queue.durable_dir={self.dir}: {what}: {_cause(e)}{more}")


class _AfterRename(Exception):
    def __init__(self, cause: OSError):
        self.cause = cause


def _cause(e: OSError) -> str:
    """`No space left on device (ENOSPC)`: the errno's text and name, then the file if any."""
    name = errno.errorcode.get(e.errno or 0)
    text = f"{e.strerror or e}" + (f" ({name})" if name else "")
    return text + (f": {e.filename}" if e.filename else "")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Commits:
    """The learner's side of the log: a group handed out is taken until the learner commits it.

    `auto`: asking for the next group or batch commits everything handed out before (like a
    consumer that commits on its next poll), and so does a clean exit; else only `commit` does.
    """

    def __init__(self, durable: DurableLog, auto: bool):
        self.log, self.auto = durable, auto
        self.taken: list[Group] = []  # handed out, not yet committed

    async def hand_out(self, group: Group, keep: Callable[[Group], Group | None]) -> Group | None:
        """`keep(group)` (the staleness check), taken. A group `keep` drops (None, or an error report
        in its place) is acknowledged at once: never trained on, and a new run would drop it again.
        Raises the log's failure."""
        self.log.check()  # after a failure the groups behind this one were not logged: stop loudly
        out = keep(group)
        if out is group:
            self.taken.append(group)
        else:
            await anyio.to_thread.run_sync(self.log.ack, [group])
        return out

    async def poll(self) -> None:
        """The learner asks for more."""
        if self.auto:
            await self.commit()

    async def commit(self, handed: Batch | Group | Iterable[Group] | None = None) -> None:
        """Acknowledge `handed` (default: everything taken). Raises DurableLogError (they stay taken)."""
        if handed is None:
            groups = list(self.taken)
        else:
            groups = (
                handed.groups if isinstance(handed, Batch) else [handed] if isinstance(handed, Group) else list(handed)
            )
        keys = {id(g) for g in groups}
        done = [g for g in self.taken if id(g) in keys]
        if done:
            await anyio.to_thread.run_sync(self.log.ack, done)
            self.taken = [g for g in self.taken if id(g) not in keys]
