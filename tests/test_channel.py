"""The driver's end of the engines' data path (actors/channel.py): frames reach the handle whose
identity sent them, and only from an engine that was handed that identity."""

from __future__ import annotations

import asyncio
import resource
import threading

import zmq

from actors.channel import Channel
from rollout.wire import RESULTS, FrameSocket


async def test_frames_reach_the_handle_of_the_identity_that_sent_them():
    channel = Channel()
    got: list[tuple[bytes, bytes]] = []
    arrived = asyncio.Event()
    identity = channel.register(0, lambda kind, payload: (got.append((kind, payload)), arrived.set()))
    engine = FrameSocket(zmq.DEALER, identity)
    engine.sock.connect(channel.open())
    try:
        engine.send_multipart([RESULTS, b"x"])
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
            s = FrameSocket(zmq.DEALER, f"0.{k}".encode())
            s.sock.connect(address)
            strangers.append(s)
            s.send_multipart([RESULTS, b"forged"])
        engine = FrameSocket(zmq.DEALER, identity)
        engine.sock.connect(address)
        engine.send_multipart([RESULTS, b"real"])
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


class Numbered:
    """An end's `on_frames` for frames numbered 0..count-1: `await arrived()` until all came; `got` in order."""

    def __init__(self, count: int):
        self.count, self.got, self._all = count, [], asyncio.Event()

    def __call__(self, frames: list[bytes]) -> None:
        self.got.append(frames[0])
        if len(self.got) == self.count:
            self._all.set()

    async def arrived(self) -> None:
        await asyncio.wait_for(self._all.wait(), timeout=60)
        assert self.got == [str(i).encode() for i in range(self.count)]


async def test_a_burst_larger_than_one_read_arrives_whole():
    """A read callback takes at most `FrameSocket.BURST` frames, then gives the loop a turn; zmq's
    fd (edge-triggered) will not say again that the rest is there, so the reader must look again."""
    count = 5 * FrameSocket.BURST
    receiver, sender = FrameSocket(zmq.PULL), FrameSocket(zmq.PUSH)
    port = receiver.sock.bind_to_random_port("tcp://127.0.0.1")
    sender.sock.connect(f"tcp://127.0.0.1:{port}")
    frames = Numbered(count)
    receiver.start(frames)
    try:
        for i in range(count):  # all at once, before the receiver reads any
            sender.send_multipart([str(i).encode()])
        await frames.arrived()
    finally:
        sender.close()
        receiver.close()


async def test_frames_that_arrive_while_this_end_sends_are_read():
    """zmq's fd is edge-triggered, and a send takes in frames that arrived meanwhile without the fd
    saying so: an end that reads only when the fd fires stalls with answers waiting. The echo end
    here is a thread answering each frame at once, so answers arrive while this end sends."""
    count = 3000
    here = FrameSocket(zmq.DEALER, b"d")
    echo = zmq.Context.instance().socket(zmq.ROUTER)
    port = echo.bind_to_random_port("tcp://127.0.0.1")
    here.sock.connect(f"tcp://127.0.0.1:{port}")

    def echoing() -> None:
        for _ in range(count):
            echo.send_multipart(echo.recv_multipart())

    thread = threading.Thread(target=echoing, daemon=True)
    thread.start()
    echoed = Numbered(count)
    here.start(echoed)
    try:
        for i in range(count):
            here.send_multipart([str(i).encode()])
            if i % 50 == 0:
                await asyncio.sleep(0.001)
        await echoed.arrived()
    finally:
        thread.join(timeout=10)
        here.close()
        echo.close(linger=0)
