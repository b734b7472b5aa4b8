"""Speculative decoding figures: per-engine counters, windows over them, and what they mean.

Owns: `SpecCounters` (one engine's cumulative counts, as vLLM's scheduler reports them each
step: drafts, draft tokens, accepted tokens, accepted tokens per draft position), the window
math (`delta`, `aggregate`, `derive`, `window`) and `SpecDecodeMeter`, which reads every engine
of a running `RolloutEngine` and reports the figures since its previous reading.
Does not own: collecting the counts (each engine does, in `policies/vllm_policy.py`, from its
own vLLM stat logger; Prometheus metrics are process-global, so they are not used).

Figures over a window (one bench run, one learner step), per engine and over all engines:
- mean acceptance length = 1 + accepted / drafts (tokens per verification step, bonus included);
- acceptance rate = accepted / draft tokens;
- per-position rate[i] = accepted at draft position i / drafts.
Over several engines the counts are summed first and the ratios derived from the sums (never
an average of per-engine ratios). A ratio with a zero denominator is None, not NaN.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from msgspec import Struct, field

from rollout.aio import fan_out
from rollout.errors import EngineClosedError, EngineDeadError
from rollout.log import get_logger
from rollout.types import SpecCounters

if TYPE_CHECKING:
    from rollout.scheduling.protocols import EnginePool

log = get_logger(__name__)


class SpecDecodeMetrics(Struct):
    """Counts over a window and the figures derived from them; `engine_id` None: all engines."""

    engine_id: int | None = None
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    mean_acceptance_length: float | None = None  # 1 + accepted / drafts
    acceptance_rate: float | None = None  # accepted / draft_tokens
    per_position_rate: list[float] | None = None  # accepted_per_pos[i] / drafts


class SpecDecodeReport(Struct):
    """One window: each engine's figures, and the figures of their summed counts."""

    engines: list[SpecDecodeMetrics] = field(default_factory=list)
    total: SpecDecodeMetrics = field(default_factory=SpecDecodeMetrics)
    num_speculative_tokens: int = 0
    seconds: float = 0.0  # window length (reading to reading)
    restarted: list[int] = field(default_factory=list)  # engines whose counts started again from zero


def delta(after: SpecCounters, before: SpecCounters) -> SpecCounters:
    """Counts of one engine between two readings. ValueError if they are not of one engine or go back."""
    if after.engine_id != before.engine_id:
        raise ValueError(f"readings of engines {before.engine_id} and {after.engine_id} do not make a window")
    d = SpecCounters(
        engine_id=after.engine_id,
        num_speculative_tokens=after.num_speculative_tokens,
        drafts=after.drafts - before.drafts,
        draft_tokens=after.draft_tokens - before.draft_tokens,
        accepted_tokens=after.accepted_tokens - before.accepted_tokens,
        accepted_per_pos=_add_lists(after.accepted_per_pos, [-x for x in before.accepted_per_pos]),
    )
    if min(d.drafts, d.draft_tokens, d.accepted_tokens, *d.accepted_per_pos, 0) < 0:
        raise ValueError(f"engine {after.engine_id}: counters went back (was the engine restarted?)")
    return d


def aggregate(counts: Sequence[SpecCounters]) -> SpecCounters:
    """The summed counts of several engines (position lists summed element-wise)."""
    total = SpecCounters(
        engine_id=-1, num_speculative_tokens=max((c.num_speculative_tokens for c in counts), default=0)
    )
    for c in counts:
        total.add(c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_pos)
    return total


def derive(c: SpecCounters, engine_id: int | None = None) -> SpecDecodeMetrics:
    """The figures of one set of counts (see the module docstring); None where nothing was drafted."""
    return SpecDecodeMetrics(
        engine_id=engine_id,
        drafts=c.drafts,
        draft_tokens=c.draft_tokens,
        accepted_tokens=c.accepted_tokens,
        accepted_per_pos=list(c.accepted_per_pos),
        mean_acceptance_length=1 + c.accepted_tokens / c.drafts if c.drafts else None,
        acceptance_rate=c.accepted_tokens / c.draft_tokens if c.draft_tokens else None,
        per_position_rate=[a / c.drafts for a in c.accepted_per_pos] if c.drafts else None,
    )


