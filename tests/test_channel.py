"""The driver's end of the engines' data path (actors/channel.py): frames reach the handle whose
identity sent them, and only from an engine that was handed that identity."""

from __future__ import annotations

import asyncio
import resource

import zmq

from actors.channel import Channel
from policies.group_calls import RESULTS, socket


async def test_frames_reach_the_handle_of_the_identity_that_sent_them():
    channel = Channel()
    got: list[tuple[bytes, bytes]] = []
    arrived = asyncio.Event()
    identity = channel.register(0, lambda kind, payload: (got.append((kind, payload)), arrived.set()))
    engine = socket(zmq.DEALER, identity)
    engine.connect(channel.open())
    try:
        await engine.send_multipart([RESULTS, b"x"])
        await asyncio.wait_for(arrived.wait(), timeout=30)
        assert got == [(RESULTS, b"x")]
    finally:
        engine.close()
        channel.close()


async def test_a_stranger_cannot_speak_for_an_engine_by_guessing_its_identity():
    """An identity is a secret the engine gets through Ray: a stranger that reaches the port and
    tries engine 0's likely names (`0.<k>`, the first 1000 handles a process opens) has every frame
    dropped; the real engine's frame is the only one that arrives."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))  # ~3 fds per stranger
    channel = Channel()
    got: list[bytes] = []
    arrived = asyncio.Event()
    identity = channel.register(0, lambda kind, payload: (got.append(payload), arrived.set()))
    address = channel.open()
    strangers = []
    try:
        for k in range(1000):
            s = socket(zmq.DEALER, f"0.{k}".encode())
            s.connect(address)
            strangers.append(s)
            await s.send_multipart([RESULTS, b"forged"])
        engine = socket(zmq.DEALER, identity)
        engine.connect(address)
        await engine.send_multipart([RESULTS, b"real"])
        strangers.append(engine)
        await asyncio.wait_for(arrived.wait(), timeout=60)

        async def all_read() -> None:
            while channel.dropped + len(got) < len(strangers):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(all_read(), timeout=60)
        assert got == [b"real"] and channel.dropped == 1000, got[:3]
    finally:
        for s in strangers:
            s.close()
        channel.close()
