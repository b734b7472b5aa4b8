"""The data path's wire protocol: the frames between the driver and each engine actor, in one place
both ends import (the driver's handle, `actors.handle`; the engine actor, `policies.group_calls`).
The HTTP front ends' backend calls (`rollout.serve.frontends`, a protocol of their own) travel on a
`FrameSocket` too.

A frame is two parts, `[kind, payload]`; the payload is msgpack (per-token data packed,
`rollout.packed.encode`). The driver's end is a ROUTER socket (`actors.channel`), each engine's a
DEALER named by its handle's identity. The kinds, by who sends them:

- `HELLO` (engine, empty): connected; the driver sends this engine's groups from now on.
- `SUBMIT` (driver): groups to start, `[(key, [Request])]`.
- `CANCEL` (driver): group keys to stop, `[key]`; a cancelled group never comes back as results.
- `RESULTS` (engine): finished samples, `[GroupResult]`, each as soon as it finishes, the ones of
  one turn of the engine's event loop in one frame; a group that failed comes back as one with
  its error.
- `DELTAS` (engine): streamed samples' new tokens, `[Delta]`, one frame per engine step.
- `PROGRESS` (driver, empty; engine, the report): a progress report asked for, and answered with
  the running samples as far as they are exact (msgpack Trajectories). Answers come in the
  order asked.
- `FAILED` (engine): why a progress report cannot be made (UTF-8 text); the engine is dead.
- `CALL` (driver): one of `CALLS`, `[id, name, args]`; a name of None gives up call `id` (the
  engine cancels it).
- `ANSWER` (engine): `[id, error, value]`; `error` is None or `[type name, message]`.

Owns: the frame kinds, the call table (`CALLS`) and the socket both ends read frames from
(`FrameSocket`). Does not own: what each end does with a frame (`actors.handle.RayEngine`,
`policies.group_calls.GroupCalls`), the types a payload holds (`rollout.types`) or how per-token
data is packed (`rollout.packed`), the ROUTER end's peers (`actors.channel`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq

HELLO, SUBMIT, CANCEL, RESULTS = b"h", b"s", b"c", b"r"  # a frame's kind, its first part
PROGRESS, FAILED = b"p", b"f"  # a progress report asked for and answered; or why it cannot be
DELTAS = b"d"  # streamed samples' new tokens, one frame per engine step (`rollout.types.Delta`)
CALL, ANSWER = b"k", b"a"  # one of `CALLS` asked for (msgpack `[id, name, args]`; name None: cancel it) and answered
# The engine's per-update calls that travel the data path once it is connected (a Ray call costs
# each end ~0.3 ms of CPU, 2 x 256 per weight update at 256 engines); Ray carries them before, and
# whatever msgpack cannot carry (an ObjectRef to weights in the object store).
CALLS = frozenset({"stage_weights", "drop_weights", "commit_weights", "init_transfer", "start_transfer", "transfer",
                   "finish_transfer", "pause_generation", "resume_generation"})  # fmt: skip


class FrameSocket:
    """A zmq socket of the data path, run from this thread's event loop without zmq.asyncio.

    zmq.asyncio makes a future and a loop callback or two for every send and every receive, a cost
    the driver's event loop pays per frame at hundreds of engines (docs/guides/scaling.md), and an
    engine actor's front end per results frame. Here a send goes out at
    once (no high-water mark: a frame is never dropped or held back for one, so it never waits),
    and the frames that arrive go to `on_frames`, in order, from a reader callback on zmq's
    notification fd. That fd is edge-triggered (it says "something changed", and a send may take
    in arrived frames without it saying so), so the reader reads until zmq has nothing (EAGAIN),
    and every send has the reader look again on the loop's next turn. No linger: a closed
    engine's frames matter to no one.
    """

    BURST = 256  # frames read per callback before the loop's other work gets a turn

    def __init__(self, kind: int, identity: bytes | None = None):
        sock = zmq.Context.instance().socket(kind)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        self.sock = sock  # bind, connect and options before `start`
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_frames: Callable[[list[bytes]], None] | None = None
        self._looking = False  # a look at the socket is on the loop already

    def start(self, on_frames: Callable[[list[bytes]], None]) -> None:
        """Hand every frame that arrives from now on to `on_frames(frames)`, on this event loop."""
        self._loop, self._on_frames = asyncio.get_running_loop(), on_frames
        self._loop.add_reader(self.sock.getsockopt(zmq.FD), self._read)
        self._look()

    def send_multipart(self, frames: list[bytes]) -> None:
        """Send now. Raises zmq.ZMQError where zmq refuses (a ROUTER's peer not connected: EHOSTUNREACH)."""
        self.sock.send_multipart(frames, zmq.NOBLOCK)
        if self._on_frames is not None:
            self._look()

    def _look(self) -> None:
        if not self._looking and self._loop is not None:
            self._looking = True
            self._loop.call_soon(self._read)

    def _read(self) -> None:
        self._looking = False
        if self.sock.closed or self._on_frames is None:
            return
        for _ in range(self.BURST):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_frames(frames)
            if self.sock.closed:  # `on_frames` closed it
                return
        self._look()  # more may be waiting: read on after the loop's other work

    def close(self) -> None:
        if not self.sock.closed:
            if self._on_frames is not None and self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self.sock.getsockopt(zmq.FD))
            self.sock.close(linger=0)
