"""`rollout serve` in one process or several: `serve.api_servers` HTTP front-end processes over one
engine, as vLLM's API-server scale-out (`vllm serve --api-server-count`).

Most of a served request's CPU is HTTP (the ASGI stack, rendering and tokenizing), not the engine's
driver (docs/guides/scaling.md; `benchmarks/serve.py` measures both). So with `api_servers` > 1 the
driver binds the listening socket and starts that many processes (`python -m rollout.serve`) that
accept on it, the kernel handing each connection to one of them. Each runs the HTTP half
(`rollout.serve.server.Server`) over a
`RemoteBackend`: its calls to the backend (`rollout.serve.backend.Backend`: sessions, episodes, requests in
flight, figures, the RL routes' work) go as msgpack frames over a zmq socket to the driver's
`DeskService`, which runs each as a task of its own on the engine's loop and answers on the same
socket; a call the front end gives up on (its client gone) is cancelled there too. A
conversation's turns and an episode's reward may reach different front ends: they meet at the backend.

Owns: the processes (started, awaited until they serve, started again when one dies, stopped with
the engine; each exits when the driver's process does), the backend's calls between processes (an
ipc:// socket in a directory only this user can enter) and the errors that cross it (`ApiError`,
the engine's InvalidPromptError, RetryableError, EngineDeadError, EngineClosedError; anything else
as a RuntimeError naming it). Does not own: HTTP (`rollout.serve.server`), the backend's work.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import zmq

from rollout.errors import EngineClosedError, EngineDeadError, InvalidPromptError, RetryableError
from rollout.log import get_logger
from rollout.packed import encode
from rollout.serve import auth, listen, prepare
from rollout.serve.backend import Backend
from rollout.serve.openai_api import ApiError
from rollout.serve.server import Server
from rollout.types import Trajectory
from rollout.wire import FrameSocket

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from rollout.config import Config
    from rollout.serve.backend import ServedEngine

log = get_logger(__name__)
# the backend's methods a front end awaits
CALLS = frozenset({"run", "reward", "metrics", "healthy", "pause", "resume", "is_paused", "abort", "init", "shutdown",
                   "start", "update", "finish", "label", "weight_info", "world_size"})  # fmt: skip
NOTES = frozenset({"record", "ready"})  # sent, never answered
Update = tuple[int, int, list[int], list[float]]  # a streamed run's (sample index, position, token ids, logprobs)
TOKENS = b"t"  # the first part of a frame with a streamed run's new tokens (a reply has one part)
ERRORS = (InvalidPromptError, RetryableError, EngineDeadError, EngineClosedError)  # cross as themselves
RETURNS: dict[str, Any] = {"run": list[Trajectory]}  # how a call's answer decodes (the rest: plain data)
START_S = 300.0  # a front end not serving by then failed to start


async def serve(
    engine: ServedEngine, tg: TaskGroup, host: str | None, port: int | None, api_key: str | None
) -> Server | FrontEnds:
    """`engine.serve()`: the HTTP half in this process over the backend, or `serve.api_servers` processes."""
    cfg = engine.cfg
    if cfg.serve.api_servers > 1:
        front = FrontEnds(engine, api_key)
        await front.start(tg, host, port)
        return front
    chat = prepare.served_chat(engine.model_path, cfg.model.max_model_len)
    server = Server(Backend(engine, chat.end_of_turn if chat else None), cfg, chat, api_key)
    await server.start(tg, host, port)
    return server


class FrontEnds:
    """The backend, its service, and `serve.api_servers` front-end processes on one listening socket."""

    def __init__(self, engine: ServedEngine, api_key: str | None = None):
        """Raises InvalidConfigError for an API key HTTP cannot carry."""
        self.cfg, self.model_path = engine.cfg, engine.model_path
        self.api_key = auth.check_api_key(api_key if api_key is not None else self.cfg.serve.api_key)
        self.chat = prepare.served_chat(engine.model_path, self.cfg.model.max_model_len)
        self.backend = Backend(engine, self.chat.end_of_turn if self.chat else None)
        self.model = self.cfg.serve.model_name or self.cfg.model.path
        self.url = ""
        self.procs: list[subprocess.Popen] = []  # a process per front end
        self._life: tuple[
            int, ...
        ] = ()  # a pipe never written: its read end, in every front end, ends when this process does
        self.pids: dict[int, int] = {}  # front end -> the pid that said it serves
        self._exits: dict[int, int] = {}  # front end -> a pidfd of its process, readable once it exits
        self._service: DeskService | None = None
        self._sock: socket.socket | None = None
        self._all_ready = anyio.Event()
        self._failed = ""
        self._stopping = False

    async def start(self, tg: TaskGroup, host: str | None = None, port: int | None = None) -> str:
        """Listen, start every front end and return the URL once all serve. Raises OSError when it
        cannot listen, RuntimeError naming a front end that exited or hung before serving."""
        serve_cfg = self.cfg.serve
        host, port = host or serve_cfg.host, serve_cfg.port if port is None else port
        self._sock = listen.listen(host, port)
        self._life = os.pipe()
        self._service = DeskService(self.backend, self._ready)
        self._service.start()
        self.procs = [self._spawn(i) for i in range(serve_cfg.api_servers)]
        with anyio.move_on_after(START_S):
            await self._all_ready.wait()
        if self._failed or len(self.pids) < len(self.procs):
            await self.stop()
            raise RuntimeError(f"serve: {self._failed or 'a front-end process did not start serving in time'}")
        name = self._sock.getsockname()
        self.url = f"http://{name[0]}:{name[1]}"
        return self.url

    def _spawn(self, index: int) -> subprocess.Popen:
        """`python -m rollout.serve` (`rollout/serve/__main__.py`), handed the listening socket and the read end of a
        pipe nobody writes (end of file once the driver is gone), its settings on stdin."""
        fds = (self._sock.fileno(), self._life[0])
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollout.serve"], stdin=subprocess.PIPE, pass_fds=fds, env=_env()
        )
        with contextlib.suppress(BrokenPipeError):  # it died at once: its exit says so
            proc.stdin.write(
                pickle.dumps((index, *fds, self._service.address, self.cfg, self.model_path, self.api_key))
            )
            proc.stdin.close()
        self._exits[index] = exited = os.pidfd_open(proc.pid)  # readable once it exits
        asyncio.get_running_loop().add_reader(exited, self._exited, index, proc)
        return proc

    def _ready(self, index: int, pid: int) -> None:
        self.pids[index] = pid
        if len(self.pids) == len(self.procs):
            self._all_ready.set()

    def _exited(self, index: int, proc: subprocess.Popen) -> None:
        self._unwatch(index)
        code = proc.wait()
        if self._stopping:
            return
        if self.pids.pop(index, None) is None:  # it never served: starting again would fail again
            self._failed = f"front-end process {index} exited with code {code} before serving"
            log.error(f"serve: {self._failed}; not started again")
            self._all_ready.set()
            return
        log.error("serve: a front-end process exited; starting it again", front_end=index, code=code)
        self.procs[index] = self._spawn(index)

    def _unwatch(self, index: int) -> None:
        if (exited := self._exits.pop(index, None)) is not None:
            asyncio.get_running_loop().remove_reader(exited)
            os.close(exited)

    async def stop(self) -> None:
        self._stopping = True
        for index, proc in enumerate(self.procs):
            self._unwatch(index)
            proc.terminate()
        for proc in self.procs:
            try:
                await anyio.to_thread.run_sync(proc.wait, 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                await anyio.to_thread.run_sync(proc.wait)
        if self._service is not None:
            self._service.close()
        if self._sock is not None:
            self._sock.close()
        for fd in self._life:
            os.close(fd)
        self._life = ()


class DeskService:
    """The driver's end: the backend's calls from every front end, each run as a task on this loop."""

    def __init__(self, backend: Backend, ready: Any):
        self.backend, self._ready = backend, ready
        self._dir = tempfile.mkdtemp(prefix="rollout-backend-")  # mode 0700: only this user's processes connect
        self.address = f"ipc://{self._dir}/backend"
        self._sock = FrameSocket(zmq.ROUTER)
        self._sock.sock.bind(self.address)
        self._tasks: dict[tuple[bytes, int], asyncio.Task] = {}

    def start(self) -> None:
        self._sock.start(self._frames)

    def _frames(self, frames: list[bytes]) -> None:
        peer, payload = frames
        try:
            call_id, op, args = msgspec.msgpack.decode(payload, type=tuple[int, str | None, list])
        except msgspec.DecodeError as e:  # not from a front end of ours
            log.error("serve: a frame the backend cannot read", error=str(e))
            return
        if op == "record":
            self.backend.record(*args)
        elif op == "ready":
            self._ready(*args)
        elif op is None:  # the front end gave up on call `call_id`
            if (task := self._tasks.pop((peer, call_id), None)) is not None:
                task.cancel()
        else:
            self._tasks[peer, call_id] = asyncio.get_running_loop().create_task(self._call(peer, call_id, op, args))

    async def _call(self, peer: bytes, call_id: int, op: str, args: list[Any]) -> None:
        try:
            if op not in CALLS:
                raise ApiError(500, f"serve: no backend call {op!r}", kind="server_error")
            if op == "run" and len(args) == 7 and args[6] is True:  # streamed: its tokens go back as they come
                args[6] = functools.partial(self._tokens, peer, call_id)
            reply = (call_id, None, await getattr(self.backend, op)(*args))
        except asyncio.CancelledError:
            return  # cancelled by its front end, which waits no more
        except Exception as e:
            reply = (call_id, _error(e), None)
        finally:
            self._tasks.pop((peer, call_id), None)
        try:
            payload = encode(reply)
        except (TypeError, OverflowError) as e:
            payload = encode((call_id, _error(e), None))
        try:
            self._sock.send_multipart([peer, payload])
        except zmq.ZMQError:  # that front end is gone (it is started again; its clients were cut off)
            pass

    def _tokens(self, peer: bytes, call_id: int, *update: Any) -> None:
        """A streamed run's new tokens, to the front end that asked (a frame of its own kind)."""
        try:
            self._sock.send_multipart([peer, TOKENS, encode((call_id, update))])
        except zmq.ZMQError:  # that front end is gone: its call is cancelled with it
            pass

    def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class RemoteBackend:
    """A front end's backend: the backend's methods by name, each a call over the socket to the driver.
    Made on the event loop that makes the calls. No public name of its own: each would hide the
    backend's method of that name (a `start` here once answered `/start_weight_update`)."""

    def __init__(self, address: str):
        self._sock = FrameSocket(zmq.DEALER)
        self._sock.sock.connect(address)
        self._calls: dict[int, tuple[asyncio.Future, str]] = {}
        self._streams: dict[int, Callable[..., None]] = {}  # a streamed run's call id -> its `on_tokens`
        self._ids = itertools.count(1)
        self._sock.start(self._frames)

    def __getattr__(self, op: str) -> Any:
        if op in NOTES:
            return functools.partial(self._note, op)
        if op in CALLS:
            return functools.partial(self._call, op)
        raise AttributeError(op)

    def _note(self, op: str, *args: Any) -> None:
        self._sock.send_multipart([encode((0, op, args))])

    async def _call(self, op: str, *args: Any) -> Any:
        call_id = next(self._ids)
        if op == "run" and len(args) == 7 and callable(args[6]):  # streamed: the backend sends its tokens back
            self._streams[call_id], args = args[6], (*args[:6], True)
        try:
            frame = encode((call_id, op, args))
        except (OverflowError, TypeError) as e:  # what the request held: an int msgpack cannot carry
            raise ApiError(400, f"a value in the request is out of range: {e}") from e
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (future, op)
        try:
            self._sock.send_multipart([frame])
            return await future
        except asyncio.CancelledError:
            if future.cancelled():  # given up before the answer came: the backend's task is cancelled too
                self._sock.send_multipart([encode((call_id, None, ()))])
            raise
        finally:
            self._calls.pop(call_id, None)
            self._streams.pop(call_id, None)

    def _frames(self, frames: list[bytes]) -> None:
        if len(frames) == 2 and frames[0] == TOKENS:
            call_id, update = msgspec.msgpack.decode(frames[1], type=tuple[int, Update])
            if (on_tokens := self._streams.get(call_id)) is not None:
                on_tokens(*update)
            return
        call_id, error, value = msgspec.msgpack.decode(frames[-1], type=tuple[int, list | None, msgspec.Raw])
        future, op = self._calls.get(call_id, (None, ""))
        if future is None or future.done():
            return
        if error is not None:
            future.set_exception(_rebuilt(error))
        else:
            future.set_result(msgspec.msgpack.decode(value, type=RETURNS.get(op, Any)))


