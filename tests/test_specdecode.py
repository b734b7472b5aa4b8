"""Speculative decoding figures: window differences, per-engine and summed ratios, hand-computed."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from rollout.log import configure
from rollout.metrics.specdecode import SpecDecodeMeter, aggregate, delta, derive, window
from rollout.types import SpecCounters
from tests.support.fakes import FakePool

BEFORE = [
    SpecCounters(
        engine_id=0,
        num_speculative_tokens=3,
        drafts=10,
        draft_tokens=30,
        accepted_tokens=12,
        accepted_per_pos=[7, 4, 1],
    )
]
AFTER = [
    SpecCounters(
        engine_id=0,
        num_speculative_tokens=3,
        drafts=30,
        draft_tokens=90,
        accepted_tokens=42,
        accepted_per_pos=[20, 14, 8],
    ),
    # engine 1 has no reading before the window: it counts from zero
    SpecCounters(
        engine_id=1, num_speculative_tokens=3, drafts=5, draft_tokens=15, accepted_tokens=0, accepted_per_pos=[0, 0, 0]
    ),
]


def test_delta_is_the_difference_of_every_count():
    d = delta(AFTER[0], BEFORE[0])
    assert (d.drafts, d.draft_tokens, d.accepted_tokens, d.accepted_per_pos) == (20, 60, 30, [13, 10, 7])
    assert d.engine_id == 0 and d.num_speculative_tokens == 3


def test_per_engine_figures():
    report = window(BEFORE, AFTER)
    e0, e1 = report.engines
    # engine 0: 20 drafts, 60 draft tokens, 30 accepted, [13, 10, 7] by position
    assert e0.engine_id == 0
    assert e0.mean_acceptance_length == pytest.approx(1 + 30 / 20) == 2.5
    assert e0.acceptance_rate == pytest.approx(0.5)
    assert e0.per_position_rate == pytest.approx([0.65, 0.5, 0.35])
    # engine 1: drafted, accepted nothing
    assert (e1.engine_id, e1.drafts, e1.accepted_tokens) == (1, 5, 0)
    assert e1.mean_acceptance_length == 1.0 and e1.acceptance_rate == 0.0 and e1.per_position_rate == [0.0, 0.0, 0.0]


def test_summed_counts_first_then_ratios():
    total = window(BEFORE, AFTER).total
    assert total.engine_id is None
    assert (total.drafts, total.draft_tokens, total.accepted_tokens, total.accepted_per_pos) == (
        25,
        75,
        30,
        [13, 10, 7],
    )
    assert total.mean_acceptance_length == pytest.approx(1 + 30 / 25)  # 2.2, not the mean of 2.5 and 1.0
    assert total.acceptance_rate == pytest.approx(30 / 75)  # 0.4, not the mean of 0.5 and 0.0
    assert total.per_position_rate == pytest.approx([13 / 25, 10 / 25, 7 / 25])


def test_per_position_counts_add_up_to_accepted():
    for m in [*window(BEFORE, AFTER).engines, window(BEFORE, AFTER).total]:
        assert sum(m.accepted_per_pos) == m.accepted_tokens


def test_zero_drafts_gives_no_ratios():
    m = derive(SpecCounters(num_speculative_tokens=3, accepted_per_pos=[0, 0, 0]))
    assert (m.drafts, m.draft_tokens, m.accepted_tokens) == (0, 0, 0)
    assert m.mean_acceptance_length is None and m.acceptance_rate is None and m.per_position_rate is None
    same = window(AFTER, AFTER)
    assert same.total.drafts == 0 and same.total.mean_acceptance_length is None
    assert all(e.acceptance_rate is None for e in same.engines)


def test_engines_without_speculation_report_zeros():
    report = window([], [SpecCounters(engine_id=0), SpecCounters(engine_id=1)])
    assert report.num_speculative_tokens == 0
    assert report.total.drafts == 0 and report.total.per_position_rate is None


def test_position_lists_of_different_lengths_are_padded():
    total = aggregate([
        SpecCounters(drafts=2, draft_tokens=4, accepted_tokens=3, accepted_per_pos=[2, 1]),
        SpecCounters(drafts=1, draft_tokens=3, accepted_tokens=3, accepted_per_pos=[1, 1, 1]),
    ])  # fmt: skip
    assert total.accepted_per_pos == [3, 2, 1] and total.accepted_tokens == 6


def test_counters_going_back_or_other_engine_are_errors():
    with pytest.raises(ValueError, match="went back"):
        delta(BEFORE[0], AFTER[0])
    with pytest.raises(ValueError, match="engines 0 and 1"):
        delta(AFTER[1], BEFORE[0])


def test_a_restarted_engine_counts_from_its_restart():
    # engine 0's counters went back (a restarted engine starts from zero): its window is what it has now
    restarted = SpecCounters(
        engine_id=0, num_speculative_tokens=3, drafts=4, draft_tokens=12, accepted_tokens=3, accepted_per_pos=[2, 1, 0]
    )
    report = window(AFTER, [restarted, AFTER[1]])
    assert report.restarted == [0]
    assert (report.engines[0].drafts, report.engines[0].accepted_tokens) == (4, 3)
    assert report.engines[1].drafts == 0 and report.total.drafts == 4


def test_an_engine_missing_from_the_later_reading_is_left_out():
    report = window(AFTER, AFTER[1:])
    assert [e.engine_id for e in report.engines] == [1] and report.total.drafts == 0


def test_step_counts_one_engine_step():
    c = SpecCounters(num_speculative_tokens=2)
    c.add(3, 6, 4, [3, 1])
    c.add(1, 2, 2, [1, 1])
    assert (c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_pos) == (4, 8, 6, [4, 2])


class _Holder:  # what the meter needs of a RolloutEngine: `.pool.engines`
    def __init__(self, pool: FakePool):
        self.pool = pool


async def test_meter_reports_each_window_and_logs_it():
    pool = FakePool(2)
    e0, e1 = pool.engines
    e0.spec = SpecCounters(
        engine_id=0,
        num_speculative_tokens=3,
        drafts=10,
        draft_tokens=30,
        accepted_tokens=12,
        accepted_per_pos=[7, 4, 1],
    )
    meter = await SpecDecodeMeter.open(_Holder(pool))
    e0.spec = AFTER[0]
    e1.spec = AFTER[1]
    configure("info")  # an earlier test may have left the level at warning
    with capture_logs() as logs:
        first = await meter.step(7)
    assert first.total.drafts == 25 and first.total.mean_acceptance_length == pytest.approx(2.2)
    (event,) = [e for e in logs if e["event"] == "spec decode"]
    assert event["step"] == 7 and event["drafts"] == 25 and event["acceptance_rate"] == pytest.approx(0.4)
    assert event["per_engine"][0] == (20, 2.5, 0.5)
    # nothing happened since: an empty window, not the cumulative counts again
    second = await meter.read()
    assert second.total.drafts == 0 and second.total.mean_acceptance_length is None and second.seconds >= 0


async def test_meter_leaves_dead_engines_out():
    pool = FakePool(2)
    meter = await SpecDecodeMeter.open(_Holder(pool))
    pool.engines[0].spec = SpecCounters(
        engine_id=0, drafts=4, draft_tokens=8, accepted_tokens=2, accepted_per_pos=[2, 0]
    )
    pool.engines[1].dead = True
    report = await meter.read()
    assert [e.engine_id for e in report.engines] == [0] and report.total.acceptance_rate == pytest.approx(0.25)


def test_bench_rows_show_summed_and_per_engine_figures():
    import msgspec

    from rollout.bench.table import spec_decode_rows

    ours = msgspec.to_builtins(window(BEFORE, AFTER))
    empty = msgspec.to_builtins(window(AFTER, AFTER))  # zero drafts: dashes, not a crash
    text = "\n".join(spec_decode_rows({"method": "ngram"}, ours, empty))
    assert "ngram, 3 draft tokens per step" in text
    assert "2.200" in text and "40.0%" in text and "0.520 0.400 0.280" in text  # summed
    assert "e0 length/rate/pos" in text and "2.500 / 50.0% / 0.650 0.500 0.350  (20 drafts)" in text
    assert "e1 length/rate/pos" in text and "1.000 / 0.0%" in text
    assert "raw vLLM -" in text
