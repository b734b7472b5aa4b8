"""The fuzz tier for the durable log's reader: what a crash can leave at the end of `groups.log`
(the file cut at any byte; zeros from any byte to the end, and past it) is a torn last record,
cut off, and every whole record before it is handed out; the same zeros with records after them
are damage, an error at that record's offset, and the file is left as it was.
Deterministic like `test_fuzz.py` (`ROLLOUT_FUZZ_EXAMPLES`, `ROLLOUT_FUZZ_RANDOM`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.handout.durable import LOG_NAME, DurableLog, DurableLogError
from rollout.handout.durable_format import MAGIC, LogReader
from tests.support.durable_log import group

pytestmark = pytest.mark.fuzz
EXAMPLES = int(os.environ.get("ROLLOUT_FUZZ_EXAMPLES", "400"))
FUZZ = settings(
    max_examples=EXAMPLES // 4,
    deadline=None,
    derandomize=not os.environ.get("ROLLOUT_FUZZ_RANDOM"),
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
SIZES = st.lists(st.integers(0, 600), min_size=1, max_size=5)  # metadata bytes per group: records of many lengths


def logged(directory: Path, sizes: list[int]) -> tuple[bytes, list[tuple[int, int]]]:
    """A log of one group per size, and (offset, end) of each record (the first: the epoch)."""
    d = DurableLog(directory)
    d.open()
    for i, n in enumerate(sizes):
        d.append(group(f"g{i}", metadata={"pad": "x" * n}))
    d.close()
    path = directory / LOG_NAME
    with open(path, "rb") as f:
        records = [(offset, offset + size) for offset, size, _ in LogReader(f, path)]
    return path.read_bytes(), records


def opened(directory: Path, data: bytes) -> tuple[list[str], int]:
    (directory / LOG_NAME).write_bytes(data)
    d = DurableLog(directory)
    try:
        return [g.prompt_id for g in d.open()], d.torn_bytes
    finally:
        d.close()


@FUZZ
@given(sizes=SIZES, where=st.floats(0, 1), zeros=st.booleans(), extra=st.sampled_from([0, 1, 4096]))
def test_what_a_crash_leaves_at_the_end_is_cut_off(sizes, where, zeros, extra):
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        data, records = logged(directory, sizes)
        at = len(MAGIC) + round(where * (len(data) - len(MAGIC)))  # the first byte that never reached the disk
        crashed = data[:at] + (bytes(len(data) - at + extra) if zeros else b"")
        whole = [f"g{i}" for i, (_, end) in enumerate(records[1:]) if end <= at]
        back, torn = opened(directory, crashed)
        assert back == whole
        assert torn == len(crashed) - max([end for _, end in records if end <= at], default=len(MAGIC))


@FUZZ
@given(
    sizes=SIZES.filter(lambda s: len(s) >= 2), which=st.floats(0, 1), start=st.floats(0, 1), length=st.integers(1, 64)
)
def test_the_same_zeros_before_another_record_are_damage(sizes, which, start, length):
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        data, records = logged(directory, sizes)
        offset, end = records[round(which * (len(records) - 2))]  # any record but the last
        a = offset + round(start * (end - offset - 1))
        b = min(end, a + length) if length < 64 else end  # to the record's end, or a stretch inside it
        damaged = data[:a] + bytes(b - a) + data[b:]
        if damaged == data:
            return  # those bytes were zeros already
        with pytest.raises(DurableLogError, match=f"record at byte {offset} is damaged"):
            opened(directory, damaged)
        assert (directory / LOG_NAME).read_bytes() == damaged