def window(before: Sequence[SpecCounters], after: Sequence[SpecCounters], seconds: float = 0.0) -> SpecDecodeReport:
    """The report between two readings of the same engines, per engine and summed.

    An engine in `after` but not in `before` counts from zero; one missing from `after` (dead)
    is left out of the window; one whose counts went back was restarted in between: its window
    counts from the restart, and it is listed in `restarted`.
    """
    start = {c.engine_id: c for c in before}
    deltas, restarted = [], []
    for c in after:
        zero = SpecCounters(engine_id=c.engine_id)
        try:
            deltas.append(delta(c, start.get(c.engine_id, zero)))
        except ValueError:
            deltas.append(delta(c, zero))
            restarted.append(c.engine_id)
    total = aggregate(deltas)
    return SpecDecodeReport(
        engines=[derive(d, d.engine_id) for d in deltas],
        total=derive(total),
        num_speculative_tokens=total.num_speculative_tokens,
        seconds=seconds,
        restarted=restarted,
    )


class Pooled(Protocol):
    """What the meter reads of the engine: its running engines (`RolloutEngine` is one)."""

    pool: EnginePool | None


class SpecDecodeMeter:
    """Speculative decoding figures of a running `RolloutEngine`, window by window.

        meter = await SpecDecodeMeter.open(engine)     # first reading
        for step in range(steps):
            batch = await engine.batches(groups=8)
            ...                                        # learn, update_weights
            figures = await meter.step(step)           # since the previous call; logged

    `read()` gives the figures since the previous reading (or `open`) and starts the next
    window; `step()` does the same and logs them as one structlog event ("spec decode", info).
    Any object with `.pool.engines` (each with `spec_counters()`) works in place of the engine (`Pooled`).
    Engines that are dead are left out of the window; a restarted one counts from its restart.
    """

    def __init__(self, engine: Pooled):
        self._engine = engine
        self._last: list[SpecCounters] = []
        self._at = 0.0

    @classmethod
    async def open(cls, engine: Pooled) -> SpecDecodeMeter:
        meter = cls(engine)
        await meter.read()
        return meter

    async def snapshot(self) -> list[SpecCounters]:
        """Every live engine's cumulative counters now."""
        pool = self._engine.pool
        if pool is None:
            raise EngineClosedError("spec decode meter: the engine is not running")
        engines = pool.engines
        got = await fan_out(e.spec_counters() for e in engines)
        for r in got:
            if isinstance(r, BaseException) and not isinstance(r, EngineDeadError):
                raise r
        return [r for r in got if isinstance(r, SpecCounters)]

    async def read(self) -> SpecDecodeReport:
        """Figures since the previous reading; this reading starts the next window."""
        now, at = await self.snapshot(), asyncio.get_running_loop().time()
        report = window(self._last, now, at - self._at if self._last else 0.0)
        self._last, self._at = now, at
        return report

    async def step(self, step: int | None = None) -> SpecDecodeReport:
        """`read()`, logged as one event with the summed figures and each engine's."""
        report = await self.read()
        t = report.total
        log.info(
            "spec decode",
            step=step,
            drafts=t.drafts,
            draft_tokens=t.draft_tokens,
            accepted_tokens=t.accepted_tokens,
            mean_acceptance_length=_round(t.mean_acceptance_length),
            acceptance_rate=_round(t.acceptance_rate),
            per_position_rate=[round(x, 4) for x in t.per_position_rate] if t.per_position_rate else None,
            per_engine={
                m.engine_id: (m.drafts, _round(m.mean_acceptance_length), _round(m.acceptance_rate))
                for m in report.engines
            },
            restarted=report.restarted or None,
        )
        return report


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _add_lists(a: Sequence[int], b: Sequence[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]
