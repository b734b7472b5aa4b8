"""`rollout serve`: an OpenAI-compatible HTTP server in front of a running `RolloutEngine`.

Every request becomes one prompt submitted to the engine's scheduler on a channel of its own
(`RolloutEngine.submit`, not counted for training), so HTTP traffic gets routing, in-flight updates,
crash migration and exact per-token epochs like Python callers. A conversation's turns share a
session (the `X-Session-Id` header, `session_id` in the body, or found from the token ids an
assistant message carries): each turn runs on the engine of the turn before and reuses its KV.
Turns sent with an `episode_id` are kept; `POST /v1/episodes/{id}/reward` closes the episode and
hands it to the learner's queue as one training sample (`engine.batches()` trains on it).
Owns: HTTP (FastAPI on uvicorn), bearer auth (`--api-key`), the body size limit, overload (429
past `serve.max_concurrency` requests in flight, never unbounded memory), client disconnects
(abort the engine request), the error shape (`openai_api.ApiError`), Prometheus `/metrics`,
`stream: true` (server-sent events in OpenAI's chunk format, sent when the turn ends).
Does not own: the wire format (`rollout.openai_api`), scheduling (`rollout.scheduler`).
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations (the local
# `Request` import) when they are defined.
import contextlib
import hashlib
import time
import uuid
from collections import OrderedDict
from typing import Any

import anyio
import msgspec

from rollout import openai_api as api
from rollout.config import ServeConfig
from rollout.episodes import assemble
from rollout.errors import EngineClosedError, EngineDeadError, InvalidPromptError, RetryableError
from rollout.log import get_logger
from rollout.types import Group, Prompt, Trajectory
from rollout.types import Request as EngineRequest  # `Request` is FastAPI's here

log = get_logger(__name__)
MAX_KEPT = 65536  # sessions found by token ids, episodes collecting turns: the oldest forgotten first


class Server:
    """The app and its uvicorn server, on the engine's event loop (`start`, `stop`)."""

    def __init__(self, engine: Any, cfg: ServeConfig, api_key: str | None = None):
        from rollout.chat import chat_renderer

        self.engine = engine
        self.cfg = cfg
        self.api_key = api_key if api_key is not None else cfg.api_key
        self.chat = chat_renderer(engine.model_path)
        self.model = cfg.model_name or engine.cfg.model.path
        self.max_model_len = engine.cfg.model.max_model_len
        self.by_ids: OrderedDict[bytes, str] = OrderedDict()  # hash of a turn's prompt + generation -> session
        self.episodes: OrderedDict[str, list[Trajectory]] = OrderedDict()
        self.inflight = 0
        self.url = ""
        self._server: Any = None
        self._done = anyio.Event()
        self._stats = _Stats(engine)
        self.app = self._app()

    async def start(self, tg: Any, host: str | None = None, port: int | None = None) -> str:
        """Listen (on `serve.host`/`serve.port` unless given; port 0: a free one); returns the URL."""
        import uvicorn

        config = uvicorn.Config(self.app, host=host or self.cfg.host, port=self.cfg.port if port is None else port,
                                log_level="warning", lifespan="off", access_log=False)  # fmt: skip
        self._server = _uvicorn(config)

        async def run() -> None:
            try:
                await self._server.serve()
            finally:
                self._done.set()

        tg.start_soon(run)
        while not self._server.started:
            if self._done.is_set():
                raise OSError(f"serve: cannot listen on {config.host}:{config.port}")
            await anyio.sleep(0.02)
        sock = self._server.servers[0].sockets[0].getsockname()
        self.url = f"http://{sock[0]}:{sock[1]}"
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

        app = FastAPI(title="rollout", docs_url=None, redoc_url=None, openapi_url=None)
        if self.api_key:
            app.add_middleware(_ApiKey, key=self.api_key)

        async def handle(request: Request, work: Any, streams: bool = False) -> Any:
            started = time.perf_counter()
            status = 200
            try:
                data = api.decode(await self._body(request))
                stream, usage = api.streamed(data) if streams else (False, False)
                if self.inflight >= self.cfg.max_concurrency:
                    raise api.ApiError(429, f"busy: {self.inflight} requests in flight (serve.max_concurrency)", kind="rate_limit_error")
                self.inflight += 1
                try:
                    body = await work(request, data)
                    return Response(api.events(body, usage), media_type="text/event-stream") if stream else _json(body)
                finally:
                    self.inflight -= 1
            except api.ApiError as e:
                status = e.status
                return _error(e)
            except InvalidPromptError as e:
                status = 400
                return _error(api.ApiError(400, str(e)))
            except (EngineDeadError, EngineClosedError) as e:
                status = 503
                return _error(api.ApiError(503, f"engine unavailable: {e}", kind="service_unavailable"))
            finally:
                self._stats.request(request.url.path, status, time.perf_counter() - started)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await handle(request, self._chat, streams=True)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await handle(request, self._completion, streams=True)

        @app.post("/inference/v1/generate")
        async def generate(request: Request) -> Any:
            return await handle(request, self._generate)

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Any:
            async def work(request: Request, data: dict[str, Any]) -> dict[str, Any]:
                self._check_model(data)
                ids = api.chat(data, self.chat, None).prompt_ids if "messages" in data else api.completion(data, self.chat).prompt_ids
                return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

            return await handle(request, work)

        @app.post("/v1/episodes/{episode_id}/reward")
        async def reward(request: Request, episode_id: str) -> Any:
            return await handle(request, lambda r, data: self._reward(episode_id, data))

        @app.get("/v1/models")
        async def models() -> Any:
            return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "rollout",
                                                "max_model_len": self.max_model_len}]}  # fmt: skip

        @app.get("/health")
        async def health() -> Any:
            alive = any(load.healthy for load in self.engine._live_scheduler().runner.loads)
            return _json({"status": "ok" if alive else "no engine"}, 200 if alive else 503)

        @app.get("/metrics")
        async def metrics() -> Any:
            return PlainTextResponse(await self._stats.exposition(), media_type="text/plain; version=0.0.4")

        @app.exception_handler(404)
        async def not_found(request: Request, exc: Any) -> Response:
            return _error(api.ApiError(404, f"no route {request.method} {request.url.path}", kind="not_found_error"))

        return app

    async def _body(self, request: Any) -> bytes:
        limit = self.cfg.max_body_bytes
        if int(request.headers.get("content-length") or 0) > limit:
            raise api.ApiError(413, f"request body over serve.max_body_bytes={limit}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise api.ApiError(413, f"request body over serve.max_body_bytes={limit}")
        return bytes(body)

    def _check_model(self, data: dict[str, Any]) -> None:
        model = data.get("model")
        if model is not None and model != self.model:
            raise api.ApiError(404, f"model {model!r} does not exist; this server serves {self.model!r}", "model", "not_found_error")

    # -- endpoints -----------------------------------------------------------------------------

    async def _chat(self, request: Any, data: dict[str, Any]) -> dict[str, Any]:
        self._check_model(data)
        call = api.chat(data, self.chat, request.headers.get("x-session-id") or api._str(data, "session_id"))
        call.episode = call.episode or request.headers.get("x-episode-id")
        traj = await self._run(request, call)
        return api.chat_response(call, traj, self.model, self.chat, self.cfg.tool_parser)

    async def _completion(self, request: Any, data: dict[str, Any]) -> dict[str, Any]:
        self._check_model(data)
        call = api.completion(data, self.chat)
        return api.completion_response(call, await self._run(request, call), self.model, self.chat)

    async def _generate(self, request: Any, data: dict[str, Any]) -> dict[str, Any]:
        self._check_model(data)
        call = api.generate(data)
        request_id = str(data.get("request_id") or uuid.uuid4().hex)
        return api.generate_response(await self._run(request, call), request_id)

    async def _run(self, request: Any, call: api.Call) -> Trajectory:
        """One prompt through the engine; the client going away aborts it."""
        room = self.max_model_len - len(call.prompt_ids)
        if room < 1 or call.sampling.get("max_tokens", 1) > room:
            asked = len(call.prompt_ids) + call.sampling.get("max_tokens", 0)
            raise api.ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                                    f"{asked} tokens ({len(call.prompt_ids)} in the messages).", "messages")  # fmt: skip
        call.sampling.setdefault("max_tokens", min(self.engine.cfg.sampling.max_tokens, room))
        call.sampling.setdefault("min_tokens", 0)
        session = call.session or self._session_of(call.prompt_ids, call.prefix)
        prompt = Prompt(token_ids=call.prompt_ids, sampling=call.sampling, session=session, id=f"http-{uuid.uuid4().hex[:12]}")
        submission = self.engine.submit([prompt], train=False)
        failure: Exception | None = None
        groups: list[Group] | None = None
        async with anyio.create_task_group() as tg:

            async def watch() -> None:  # a client gone away: its engine request is aborted
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                submission.cancel()
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                groups = await submission.result()
            except Exception as e:  # raised below, outside the task group (not in an ExceptionGroup)
                failure = e
            tg.cancel_scope.cancel()
        if failure is not None:
            raise failure
        if groups is None:
            raise api.ApiError(499, "the client closed the request", kind="client_closed_request")
        (group,) = groups
        if group.error is not None or not group.trajectories:
            raise api.ApiError(400, group.error or "no sample came back")
        traj = group.trajectories[0]
        if not traj.ok:
            raise api.ApiError(500, f"generation failed: {traj.error}", kind="server_error")
        self._remember(session, traj, call.episode)
        self._stats.tokens(len(traj.prompt_token_ids), len(traj.token_ids))
        return traj

    def _session_of(self, ids: list[int], prefix: int) -> str:
        """The session of the turn whose ids (an assistant message's, `prefix` of them) start this
        prompt, else a new one."""
        if prefix and (session := self.by_ids.get(_key(ids[:prefix]))) is not None:
            return session
        return uuid.uuid4().hex

    def _remember(self, session: str, traj: Trajectory, episode: str | None) -> None:
        ids = traj.prompt_token_ids + traj.token_ids
        for key in (_key(ids), _key(ids + [self.chat.end_of_turn] if self.chat else ids)):
            _put(self.by_ids, key, session)
        if episode is not None:
            turns = self.episodes.get(episode) or []
            turns.append(traj)
            _put(self.episodes, episode, turns)

    async def _reward(self, episode_id: str, data: dict[str, Any]) -> dict[str, Any]:
        """Close an episode: its turns become one trajectory, rewarded, handed to the learner."""
        value = data.get("reward")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
            raise api.ApiError(400, "reward: expected a finite number", "reward")
        turns = self.episodes.pop(episode_id, None)
        if not turns:
            raise api.ApiError(404, f"episode {episode_id!r}: no turns were served with this episode_id", kind="not_found_error")
        observations = []
        for a, b in zip(turns, turns[1:]):
            before = a.prompt_token_ids + a.token_ids
            if b.prompt_token_ids[: len(before)] != before:
                raise api.ApiError(409, f"episode {episode_id!r}: a turn does not continue the one before token for token")
            observations.append(b.prompt_token_ids[len(before) :])
        request = EngineRequest(episode_id, episode_id, 0, self.engine.cfg.sampling, token_ids=turns[0].prompt_token_ids)
        episode = assemble(request, turns, observations, "stop", None)
        episode.reward = float(value)
        group = Group(prompt_id=episode_id, prompt=Prompt(token_ids=turns[0].prompt_token_ids, id=episode_id), trajectories=[episode])
        try:
            await self.engine.hand_in(group)
        except RetryableError as e:
            raise api.ApiError(429, str(e), kind="rate_limit_error") from e
        return {"episode_id": episode_id, "turns": len(turns), "tokens": len(episode.token_ids), "reward": episode.reward}


