"""`rollout serve`: an OpenAI-compatible HTTP server in front of a running `RolloutEngine`.

Every request becomes one prompt submitted to the engine's scheduler on a channel of its own
(`RolloutEngine.submit`, not counted for training), so HTTP traffic gets routing, in-flight updates,
crash migration and exact per-token epochs like Python callers. A conversation's turns share a
session (the `X-Session-Id` header, `session_id` in the body, or found from the token ids an
assistant message carries): each turn runs on the engine of the turn before and reuses its KV.
Turns sent with an `episode_id` are kept; `POST /v1/episodes/{id}/reward` closes the episode and
hands it to the learner's queue as one training sample (`engine.batches()` trains on it).
This is the HTTP half, which `serve.api_servers` runs in that many processes; what must be one
(sessions, episodes, requests in flight, figures, the RL routes' work) is the backend's
(`rollout.serve.backend`), on the engine's loop, called in process or from a front-end process
(`rollout.serve.frontends`).
Owns: the routes (FastAPI on uvicorn), overload (429 with `Retry-After` past
`serve.max_concurrency` requests in flight in this process, never unbounded memory), client
disconnects (abort the engine request), the error shape (`openai_api.ApiError`; whatever a request
holds, an error of its own, never a 500 or a stopped server), `stream: true` (server-sent events as
the engine generates, `rollout.serve.sse`). `seed`: a seeded request runs under one fixed
prompt id, so the same seed, request and weights give the same tokens (the per-request vLLM seed
is derived from the seed and the prompt id).
Does not own: the wire format (`rollout.serve.openai_api`), bodies (`rollout.serve.bodies`),
preparing off the loop (`rollout.serve.prepare`), listening (`rollout.serve.listen`), auth
(`rollout.serve.auth`), metrics (`rollout.metrics.prometheus`), sessions and episodes
(`rollout.serve.backend`), scheduling
(`rollout.scheduling.scheduler`), vLLM's RL routes (`rollout.serve.rl_routes`).
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations (the local
# `Request` import) when they are defined.
import asyncio
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
from starlette.responses import StreamingResponse

from rollout.config import Config
from rollout.episodes.chat import chat_parsers
from rollout.errors import EngineClosedError, EngineDeadError, InvalidPromptError, RetryableError
from rollout.log import get_logger
from rollout.serve import auth, bodies, listen, prepare, sse
from rollout.serve import openai_api as api
from rollout.serve.backend import RETRY_AFTER
from rollout.serve.rl_routes import add_rl_routes
from rollout.types import Trajectory, printable

if TYPE_CHECKING:
    import socket

    from anyio.abc import TaskGroup

    from rollout.serve.prepare import ServedChat

log = get_logger(__name__)
# Idle seconds before the server closes a kept-alive connection: longer than clients keep idle
# connections in their pools (httpx and the OpenAI SDK 5 s, aiohttp 15 s, Go 90 s). A server that
# closes first (uvicorn's own 5 s) races the client's next request on that connection, which then
# gets a reset: agents retrying 429s every few seconds lost about 1 POST in 100 so.
KEEP_ALIVE_S = 120
# Seconds a streamed answer's client may take to accept a chunk (its socket's buffers full): past
# it the request is aborted and logged. Memory does not grow meanwhile (a step's tokens wait for
# the client, not a queue of chunks); the engine's room does.
STALL_S = 60.0


class Server:
    """The HTTP half (`start`, `stop`): the app and its uvicorn server on this process's event loop,
    over a backend (`rollout.serve.backend.Backend` in the engine's process, or a `RemoteBackend` to it)."""

    def __init__(self, backend: Any, cfg: Config, chat: "ServedChat | None", api_key: str | None = None):
        """Raises InvalidConfigError for an API key HTTP cannot carry."""
        self.backend = backend
        self.cfg = cfg.serve
        self.sampling = cfg.sampling  # what a request leaves out
        self.api_key = auth.check_api_key(api_key if api_key is not None else self.cfg.api_key)
        self.max_model_len = cfg.model.max_model_len
        self.chat = chat
        self.parsers = chat_parsers(self.chat, self.cfg.tool_parser, self.cfg.reasoning_parser)
        self.model = self.cfg.model_name or cfg.model.path
        self.inflight = 0
        self.url = ""
        self._server: Any = None
        self._done = anyio.Event()
        self._prepare = prepare.Preparer()
        self.app = self._app()

    async def start(
        self, tg: "TaskGroup", host: str | None = None, port: int | None = None, sock: "socket.socket | None" = None
    ) -> str:
        """Listen (on `serve.host`/`serve.port` unless given; port 0: a free one; or on `sock`, bound
        already); returns the URL. Raises OSError naming the address when it cannot listen; the
        engine is untouched."""
        import uvicorn

        host, port = host or self.cfg.host, self.cfg.port if port is None else port
        sock = sock or listen.listen(
            host, port
        )  # bound here: uvicorn's own bind calls sys.exit, which would end the engine's task group
        config = uvicorn.Config(
            self.app, log_level="warning", lifespan="off", access_log=False, timeout_keep_alive=KEEP_ALIVE_S
        )
        self._server = listen.uvicorn_server(config)

        async def run() -> None:
            try:
                await self._server.serve(sockets=[sock])
            except (Exception, SystemExit) as e:  # the server's failure is its own: the engine serves its other callers
                log.error("serve: the HTTP server stopped", address=f"{host}:{port}", error=repr(e))
            finally:
                sock.close()
                self._done.set()

        tg.start_soon(run)
        while not self._server.started:
            if self._done.is_set():
                raise OSError(f"serve: cannot listen on {host}:{port}")
            await anyio.sleep(0.02)
        name = sock.getsockname()
        self.url = f"http://{name[0]}:{name[1]}"
        return self.url

    async def stop(self) -> None:
        if self._server is not None and not self._done.is_set():
            self._server.should_exit = True
            with anyio.move_on_after(10):
                await self._done.wait()

    # -- the app -----------------------------------------------------------------------------

    def _app(self) -> Any:
        from fastapi import FastAPI, Request
        from fastapi.responses import PlainTextResponse, Response
        from starlette.requests import ClientDisconnect

        app = FastAPI(title="rollout", docs_url=None, redoc_url=None, openapi_url=None)
        if self.api_key:
            app.add_middleware(auth.ApiKey, key=self.api_key)

        async def handle(
            request: Request, parse: Callable[[dict[str, Any]], Any], work: Any, streams: bool = False
        ) -> Any:
            """1) read the body (size limit) 2) admit it (429 past max_concurrency) 3) decode and
            `parse` it, off the loop when large 4) `work` on the parsed request 5) reply."""
            started = time.perf_counter()
            status, call = 200, None
            try:
                body = await bodies.read_body(request, self.cfg.max_body_bytes)
                if self.inflight >= self.cfg.max_concurrency:
                    raise api.ApiError(429, f"busy: {self.inflight} requests in flight (serve.max_concurrency)",
                                       kind="rate_limit_error", headers=RETRY_AFTER)  # fmt: skip
                self.inflight += 1
                streaming = False
                try:
                    data, call, (stream, usage) = await self._prepare.run(
                        body, lambda b: self._parse(b, parse, streams)
                    )
                    if stream:  # counted in flight until its last chunk is sent
                        call.stream, call.usage = True, usage
                        reply = await work(request, data, call)
                        streaming = True
                        return reply
                    return bodies.json_response(await work(request, data, call))
                finally:
                    if not streaming:
                        self.inflight -= 1
            except ClientDisconnect:  # gone before its body arrived: nothing was done, nobody reads this
                status = 499
                return bodies.error(api.ApiError(499, "the client closed the request", kind="client_closed_request"))
            except Exception as e:
                error = self._error(e, call, request.url.path)
                status = error.status
                return bodies.error(error)
            finally:
                self.backend.record(request.url.path, status, time.perf_counter() - started)

        def session_of(request: Request) -> Callable[[dict[str, Any]], api.Call]:
            return lambda data: api.chat(
                data, self.chat, request.headers.get("x-session-id") or api._str(data, "session_id"), self.parsers
            )

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await handle(request, session_of(request), self._chat, streams=True)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await handle(request, lambda data: api.completion(data, self.chat), self._completion, streams=True)

        @app.post("/inference/v1/generate")
        async def generate(request: Request) -> Any:
            return await handle(request, api.generate, self._generate)

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Any:
            def parse(data: dict[str, Any]) -> api.Call:
                return api.chat(data, self.chat, None) if "messages" in data else api.completion(data, self.chat)

            async def work(request: Request, data: dict[str, Any], call: api.Call) -> dict[str, Any]:
                return {"count": len(call.prompt_ids), "max_model_len": self.max_model_len, "tokens": call.prompt_ids}

            return await handle(request, parse, work)

        @app.post("/v1/episodes/{episode_id}/reward")
        async def reward(request: Request, episode_id: str) -> Any:
            return await handle(
                request, lambda data: None, lambda r, data, call: self.backend.reward(episode_id, data.get("reward"))
            )

        @app.get("/v1/models")
        async def models() -> Any:
            return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                "owned_by": "rollout",
                                                "max_model_len": self.max_model_len}]}  # fmt: skip

        @app.get("/health")
        async def health() -> Any:
            alive = await self.backend.healthy()
            return bodies.json_response({"status": "ok" if alive else "no engine"}, 200 if alive else 503)

        @app.get("/metrics")
        async def metrics() -> Any:
            return PlainTextResponse(await self.backend.metrics(), media_type="text/plain; version=0.0.4")

        # vLLM's /pause, /resume, weight-transfer routes, ... (`rollout.serve.rl_routes`)
        add_rl_routes(app, self.backend, self.cfg.max_body_bytes)

        @app.exception_handler(404)
        async def not_found(request: Request, exc: Any) -> Response:
            missing = api.ApiError(404, f"no route {request.method} {request.url.path}", kind="not_found_error")
            return bodies.error(missing)

        @app.exception_handler(405)
        async def not_allowed(request: Request, exc: Any) -> Response:
            return bodies.error(
                api.ApiError(405, f"{request.method} is not served on {request.url.path}", kind="invalid_request_error")
            )

        return app

    @staticmethod
    def _error(e: Exception, call: Any, path: str) -> api.ApiError:
        """What a request's failure answers: its own ApiError, or the engine's errors in OpenAI's shape."""
        if isinstance(e, api.ApiError):
            return e
        if isinstance(e, InvalidPromptError):  # the engine's own checks: the field named as ours are
            return api.ApiError(400, str(e), call.param_of(str(e)) if isinstance(call, api.Call) else None)
        if isinstance(e, RetryableError):  # the engine busy: the client's retry will do
            return api.ApiError(429, str(e), kind="rate_limit_error", headers=RETRY_AFTER)
        if isinstance(e, (EngineDeadError, EngineClosedError)):
            return api.ApiError(503, f"engine unavailable: {e}", kind="service_unavailable")
        # a defect: answered in OpenAI's shape, logged, the server serves on
        log.exception("serve: request failed", path=path)
        return api.ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")

    def _parse(
        self, body: bytes, parse: Callable[[dict[str, Any]], Any], streams: bool
    ) -> tuple[dict[str, Any], Any, tuple[bool, bool]]:
        """The body decoded and checked, and the request it makes (`parse`): the CPU-heavy part of a
        request (JSON, rendering, tokenizing), run where `Preparer` says."""
        data = bodies.decode(body)
        self._check_model(data)
        return data, parse(data), api.streamed(data) if streams else (False, False)

    def _check_model(self, data: dict[str, Any]) -> None:
        model = data.get("model")
        if model is not None and model != self.model:
            raise api.ApiError(404, f"model {printable(model)!r} does not exist; this server serves {self.model!r}",
                               "model", "not_found_error")  # fmt: skip

    # -- endpoints -----------------------------------------------------------------------------

    async def _chat(self, request: Any, data: dict[str, Any], call: api.Call) -> Any:
        call.episode = call.episode or request.headers.get("x-episode-id")
        if call.stream:
            return await self._streamed(request, call, True)
        trajs = await self._run(request, call)
        return api.chat_response(call, trajs, self.model, self.chat, self.parsers)

    async def _completion(self, request: Any, data: dict[str, Any], call: api.Call) -> Any:
        if call.stream:
            return await self._streamed(request, call, False)
        return api.completion_response(call, await self._run(request, call), self.model, self.chat)

    async def _streamed(self, request: Any, call: api.Call, is_chat: bool) -> Any:
        """A streamed answer (`rollout.serve.sse`): once its first tokens are generated (a failure
        before them is answered as an HTTP error, like a request not streamed), the chunks as the
        engine generates, every engine step's new tokens in one chunk per choice however slowly
        the client reads (what waits for it is the tokens, never a queue of chunks). The client
        gone, or `/abort_requests` naming it, aborts the engine request."""
        self._fill(call)
        chunks = sse.Chunks(call, self.model, self.chat, self.parsers if is_chat else None, is_chat,
                            call.sampling.get("n", 1), call.usage)  # fmt: skip
        new: dict[int, tuple[list[int], list[float]]] = {}
        arrived = asyncio.Event()

        def on_tokens(k: int, start: int, ids: list[int], lps: list[float]) -> None:
            got = new.setdefault(k, ([], []))
            got[0].extend(ids)
            got[1].extend(lps)
            arrived.set()

        rid = request.headers.get("x-request-id")
        run = asyncio.ensure_future(self.backend.run(call.prompt_ids, call.sampling, call.session, call.prefix,
                                                  call.episode, rid, on_tokens))  # fmt: skip
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            await _first(run, arrived, gone)
            if run.done():
                run.result()  # its failure: answered as the request's HTTP error
            elif gone.done():
                raise api.ApiError(499, "the client closed the request", kind="client_closed_request")
        except BaseException:
            run.cancel()
            raise
        finally:
            gone.cancel()  # from here the response watches for the client going away

        # From here one event wakes the body: new tokens, or the run's end (a callback, not a task
        # per wait: a step's wake-up costs one future, however many streams are open).
        run.add_done_callback(lambda _: arrived.set())

        async def body() -> Any:
            try:
                yield chunks.start()
                while True:
                    if new:
                        taken = dict(new)
                        new.clear()
                        if out := chunks.step(taken):
                            yield out
                    if run.done():
                        break
                    if new:  # arrived while the last chunk was being sent
                        continue
                    arrived.clear()
                    await arrived.wait()
                try:
                    trajs = run.result()
                except Exception as e:  # after the first chunk: an error event ends the stream
                    yield chunks.error(self._error(e, call, request.url.path))
                    return
                yield chunks.end(trajs)
            finally:
                run.cancel()

        def close() -> None:
            run.cancel()
            self.inflight -= 1

        return Events(body(), close, media_type="text/event-stream")

    def _fill(self, call: api.Call) -> None:
        """A request's sampling as the engine runs it: what it leaves out, the server's, and
        `max_tokens` capped at what the context has room for. Raises ApiError (400) past the context."""
        room = self.max_model_len - len(call.prompt_ids)
        if room < 1 or call.sampling.get("max_tokens", 1) > room:
            asked = len(call.prompt_ids) + call.sampling.get("max_tokens", 0)
            raise api.ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                    f"However, you requested {asked} tokens ({len(call.prompt_ids)} in the messages).",
                                    call.ids_param)  # fmt: skip
        base = self.sampling
        call.sampling.setdefault("max_tokens", min(base.max_tokens, room))
        call.sampling.setdefault("min_tokens", 0)
        call.stop, call.stop_ids = (
            call.sampling.get("stop", list(base.stop)),
            call.sampling.get("stop_token_ids", list(base.stop_token_ids)),
        )

    async def _generate(self, request: Any, data: dict[str, Any], call: api.Call) -> dict[str, Any]:
        request_id = printable(data.get("request_id") or uuid.uuid4().hex)
        return api.generate_response(await self._run(request, call, request_id), request_id)

    async def _run(self, request: Any, call: api.Call, rid: str | None = None) -> list[Trajectory]:
        """One prompt (its `n` samples) through the backend; the client going away aborts it, and so
        does `/abort_requests` naming its id (`X-Request-Id`, else `rid`, else its prompt id)."""
        self._fill(call)
        trajs: list[Trajectory] | None = None
        failure: Exception | None = None
        async with anyio.create_task_group() as tg:

            async def watch() -> None:  # a client gone away: its engine request is aborted
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            rid = request.headers.get("x-request-id") or rid
            try:
                trajs = await self.backend.run(
                    call.prompt_ids, call.sampling, call.session, call.prefix, call.episode, rid
                )
            except Exception as e:  # raised below, outside the task group (not in an ExceptionGroup)
                failure = e
            tg.cancel_scope.cancel()
        if failure is not None:
            raise failure
        if trajs is None:
            raise api.ApiError(499, "the client closed the request", kind="client_closed_request")
        return trajs


async def _disconnect(request: Any) -> None:
    """Returns once the client has gone away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _first(*aws: asyncio.Future | asyncio.Event) -> None:
    """Wait until the first of these is done (a future) or set (an event)."""
    waits = [asyncio.ensure_future(a.wait()) if isinstance(a, asyncio.Event) else a for a in aws]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w, a in zip(waits, aws):
            if w is not a:
                w.cancel()


class Events(StreamingResponse):
    """Server-sent events whose client must take each chunk within `STALL_S`, or the request is
    aborted and logged. `on_close` runs once the response ends, however it ends (sent, the client
    gone, cut off, never started): it aborts the engine request if it still runs."""

    def __init__(self, content: Any, on_close: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()

    async def stream_response(self, send: Any) -> None:
        async def bounded(message: Any) -> None:
            async with asyncio.timeout(STALL_S):  # a timer handle, lighter than a cancel scope per chunk
                await send(message)

        try:
            await super().stream_response(bounded)
        except TimeoutError:
            log.warning(f"serve: a streaming client took no chunk for {STALL_S:.0f} s; its request is aborted")
            await self.body_iterator.aclose()
