"""The engines' data path on the driver: one zmq ROUTER socket that every engine's groups cross.

A Ray call costs the driver ~300-450 us of CPU, its event loop's and Ray's IO thread's, whatever it
carries (a streaming generator's item costs as much), and at 256 engines an engine starts and
finishes a group or two a second: batching Ray calls per engine had nothing to batch, and two calls
per group were most of the driver's CPU (docs/guides/scaling.md). So groups travel as vLLM's
own front end talks to its engine core: over zmq, msgpack frames. Each engine actor's `serve` call
(`policies.group_calls`: a Ray call that lasts as long as the engine, so its failure is the
engine's death) connects a DEALER socket, named by its handle's identity, to this ROUTER socket
and says hello; from then on submits and cancels go down and finished samples come up as frames
(`rollout.wire`), and so do progress reports and the per-update calls. Ray keeps the rest: start,
the `serve` call, stats, kill.
An identity is 128 random bits handed to the engine through Ray: whoever else reaches the
port (on a cluster it is the driver node's address) has every frame dropped and counted.

Owns: the socket (bound on first use, in the running loop, read by a loop callback), and the handle
each identity's frames go to. Does not own: the frames (`rollout.wire`) or what they mean to the
driver (`actors.handle.RayEngine`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import zmq

from rollout.log import get_logger
from rollout.wire import FrameSocket

log = get_logger(__name__)
BACKLOG = 4096  # pending connections the socket holds (the kernel caps it at net.core.somaxconn)


class Channel:
    """The ROUTER end, on `host` (an address the engines' machines reach: the driver's node IP)."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.address = ""
        self._sock: FrameSocket | None = None
        self._peers: dict[bytes, Callable[[bytes, bytes], None]] = {}  # identity -> its handle's on_frame
        self.dropped = 0  # frames from no registered identity (a closed handle's engine, or a stranger)

    def open(self) -> str:
        """The address engines connect to; binds the socket on first use (in the running loop)."""
        if self._sock is None:
            sock = FrameSocket(zmq.ROUTER)
            sock.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a frame to an engine not connected raises, not vanishes
            sock.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a handle's next `serve` call takes its identity over
            # Every engine connects at once when a cluster starts: with zmq's listen backlog (100) the
            # connections past it wait for TCP's SYN retries (1, 3, 7, 15, 31 s; 1000 at once here: 31 s).
            sock.sock.setsockopt(zmq.BACKLOG, BACKLOG)
            port = sock.sock.bind_to_random_port(f"tcp://{self.host}")
            sock.start(self._frames)
            self._sock, self.address = sock, f"tcp://{self.host}:{port}"
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
        self._sock.send_multipart([identity, kind, payload])

    def _frames(self, frames: list[bytes]) -> None:
        if (
            len(frames) != 3 or (on_frame := self._peers.get(frames[0])) is None
        ):  # a closed handle's engine: nobody waits
            self.dropped += 1
            return
        try:
            on_frame(frames[1], frames[2])
        except Exception as e:  # a bug in one handle must not stop every engine's frames
            log.error(
                "engine frame dropped", identity=frames[0].decode(errors="replace"), error=f"{type(e).__name__}: {e}"
            )

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self._peers.clear()
