"""`rollout serve`: an OpenAI-compatible HTTP server in front of a running `RolloutEngine`.

Every request becomes one prompt submitted to the engine's scheduler on a channel of its own
(`RolloutEngine.submit`, not counted for training), so HTTP traffic gets routing, in-flight updates,
crash migration and exact per-token epochs like Python callers. A conversation's turns share a
session (the `X-Session-Id` header, `session_id` in the body, or found from the token ids an
assistant message carries): each turn runs on the engine of the turn before and reuses its KV.
Turns sent with an `episode_id` are kept; `POST /v1/episodes/{id}/reward` closes the episode and
hands it to the learner's queue as one training sample (`engine.batches()` trains on it).
Owns: the routes (FastAPI on uvicorn), overload (429 with `Retry-After` past
`serve.max_concurrency` requests in flight, never unbounded memory), client disconnects (abort
the engine request), the error shape (`openai_api.ApiError`; whatever a request holds, an error
of its own, never a 500 or a stopped server), `stream: true` (server-sent events in OpenAI's chunk
format, sent when the turn ends), sessions, and episodes kept until rewarded (a reward answered
429 keeps its episode for the retry). `seed`: a seeded request runs under one fixed prompt id,
so the same seed, request and weights give the same tokens (the per-request vLLM seed is derived
from the seed and the prompt id).
Does not own: the wire format (`rollout.serve.openai_api`), reading bodies off the loop, listening,
auth, metrics (`rollout.serve.io`), scheduling (`rollout.scheduling.scheduler`), vLLM's RL routes (`rollout.serve.rl_routes`).
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations (the local
# `Request` import) when they are defined.
import hashlib
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import msgspec

from rollout.config import Config, ServeConfig
from rollout.episodes.chat import chat_parsers
from rollout.episodes.loop import assemble
from rollout.errors import EngineClosedError, EngineDeadError, InvalidPromptError, RetryableError
from rollout.log import get_logger
from rollout.serve import io
from rollout.serve import openai_api as api
from rollout.serve.rl_routes import add_rl_routes
from rollout.types import Group, Prompt, Trajectory, printable
from rollout.types import Request as EngineRequest  # `Request` is FastAPI's here

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from rollout.handoff.queue import Submission
    from rollout.metrics.figures import Collector
    from rollout.weights.transfer import WeightSyncClient

log = get_logger(__name__)
MAX_KEPT = 65536  # sessions found by token ids, episodes collecting turns: the oldest forgotten first
SEEDED = "http-seeded"  # the prompt id of every request with a `seed`: its vLLM seed depends on the seed alone
RETRY_AFTER = {"Retry-After": "1"}  # seconds; the OpenAI SDK waits this long before its retry


class ServedEngine(Protocol):
    """What the server and its RL routes use of the engine (`RolloutEngine` is one)."""

    cfg: Config
    model_path: str

    @property
    def epoch(self) -> int: ...
    @property
    def healthy(self) -> bool: ...
    def submit(self, prompts: list[Prompt], *, train: bool = True) -> "Submission": ...
    async def hand_in(self, group: Group) -> None: ...
    def prometheus_collector(self) -> "Collector": ...
    def weight_sync_client(self, *, wait: bool = True) -> "WeightSyncClient": ...
    async def pause_generation(self, mode: str) -> None: ...
    async def resume_generation(self) -> None: ...
    async def is_paused(self) -> bool: ...


class Server:
    """The app and its uvicorn server, on the engine's event loop (`start`, `stop`)."""

    def __init__(self, engine: ServedEngine, cfg: ServeConfig, api_key: str | None = None):
        """Raises InvalidConfigError for an API key HTTP cannot carry."""
        self.engine = engine
        self.cfg = cfg
        self.api_key = io.check_api_key(api_key if api_key is not None else cfg.api_key)
        self.max_model_len = engine.cfg.model.max_model_len
        self.chat = io.served_chat(engine.model_path, self.max_model_len)
        self.parsers = chat_parsers(self.chat, cfg.tool_parser, cfg.reasoning_parser)
        self.model = cfg.model_name or engine.cfg.model.path
        self.by_ids: OrderedDict[bytes, str] = OrderedDict()  # hash of a turn's prompt + generation -> session
        self.episodes: OrderedDict[str, list[Trajectory]] = OrderedDict()
        self.inflight = 0
        self.running: dict[object, tuple[str, Callable[[], None]]] = {}  # requests in flight: (request id, abort it)
        self.url = ""
        self._server: Any = None
        self._done = anyio.Event()
        self._stats = io.Stats(engine.prometheus_collector())
        self._prepare = io.Preparer()
        self.app = self._app()

    async def start(self, tg: "TaskGroup", host: str | None = None, port: int | None = None) -> str:
        """Listen (on `serve.host`/`serve.port` unless given; port 0: a free one); returns the URL.
        Raises OSError naming the address when it cannot listen; the engine is untouched."""
        import uvicorn

        host, port = host or self.cfg.host, self.cfg.port if port is None else port
        sock = io.listen(host, port)  # bound here: uvicorn's own bind calls sys.exit, which would end the engine's task group
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False)
        self._server = io.uvicorn_server(config)

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

        app = FastAPI(title="rollout", docs_url=None, redoc_url=None, openapi_url=None)
        if self.api_key:
            app.add_middleware(io.ApiKey, key=self.api_key)

        async def handle(request: Request, parse: Callable[[dict[str, Any]], Any], work: Any, streams: bool = False) -> Any:
            """1) read the body (size limit) 2) admit it (429 past max_concurrency) 3) decode and
            `parse` it, off the loop when large 4) `work` on the parsed request 5) reply."""
            started = time.perf_counter()
            status, call = 200, None
            try:
                body = await io.read_body(request, self.cfg.max_body_bytes)
                if self.inflight >= self.cfg.max_concurrency:
                    raise api.ApiError(429, f"busy: {self.inflight} requests in flight (serve.max_concurrency)", kind="rate_limit_error",
                                       headers=RETRY_AFTER)  # fmt: skip
                self.inflight += 1
                try:
                    data, call, (stream, usage) = await self._prepare.run(body, lambda b: self._parse(b, parse, streams))
                    reply = await work(request, data, call)
                    return Response(api.events(reply, usage), media_type="text/event-stream") if stream else io.json_response(reply)
                finally:
                    self.inflight -= 1
            except api.ApiError as e:
                status = e.status
                return io.error(e)
            except InvalidPromptError as e:  # the engine's own checks: the field named as ours are
                status = 400
                return io.error(api.ApiError(400, str(e), call.param_of(str(e)) if isinstance(call, api.Call) else None))
            except RetryableError as e:  # the engine busy: the client's retry will do
                status = 429
                return io.error(api.ApiError(429, str(e), kind="rate_limit_error", headers=RETRY_AFTER))
            except (EngineDeadError, EngineClosedError) as e:
                status = 503
                return io.error(api.ApiError(503, f"engine unavailable: {e}", kind="service_unavailable"))
            except Exception as e:  # a defect: answered in OpenAI's shape, logged, the server serves on
                status = 500
                log.exception("serve: request failed", path=request.url.path)
                return io.error(api.ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error"))
            finally:
                self._stats.request(request.url.path, status, time.perf_counter() - started)

        def session_of(request: Request) -> Callable[[dict[str, Any]], api.Call]:
            return lambda data: api.chat(data, self.chat, request.headers.get("x-session-id") or api._str(data, "session_id"), self.parsers)

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
            return await handle(request, lambda data: None, lambda r, data, call: self._reward(episode_id, data))

        @app.get("/v1/models")
        async def models() -> Any:
            return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "rollout",
                                                "max_model_len": self.max_model_len}]}  # fmt: skip

        @app.get("/health")
        async def health() -> Any:
            alive = self.engine.healthy
            return io.json_response({"status": "ok" if alive else "no engine"}, 200 if alive else 503)

        @app.get("/metrics")
        async def metrics() -> Any:
            return PlainTextResponse(await self._stats.exposition(), media_type="text/plain; version=0.0.4")

        add_rl_routes(app, self)  # vLLM's /pause, /resume, weight-transfer routes, ... (`rollout.serve.rl_routes`)

        @app.exception_handler(404)
        async def not_found(request: Request, exc: Any) -> Response:
            return io.error(api.ApiError(404, f"no route {request.method} {request.url.path}", kind="not_found_error"))

        @app.exception_handler(405)
        async def not_allowed(request: Request, exc: Any) -> Response:
            return io.error(api.ApiError(405, f"{request.method} is not served on {request.url.path}", kind="invalid_request_error"))

        return app

    def _parse(self, body: bytes, parse: Callable[[dict[str, Any]], Any], streams: bool) -> tuple[dict[str, Any], Any, tuple[bool, bool]]:
        """The body decoded and checked, and the request it makes (`parse`): the CPU-heavy part of a
        request (JSON, rendering, tokenizing), run where `Preparer` says."""
        data = io.decode(body)
        self._check_model(data)
        return data, parse(data), api.streamed(data) if streams else (False, False)

    def _check_model(self, data: dict[str, Any]) -> None:
        model = data.get("model")
        if model is not None and model != self.model:
            raise api.ApiError(404, f"model {printable(model)!r} does not exist; this server serves {self.model!r}", "model",
                               "not_found_error")  # fmt: skip

    # -- endpoints -----------------------------------------------------------------------------

    async def _chat(self, request: Any, data: dict[str, Any], call: api.Call) -> dict[str, Any]:
        call.episode = call.episode or request.headers.get("x-episode-id")
        trajs = await self._run(request, call)
        return api.chat_response(call, trajs, self.model, self.chat, self.parsers)

    async def _completion(self, request: Any, data: dict[str, Any], call: api.Call) -> dict[str, Any]:
        return api.completion_response(call, await self._run(request, call), self.model, self.chat)

    async def _generate(self, request: Any, data: dict[str, Any], call: api.Call) -> dict[str, Any]:
        request_id = printable(data.get("request_id") or uuid.uuid4().hex)
        return api.generate_response(await self._run(request, call, request_id), request_id)

    async def _run(self, request: Any, call: api.Call, rid: str | None = None) -> list[Trajectory]:
        """One prompt (its `n` samples) through the engine; the client going away aborts it, and so
        does `/abort_requests` naming its id (`X-Request-Id`, else `rid`, else its prompt id)."""
        room = self.max_model_len - len(call.prompt_ids)
        if room < 1 or call.sampling.get("max_tokens", 1) > room:
            asked = len(call.prompt_ids) + call.sampling.get("max_tokens", 0)
            raise api.ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                                    f"{asked} tokens ({len(call.prompt_ids)} in the messages).", call.ids_param)  # fmt: skip
        base = self.engine.cfg.sampling
        call.sampling.setdefault("max_tokens", min(base.max_tokens, room))
        call.sampling.setdefault("min_tokens", 0)
        call.stop, call.stop_ids = call.sampling.get("stop", list(base.stop)), call.sampling.get("stop_token_ids", list(base.stop_token_ids))
        single = call.sampling.get("n", 1) == 1  # a session continues one conversation: n samples start none
        session = (call.session or self._session_of(call.prompt_ids, call.prefix)) if single else None
        pid = SEEDED if call.sampling.get("seed") is not None else f"http-{uuid.uuid4().hex[:12]}"
        prompt = Prompt(token_ids=call.prompt_ids, sampling=call.sampling, session=session, id=pid)
        submission = self.engine.submit([prompt], train=False)
        failure: Exception | None = None
        groups: list[Group] | None = None
        aborted, token = False, object()
        try:
            async with anyio.create_task_group() as tg:

                def abort() -> None:  # POST /abort_requests (`rollout.serve.rl_routes`)
                    nonlocal aborted
                    aborted = True
                    submission.cancel()
                    tg.cancel_scope.cancel()

                self.running[token] = (request.headers.get("x-request-id") or rid or pid, abort)

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
        finally:
            self.running.pop(token, None)
        if failure is not None:
            raise failure
        if groups is None and aborted:
            raise api.ApiError(499, "aborted by POST /abort_requests", kind="request_aborted")
        if groups is None:
            raise api.ApiError(499, "the client closed the request", kind="client_closed_request")
        (group,) = groups
        if group.error is not None or not group.trajectories:
            raise api.ApiError(400, group.error or "no sample came back", call.param_of(group.error or ""))
        for traj in group.trajectories:
            if not traj.ok:
                raise api.ApiError(500, f"generation failed: {traj.error}", kind="server_error")
            self._stats.tokens(len(traj.prompt_token_ids), len(traj.token_ids))
        if session is not None:
            self._remember(session, group.trajectories[0], call.episode)
        return group.trajectories

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
            self._stats.episodes_forgotten.inc(_put(self.episodes, episode, turns))

    async def _reward(self, episode_id: str, data: dict[str, Any]) -> dict[str, Any]:
        """Close an episode: its turns become one trajectory, rewarded, handed to the learner. A full
        learner's queue (429) leaves the episode as it was, for the client's retry."""
        value = data.get("reward")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
            raise api.ApiError(400, "reward: expected a finite number", "reward")
        turns = self.episodes.pop(episode_id, None)
        if not turns:
            raise api.ApiError(404, f"episode {printable(episode_id)!r}: no turns were served with this episode_id", kind="not_found_error")
        observations = []
        for a, b in zip(turns, turns[1:]):
            before = a.prompt_token_ids + a.token_ids
            if b.prompt_token_ids[: len(before)] != before:
                raise api.ApiError(409, f"episode {printable(episode_id)!r}: a turn does not continue the one before token for token")
            observations.append(b.prompt_token_ids[len(before) :])
        request = EngineRequest(episode_id, episode_id, 0, self.engine.cfg.sampling, token_ids=turns[0].prompt_token_ids)
        episode = assemble(request, turns, observations, "stop", None)
        episode.reward = float(value)
        group = Group(prompt_id=episode_id, prompt=Prompt(token_ids=turns[0].prompt_token_ids, id=episode_id), trajectories=[episode])
        try:
            await self.engine.hand_in(group)
        except RetryableError as e:
            kept = turns + self.episodes.get(episode_id, [])  # kept for the retry, before any turn sent meanwhile
            self._stats.episodes_forgotten.inc(_put(self.episodes, episode_id, kept))
            raise api.ApiError(429, str(e), kind="rate_limit_error", headers=RETRY_AFTER) from e
        return {"episode_id": episode_id, "turns": len(turns), "tokens": len(episode.token_ids), "reward": episode.reward}


def _key(ids: list[int]) -> bytes:
    return hashlib.blake2b(msgspec.msgpack.encode(ids), digest_size=16).digest()


def _put(store: OrderedDict, key: Any, value: Any) -> int:
    """Store `value` as the newest; returns how many of the oldest were forgotten past MAX_KEPT."""
    store[key] = value
    store.move_to_end(key)
    forgotten = 0
    while len(store) > MAX_KEPT:
        store.popitem(last=False)
        forgotten += 1
    return forgotten
