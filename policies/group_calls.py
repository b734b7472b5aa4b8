"""The engine actor's group calls, over the driver's data path (`actors.channel`): `serve` connects
this engine to the driver's zmq socket for as long as the engine lives; groups arrive there in
bulk (a submit frame), each runs in a task of its own, and their samples leave in bulk (a results
frame per turn of this engine's event loop), each as soon as it finishes (not when its group
does: the driver gives the sample's slot on this engine to the next request at once). A streamed
sample's new tokens leave after every engine step, every streamed sample's in one deltas frame.

Owns: the submitted groups' tasks (a cancel frame stops them) and their results until sent. Every
task, unless the driver cancelled it, ends in one `GroupResult` per sample or in one with the
error that ended it: nothing the driver waits for can vanish while the engine lives (and when it
dies, the driver's `serve` call fails). Progress reports the driver asks for on the socket are
answered there, and so are the per-update calls of `CALLS`. Does not own: running a group
(`VLLMPolicy.stream_group`; an engine without one runs `finish_group` and sends its samples
together), what a report holds (`progress`), the frames and the socket (`rollout.wire`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq

from rollout.errors import EngineDeadError
from rollout.packed import encode
from rollout.types import Delta, GroupResult, Request, Trajectory
from rollout.wire import ANSWER, CALL, CALLS, CANCEL, DELTAS, FAILED, HELLO, PROGRESS, RESULTS, SUBMIT, FrameSocket


class GroupCalls:
    engine_id: int

    def __init__(self) -> None:
        self._groups: dict[str, asyncio.Task] = {}  # key -> the task running that submitted group
        self._results: list[GroupResult] = []  # finished samples not sent yet
        self._sock: FrameSocket | None = None  # the driver's data path, while `serve` runs
        self._calls: dict[int, asyncio.Task] = {}  # id -> the task answering that call of the driver's
        self._stream_keys: dict[str, str] = {}  # a streamed sample's request id -> its group's key

    async def finish_group(self, requests: list[Request]) -> list[Trajectory]:
        raise NotImplementedError

    async def stream_group(self, requests: list[Request]) -> AsyncIterator[Trajectory]:
        """A group's trajectories as each finishes; cancelling aborts the rest. By default all at once."""
        for traj in await self.finish_group(requests):
            yield traj

    async def serve(self, address: str, identity: bytes) -> None:
        """The driver's data path to this engine (`actors.channel`), until the driver ends this call:
        connect to `address` as `identity`, say hello, then run its submit and cancel frames."""
        sock = FrameSocket(zmq.DEALER, identity)
        sock.sock.connect(address)
        failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def on_frames(frames: list[bytes]) -> None:
            try:
                kind, payload = frames
                if kind == SUBMIT:
                    self.submit(payload)
                elif kind == CANCEL:
                    self.cancel(msgspec.msgpack.decode(payload, type=list[str]))
                elif kind == PROGRESS:
                    self.report(sock)
                elif kind == CALL:
                    self.call(sock, payload)
            except Exception as e:  # a frame this end cannot take: the call ends, and the driver sees why
                if not failed.done():
                    failed.set_exception(e)

        self._sock = sock
        try:
            sock.start(on_frames)
            sock.send_multipart([HELLO, b""])
            self._flush()  # what finished while no driver listened
            await failed  # until the driver ends this call, or a frame fails it
        finally:
            if self._sock is sock:
                self._sock = None
            sock.close()

    def progress(self) -> bytes:
        raise NotImplementedError

    def report(self, sock: FrameSocket) -> None:
        """Answer the driver's health watch on the data path (a Ray call per report cost the driver
        as much as a group): this engine's progress report, or why there is none."""
        try:
            frame = [PROGRESS, self.progress()]
        except Exception as e:  # vLLM's engine core died (EngineDeadError): the driver kills this engine
            frame = [FAILED, f"engine {self.engine_id}: health report failed: {type(e).__name__}: {e}".encode()]
        sock.send_multipart(frame)

    def call(self, sock: FrameSocket, payload: bytes) -> None:
        """One of `CALLS`, asked for on the data path: run it, answer on `sock` (a name of None: the
        driver gave up on that call, which is cancelled, as Ray cancels an actor call)."""
        call_id, name, args = msgspec.msgpack.decode(payload, type=tuple[int, str | None, list])
        if name is None:
            if (task := self._calls.pop(call_id, None)) is not None:
                task.cancel()
        else:
            self._calls[call_id] = asyncio.ensure_future(self._answer(sock, call_id, name, args))

    async def _answer(self, sock: FrameSocket, call_id: int, name: str, args: list) -> None:
        try:
            if name not in CALLS:
                raise ValueError(f"{name!r} is not a call of the data path")
            reply: tuple = (call_id, None, await getattr(self, name)(*args))
        except asyncio.CancelledError:
            if call_id not in self._calls:  # the driver gave it up: nobody waits for the answer
                raise
            reply = (call_id, ["RetryableError", f"{name} was cancelled inside the engine"], None)
        except Exception as e:  # the driver raises it, as Ray would have: rebuilt if one of ours
            reply = (call_id, [type(e).__name__, str(e)], None)
        finally:
            self._calls.pop(call_id, None)
        try:
            payload = msgspec.msgpack.encode(reply)
        except (TypeError, OverflowError) as e:
            payload = msgspec.msgpack.encode((call_id, ["TypeError", f"{name}'s answer does not encode: {e}"], None))
        try:
            sock.send_multipart([ANSWER, payload])
        except zmq.ZMQError:  # the driver's end closed (its `serve` call ended, and failed this call)
            pass

    def submit(self, batch: bytes) -> None:
        """Start groups: msgpack `[(key, requests)]`. Each comes back once as results, unless cancelled;
        a batch that does not decode comes back as each of its groups' error."""
        try:
            groups = msgspec.msgpack.decode(batch, type=list[tuple[str, list[Request]]])
        except Exception as e:
            for key in _keys(batch):
                self._post(
                    GroupResult(
                        key=key, error=f"engine {self.engine_id}: the group did not decode: {type(e).__name__}: {e}"
                    )
                )
            return
        for key, requests in groups:
            self._groups[key] = asyncio.ensure_future(self._run_group(key, requests))

    async def _run_group(self, key: str, requests: list[Request]) -> None:
        """One submitted group, to a `GroupResult` per sample as it finishes. A task nobody awaits:
        every way out but `cancel` (the driver gave it up) ends the group's results, or the driver
        would wait for it forever."""
        sent = 0
        for req in requests:
            if req.stream:
                self._stream_keys[req.request_id] = key
        try:
            async for traj in self.stream_group(requests):
                self._post(GroupResult(key=key, trajectories=[traj]))
                sent += 1
            if sent == len(requests):
                return
            result = GroupResult(key=key, error=f"engine {self.engine_id}: {sent} of {len(requests)} samples came back")
        except EngineDeadError as e:
            result = GroupResult(key=key, error=str(e), dead=True)
        except Exception as e:  # not a bad request (that is an error trajectory): the group fails
            result = GroupResult(key=key, error=f"engine {self.engine_id}: {type(e).__name__}: {e}")
        except asyncio.CancelledError:
            if key not in self._groups:  # `cancel` took it out first: nobody waits for it
                raise
            result = GroupResult(key=key, error=f"engine {self.engine_id}: the group was cancelled inside the engine")
        finally:
            self._groups.pop(key, None)
            for req in requests:
                self._stream_keys.pop(req.request_id, None)
        self._post(result)

    def _post(self, result: GroupResult) -> None:
        if not self._results:  # the first since the last frame: send them all at the end of this turn
            asyncio.get_running_loop().call_soon(self._flush)
        self._results.append(result)

    def _flush(self) -> None:
        if self._sock is None or not self._results:  # no driver connected: kept until one is
            return
        results, self._results = self._results, []
        self._sock.send_multipart([RESULTS, encode(results)])  # per-token data packed: one bin each

    def send_deltas(self, deltas: list[tuple[str, int, Trajectory]]) -> None:
        """One engine step's streamed tokens, (request id, position, new tokens) per sample, in one
        frame. With no driver connected they are not sent: each sample's trajectory carries them."""
        if not deltas or self._sock is None:
            return
        frame = [Delta(self._stream_keys[rid], start, t) for rid, start, t in deltas if rid in self._stream_keys]
        if frame:
            self._sock.send_multipart([DELTAS, encode(frame)])

    def cancel(self, keys: list[str]) -> None:
        """Stop these groups (their requests are aborted); they never come back as results."""
        for key in keys:
            if (task := self._groups.pop(key, None)) is not None:
                task.cancel()


def _keys(batch: bytes) -> list[str]:
    """The group keys of a submit batch that does not decode as requests (none if even that fails)."""
    try:
        groups: Any = msgspec.msgpack.decode(batch)
        return [g[0] for g in groups if isinstance(g, (list, tuple)) and g and isinstance(g[0], str)]
    except Exception:
        return []