def _error(e: Exception) -> list[Any]:
    if isinstance(e, ApiError):
        return ["ApiError", e.status, e.message, e.param, e.kind, e.headers]
    for kind in ERRORS:
        if isinstance(e, kind):
            return [kind.__name__, str(e)]
    log.exception("serve: a backend call failed")
    return ["", f"{type(e).__name__}: {e}"]


def _rebuilt(error: list[Any]) -> Exception:
    kind, *args = error
    if kind == "ApiError":
        return ApiError(*args)
    return next((k(*args) for k in ERRORS if k.__name__ == kind), RuntimeError(*args))


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])  # rollout/, policies/ and actors/ sit here
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}


async def front_end(
    index: int, sock_fd: int, life_fd: int, address: str, cfg: Config, model_path: str, api_key: str | None
) -> None:
    """The HTTP half on the listening socket over the backend at `address`, until the driver is gone."""
    backend = RemoteBackend(address)
    server = Server(backend, cfg, prepare.served_chat(model_path, cfg.model.max_model_len), api_key)
    driver_gone = anyio.Event()
    asyncio.get_running_loop().add_reader(life_fd, driver_gone.set)
    async with anyio.create_task_group() as tg:
        await server.start(tg, sock=socket.socket(fileno=sock_fd))
        backend.ready(index, os.getpid())
        await driver_gone.wait()
        await server.stop()
        tg.cancel_scope.cancel()
