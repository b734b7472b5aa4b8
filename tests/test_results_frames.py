"""An engine actor's results frames (`policies.group_calls`): a sample that ends after a quiet spell
goes up at the end of its turn; under load the samples that end within `FRAME_GAP_S` of the last
frame go up together, not a frame per turn (each frame wakes the driver, which on CPU engines
preempts the engine)."""

from __future__ import annotations

import asyncio

import msgspec

from policies import group_calls
from policies.group_calls import RESULTS, GroupCalls
from rollout.types import GroupResult


class Sock:
    def __init__(self) -> None:
        self.frames: list[list[str]] = []

    def send_multipart(self, parts: list[bytes]) -> None:
        assert parts[0] == RESULTS
        self.frames.append([r.key for r in msgspec.msgpack.decode(parts[1], type=list[GroupResult])])


def engine() -> tuple[GroupCalls, Sock]:
    calls, sock = GroupCalls(), Sock()
    calls.engine_id, calls._sock = 0, sock
    return calls, sock


async def turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_samples_ending_within_the_gap_of_the_last_frame_go_up_together(monkeypatch):
    monkeypatch.setattr(group_calls, "FRAME_GAP_S", 3600.0)  # the next frame is an hour away
    calls, sock = engine()
    calls._post(GroupResult(key="a"))
    await turns()
    assert sock.frames == [["a"]], "the first after a quiet spell goes at the end of its turn"
    calls._post(GroupResult(key="b"))
    await turns()
    calls._post(GroupResult(key="c"))
    await turns()
    assert sock.frames == [["a"]], "before, b went alone at the end of its turn"
    calls._flush()  # what the timer does once the gap has passed
    assert sock.frames == [["a"], ["b", "c"]]


async def test_once_the_gap_has_passed_each_turns_samples_go_at_its_end(monkeypatch):
    monkeypatch.setattr(group_calls, "FRAME_GAP_S", 0.0)
    calls, sock = engine()
    for key in "abc":
        calls._post(GroupResult(key=key))
        calls._post(GroupResult(key=key.upper()))
        await turns()
    assert sock.frames == [["a", "A"], ["b", "B"], ["c", "C"]]


async def test_results_without_a_driver_wait_for_it_and_go_in_one_frame(monkeypatch):
    monkeypatch.setattr(group_calls, "FRAME_GAP_S", 0.0)
    calls, sock = engine()
    calls._sock = None
    for key in "ab":
        calls._post(GroupResult(key=key))
        await turns()
    calls._sock = sock
    calls._flush()  # as `serve` does once connected
    assert sock.frames == [["a", "b"]]
