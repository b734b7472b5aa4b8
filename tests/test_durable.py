"""Durable hand-off, the on-disk log: format (torn writes vs damage), compaction, streaming reads,
the directory lock, and what a read-only directory, a full disk or an unencodable group do.

Engine-level behaviour (commit, resume, shutdown) is in test_durable_engine.py.
"""

from __future__ import annotations

import os
import queue
import threading
import tracemalloc
from pathlib import Path

import msgspec
import pytest

from rollout.handout.durable import LOCK_NAME, LOG_NAME, DurableLog, DurableLogError
from rollout.handout.durable_format import HEADER, MAGIC, AckRecord, GroupRecord, frame
from rollout.types import Group
from tests.support.durable_log import fill_the_disk, group, offsets, read_only, write_log


def recovered(directory: Path) -> list[str]:
    d = DurableLog(directory)
    ids = [g.prompt_id for g in d.open()]
    d.close()
    return ids


def flip(path: Path, at: int) -> bytes:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    return bytes(data)


def test_unacknowledged_groups_come_back_in_order_and_the_log_is_compacted(tmp_path):
    d = DurableLog(tmp_path)
    assert d.open() == []
    groups = [group(f"g{i}") for i in range(4)]
    for g in groups:
        d.append(g)
    d.ack([groups[1]])
    d.ack([groups[1]])  # a second ack of the same group writes nothing
    d.close()
    size_before = (tmp_path / LOG_NAME).stat().st_size
    again = DurableLog(tmp_path)
    back = again.open()
    assert [g.prompt_id for g in back] == ["g0", "g2", "g3"]
    assert back[0] == groups[0]  # every field round-trips
    assert (tmp_path / LOG_NAME).stat().st_size < size_before  # only the unacknowledged ones are left
    again.ack([back[0]])
    again.append(group("g4"))
    again.close()
    assert recovered(tmp_path) == ["g2", "g3", "g4"]


# -- torn writes (cut off) vs damage (an error, nothing changed) --------------------------------


@pytest.mark.parametrize("kept", [3, HEADER.size, HEADER.size + 5, -1])  # of the last record: part of its header, ...
def test_a_torn_last_record_is_cut_off(tmp_path, kept):
    write_log(tmp_path, 2)
    path = tmp_path / LOG_NAME
    last = offsets(path)[-1]
    data = path.read_bytes()
    path.write_bytes(data[: last + kept] if kept > 0 else data[:kept])
    again = DurableLog(tmp_path)
    assert [g.prompt_id for g in again.open()] == ["g0"]
    assert again.torn_bytes > 0
    again.append(group("g2"))  # the log goes on after the cut
    again.close()
    assert recovered(tmp_path) == ["g0", "g2"]


def test_a_zero_filled_tail_is_a_torn_write(tmp_path):
    """A file whose new size reached the disk before its data reads as zeros past the last record."""
    write_log(tmp_path, 2)
    path = tmp_path / LOG_NAME
    with open(path, "ab") as f:
        f.write(bytes(4096))
    again = DurableLog(tmp_path)
    assert [g.prompt_id for g in again.open()] == ["g0", "g1"]
    assert again.torn_bytes == 4096
    again.close()


@pytest.mark.parametrize(
    "kept", [-5, 0, 1, 30], ids=["header-tail", "payload-all-zeros", "one-byte-kept", "30-bytes-kept"]
)
@pytest.mark.parametrize("extra", [0, 4096], ids=["at-eof", "zeros-after"])
def test_a_zero_filled_payload_tail_of_the_last_record_is_a_torn_write(tmp_path, kept, extra):
    """A power cut between the size update and the data write: the last record reached the disk
    up to some byte of its header or payload, the rest reads as zeros (and so may what follows)."""
    write_log(tmp_path, 3)
    path = tmp_path / LOG_NAME
    last = offsets(path)[-1]
    data = bytearray(path.read_bytes())
    data[last + HEADER.size + kept :] = bytes(len(data) - last - HEADER.size - kept + extra)
    path.write_bytes(bytes(data))
    again = DurableLog(tmp_path)
    assert [g.prompt_id for g in again.open()] == ["g0", "g1"]
    what = "zero-filled payload" if kept >= 0 else "incomplete record or zeros"
    assert (again.torn_bytes, again.torn_records, again.torn) == (len(data) - last, 1, what)
    again.append(group("g3"))  # the run goes on after the cut
    again.close()
    assert recovered(tmp_path) == ["g0", "g1", "g3"]


