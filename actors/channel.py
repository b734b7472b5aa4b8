"""The engines' data path on the driver: one zmq ROUTER socket that every engine's groups cross.

A Ray call costs the driver ~300-450 us of CPU, its event loop's and Ray's IO thread's, whatever it
carries (a streaming generator's item costs as much), and at 256 engines an engine starts and
finishes a group or two a second: batching Ray calls per engine had nothing to batch, and two calls
per group were most of the driver's CPU (README, "Past one driver"). So groups travel as vLLM's
own front end talks to its engine core: over zmq, msgpack frames. Each engine actor's `serve` call
(`policies.group_calls`: a Ray call that lasts as long as the engine, so its failure is the
engine's death) connects a DEALER socket, named by its handle's identity, to this ROUTER socket
and says hello; from then on submits and cancels go down and finished samples come up as frames.
Ray keeps what is not per group: start, progress reports, weight updates, stats, kill.
An identity is 128 random bits handed to the engine through Ray: whoever else reaches the
port (on a cluster it is the driver node's address) has every frame dropped and counted.

Owns: the socket (bound on first use, in the running loop), its one reader task, and the handle
each identity's frames go to. Does not own: what the frames mean (`actors.handle.RayEngine`).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable

import zmq
import zmq.asyncio

from policies.group_calls import socket
from rollout.log import get_logger

log = get_logger(__name__)


class Channel:
    """The ROUTER end, on `host` (an address the engines' machines reach: the driver's node IP)."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.address = ""
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._peers: dict[bytes, Callable[[bytes, bytes], None]] = {}  # identity -> its handle's on_frame
        self.dropped = 0  # frames from no registered identity (a closed handle's engine, or a stranger)

    def open(self) -> str:
        """The address engines connect to; binds the socket on first use."""
        if self._sock is None:
            sock = socket(zmq.ROUTER)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a frame to an engine not connected raises, not vanishes
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a handle's next `serve` call takes its identity over
            port = sock.bind_to_random_port(f"tcp://{self.host}")
            self._sock, self.address = sock, f"tcp://{self.host}:{port}"
            self._reader = asyncio.ensure_future(self._read())
        return self.address

    def register(self, engine_id: int, on_frame: Callable[[bytes, bytes], None]) -> bytes:
        """A new identity for engine `engine_id`'s handle; its engine's frames go to `on_frame(kind, payload)`."""
        identity = f"{engine_id}.{secrets.token_hex(16)}".encode()  # a secret, handed to the engine through Ray
        self._peers[identity] = on_frame
        return identity

    def unregister(self, identity: bytes) -> None:
        self._peers.pop(identity, None)

    def send(self, identity: bytes, kind: bytes, payload: bytes) -> None:
        """Send a frame now. Raises zmq.ZMQError when the engine is not connected (EHOSTUNREACH)."""
        assert self._sock is not None, "the channel is not open"
        sent = self._sock.send_multipart([identity, kind, payload], copy=False)
        if sent.done() and (error := sent.exception()) is not None:  # no high-water mark: a send never waits
            raise error

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 3 or (on_frame := self._peers.get(frames[0])) is None:  # a closed handle's engine: nobody waits
                self.dropped += 1
                continue
            try:
                on_frame(frames[1], frames[2])
            except Exception as e:  # a bug in one handle must not stop every engine's frames
                log.error("engine frame dropped", identity=frames[0].decode(errors="replace"), error=f"{type(e).__name__}: {e}")

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock = self._reader = None
        self._peers.clear()