def _uvicorn(config: Any) -> Any:
    """uvicorn's server without its signal handlers: the engine's own handling of Ctrl-C and
    SIGTERM shuts everything down, this server included."""
    import uvicorn

    class Quiet(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            yield

    return Quiet(config)


class _Stats:
    """Prometheus figures of the server, and the engine's (`rollout.metrics`), for `GET /metrics`."""

    def __init__(self, engine: Any):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.engine = engine
        self.registry = CollectorRegistry()
        self.requests = Counter("rollout_http_requests", "HTTP requests by path and status", ["path", "status"], registry=self.registry)
        self.latency = Histogram("rollout_http_latency_seconds", "HTTP request latency", ["path"], registry=self.registry,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))  # fmt: skip
        self.prompt_tokens = Counter("rollout_http_prompt_tokens", "prompt tokens served", registry=self.registry)
        self.generated = Counter("rollout_http_generated_tokens", "tokens generated for HTTP requests", registry=self.registry)
        self._engine_registered = False

    def request(self, path: str, status: int, seconds: float) -> None:
        self.requests.labels(path, str(status)).inc()
        self.latency.labels(path).observe(seconds)

    def tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.generated.inc(generated)

    async def exposition(self) -> str:
        from prometheus_client import generate_latest

        from rollout.metrics import _Collector

        metrics = self.engine._metrics
        if metrics is not None:
            await metrics.refresh()
            if not self._engine_registered:
                self.registry.register(_Collector(metrics))
                self._engine_registered = True
        return generate_latest(self.registry).decode()


class _ApiKey:
    """Bearer auth as plain ASGI middleware (Starlette's `BaseHTTPMiddleware` costs a task group
    and two memory streams per request)."""

    def __init__(self, app: Any, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode("latin-1")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != self.expected:
            reply = _error(api.ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", kind="authentication_error"))
            return await reply(scope, receive, send)
        await self.app(scope, receive, send)


def _json(body: Any, status: int = 200) -> Any:
    """A JSON response encoded by msgspec (several times faster than `json.dumps` on token id lists)."""
    from fastapi.responses import Response

    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def _error(e: api.ApiError) -> Any:
    return _json(e.body(), e.status)


def _key(ids: list[int]) -> bytes:
    return hashlib.blake2b(msgspec.msgpack.encode(ids), digest_size=16).digest()


def _put(store: OrderedDict, key: Any, value: Any) -> None:
    store[key] = value
    store.move_to_end(key)
    while len(store) > MAX_KEPT:
        store.popitem(last=False)