def test_a_zero_filled_payload_tail_in_the_middle_is_an_error_at_its_offset(tmp_path):
    """The same bytes with records after them are no crash: damage, nothing changed."""
    write_log(tmp_path, 10)
    path = tmp_path / LOG_NAME
    at, end = offsets(path)[3:5]
    data = bytearray(path.read_bytes())
    data[at + HEADER.size + 10 : end] = bytes(end - at - HEADER.size - 10)
    path.write_bytes(bytes(data))
    with pytest.raises(DurableLogError, match=f"record at byte {at} is damaged \\(payload checksum mismatch\\)"):
        DurableLog(tmp_path).open()
    assert path.read_bytes() == data


def test_a_last_record_with_a_non_zero_garbage_tail_is_an_error(tmp_path):
    """Bytes that are not zeros and fail the checksum were changed after they were written (a
    crash leaves zeros): the record may be a group the run promised to keep, so a person decides."""
    write_log(tmp_path, 3)
    path = tmp_path / LOG_NAME
    last = offsets(path)[-1]
    data = bytearray(path.read_bytes())
    data[last + HEADER.size + 10 :] = b"\x5a" * (len(data) - last - HEADER.size - 10)
    path.write_bytes(bytes(data))
    with pytest.raises(DurableLogError, match=f"record at byte {last} is damaged \\(payload checksum mismatch\\)"):
        DurableLog(tmp_path).open()


@pytest.mark.parametrize("field", [0, 5, 9], ids=["length", "payload-crc", "header-crc"])
@pytest.mark.parametrize("record", [3, -1], ids=["mid-file", "last"])
def test_a_flipped_header_byte_is_an_error_at_its_offset_and_changes_nothing(tmp_path, field, record):
    """A flipped length byte is not a torn tail: read as one, it would drop every group after it
    (9 of 10), and the compaction at open would make that permanent."""
    write_log(tmp_path, 10)
    path = tmp_path / LOG_NAME
    at = offsets(path)[1:][record]
    damaged = flip(path, at + field)
    with pytest.raises(DurableLogError, match=f"record at byte {at} is damaged \\(header checksum mismatch\\)"):
        DurableLog(tmp_path).open()
    assert path.read_bytes() == damaged  # nothing cut off or compacted away
    flip(path, at + field)  # so once repaired, every group is there
    assert recovered(tmp_path) == [f"g{i}" for i in range(10)]


@pytest.mark.parametrize("record", [3, -1], ids=["mid-file", "last"])
def test_a_flipped_payload_byte_is_an_error_not_a_torn_write(tmp_path, record):
    write_log(tmp_path, 10)
    path = tmp_path / LOG_NAME
    at = offsets(path)[1:][record]
    flip(path, at + HEADER.size + 4)
    with pytest.raises(
        DurableLogError,
        match=f"record at byte {at} is damaged \\(payload checksum mismatch\\).*truncate the file to {at} bytes",
    ):
        DurableLog(tmp_path).open()


def test_a_log_without_the_v2_line_is_refused_not_read(tmp_path):
    (tmp_path / LOG_NAME).write_bytes(b"\x10\x00\x00\x00" + bytes(20))  # what a v1 log starts like
    with pytest.raises(DurableLogError, match="not a v2 groups log"):
        DurableLog(tmp_path).open()
    assert (tmp_path / LOG_NAME).read_bytes().startswith(b"\x10")  # left as it was
    assert not (tmp_path / LOG_NAME).read_bytes().startswith(MAGIC)


