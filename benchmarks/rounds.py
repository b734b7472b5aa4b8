"""Rounds that alternate which side goes first, for the benchmarks that compare sides on one engine.

A side that always ran first (or second) would always meet the same state: caches warm or cold,
the other side's garbage still to collect, clocks before or after they settle. Alternating the
order puts each side first in half the rounds, so the per-round ratios the benchmarks report
compare like with like.

Owns: the order of the sides in each round. Does not own: what a side runs or what is measured
(each benchmark).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def alternating(rounds: int, sides: Iterable[T]) -> Iterator[tuple[int, list[T]]]:
    """Each round's index (from 0) and its sides in the order they run: as given in even rounds,
    reversed in odd ones."""
    order = list(sides)
    for r in range(rounds):
        yield r, order if r % 2 == 0 else order[::-1]