def test_a_file_where_the_directory_should_be_names_the_key(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(DurableLogError, match=f"queue.durable_dir={tmp_path / 'f'}: cannot create it: .*EEXIST"):
        DurableLog(tmp_path / "f").open()


# -- one run per directory -------------------------------------------------------------------


def test_a_second_log_on_the_directory_is_refused_naming_it(tmp_path):
    first = DurableLog(tmp_path)
    first.open()
    first.append(group("g0"))
    with pytest.raises(
        DurableLogError, match=f"queue.durable_dir={tmp_path}: another run holds it .*pid {os.getpid()}"
    ):
        DurableLog(tmp_path).open()
    first.append(group("g1"))  # the first goes on, and lost nothing
    first.close()
    assert recovered(tmp_path) == ["g0", "g1"]  # closing released the lock


# -- the epoch a new run resumes at ----------------------------------------------------------


def test_the_latest_epoch_is_kept_and_an_explicit_one_wins(tmp_path):
    d = DurableLog(tmp_path)
    assert d.open() is not None and d.epoch == 0
    d.set_epoch(1)
    d.set_epoch(3)
    d.close()
    d = DurableLog(tmp_path)
    d.open()
    assert d.epoch == 3
    d.close()
    d = DurableLog(tmp_path)
    d.open(epoch=7)  # a learner that restored other weights says so
    d.close()
    d = DurableLog(tmp_path)
    d.open()
    assert d.epoch == 7
    d.close()


# -- bounded size, streaming reads -------------------------------------------------------------


def test_the_log_is_compacted_during_a_run(tmp_path):
    d = DurableLog(tmp_path, compact_bytes=2048)
    d.open()
    base = d.size
    d.append(group("keep0"))
    record = d.size - base
    d.append(group("keep1"))
    for i in range(150):
        g = group(f"g{i}")
        d.append(g)
        d.ack([g])
        assert d.size < base + 2048 + 4 * record  # the live records, the threshold, the one over it
    assert d.compactions >= 5
    d.append(group("last"))
    d.close()
    assert recovered(tmp_path) == ["keep0", "keep1", "last"]


def test_appends_while_compacting_are_not_lost(tmp_path):
    """The scheduler appends from worker threads while the learner's commits compact the log."""
    d = DurableLog(tmp_path, compact_bytes=2048)
    d.open()
    logged: queue.Queue[Group | None] = queue.Queue()
    kept: list[str] = []

    def produce(k: int) -> None:
        for i in range(60):
            g = group(f"t{k}-{i}")
            d.append(g)
            logged.put(g)

    def commit() -> None:
        batch: list[Group] = []
        while (g := logged.get(timeout=10)) is not None:
            batch.append(g)
            if len(batch) == 3:
                d.ack(batch[1:])
                kept.append(batch[0].prompt_id)  # one of every three stays unacknowledged
                batch = []

    producers = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
    committer = threading.Thread(target=commit)
    for t in [committer, *producers]:
        t.start()
    for t in producers:
        t.join()
    logged.put(None)
    committer.join()
    d.close()
    assert d.compactions > 0 and len(kept) == 80
    assert sorted(recovered(tmp_path)) == sorted(kept)


def test_opening_a_large_log_streams_it(tmp_path):
    encode = msgspec.msgpack.encode  # written directly: 800 fsyncs would make this test slow, not truer
    with open(tmp_path / LOG_NAME, "wb") as f:
        f.write(MAGIC)
        for i in range(400):
            f.write(frame(encode(GroupRecord(i, group(f"g{i}", metadata={"blob": "x" * 20_000})))))
            if i % 100:
                f.write(frame(encode(AckRecord([i]))))
    assert (tmp_path / LOG_NAME).stat().st_size > 8_000_000
    tracemalloc.start()
    try:
        assert recovered(tmp_path) == ["g0", "g100", "g200", "g300"]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000, f"opening an 8 MB log took {peak} bytes"


# -- a group the log cannot hold fails alone ----------------------------------------------------


@pytest.mark.parametrize(
    "metadata, reason",
    [
        ({"obj": object()}, "TypeError: Encoding objects of type object is unsupported"),
        ({"n": 2**70}, "OverflowError"),
        ({1: "an int key"}, "Expected `str`, got `int`"),  # encodes, but would not read back: the whole log would not
    ],
)
def test_a_group_the_log_cannot_hold_fails_alone(tmp_path, metadata, reason):
    d = DurableLog(tmp_path)
    d.open()
    bad, good = group("bad", metadata=metadata), group("good")
    d.append(bad)
    d.append(good)
    assert bad.error is not None and reason in bad.error and "cannot be logged" in bad.error
    assert good.error is None and d.failed is None
    d.close()
    assert recovered(tmp_path) == ["good"]


# -- a directory or disk that refuses writes ---------------------------------------------------


@pytest.mark.parametrize("lock_file", [True, False], ids=["lock-file-left", "no-lock-file"])
def test_a_read_only_directory_is_an_error_naming_it_and_the_cause(tmp_path, lock_file):
    write_log(tmp_path, 2)
    if not lock_file:
        (tmp_path / LOCK_NAME).unlink()
    undo = read_only(tmp_path)
    what = "cannot rewrite groups.log" if lock_file else "cannot open its lock file"
    try:
        with pytest.raises(
            DurableLogError, match=f"queue.durable_dir={tmp_path}: {what}: (Permission denied|Operation not permitted)"
        ):
            DurableLog(tmp_path).open()
    finally:
        undo()
    assert recovered(tmp_path) == ["g0", "g1"]


def test_a_directory_that_turns_read_only_keeps_the_old_log_when_compaction_fails(tmp_path):
    d = DurableLog(tmp_path, compact_bytes=1024)
    d.open()
    keep = group("keep")
    d.append(keep)
    undo = read_only(tmp_path)  # the log file itself stays writable
    try:
        for i in range(40):
            g = group(f"g{i}")
            d.append(g)
            d.ack([g])
        assert d.compactions == 0 and d.failed is None  # compaction failed, appends went on
        d.append(group("after"))
    finally:
        undo()
    d.close()
    assert recovered(tmp_path) == ["keep", "after"]


def test_a_full_disk_fails_the_group_and_the_log_and_keeps_what_was_logged(tmp_path):
    d = DurableLog(tmp_path)
    d.open()
    first, second, third = group("g0"), group("g1"), group("g2")
    d.append(first)
    fill_the_disk(d)
    d.append(second)
    expected = (
        f"queue.durable_dir={tmp_path}: cannot append a finished group to groups.log: No space left on device (ENOSPC)"
    )
    assert second.error is not None and second.error.startswith(expected)
    d.append(third)  # once a write failed nothing after it is trusted, even if space came back
    assert third.error == second.error
    with pytest.raises(DurableLogError, match="No space left on device"):
        d.check()
    with pytest.raises(DurableLogError, match="No space left on device"):
        d.ack([first])  # it stays unacknowledged: handed out again, never lost
    d.close()
    assert recovered(tmp_path) == ["g0"]


def test_a_write_that_reaches_a_closed_log_fails_its_group_and_raises_nothing(tmp_path):
    """A group's append can reach the log after the engine closed it (its worker thread started
    late, its task cancelled at exit): the group is not logged, as one still generating is not."""
    d = DurableLog(tmp_path)
    d.open()
    d.append(kept := group("g0"))
    d.close()
    late = group("g1")
    d.append(late)
    d.set_epoch(3)
    assert late.error == f"queue.durable_dir={tmp_path}: the log was closed (the engine had exited); not logged"
    with pytest.raises(DurableLogError, match="the log was closed"):
        d.ack([kept])
    assert recovered(tmp_path) == ["g0"]
