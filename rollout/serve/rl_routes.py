"""vLLM's RL control routes on `rollout serve`, with vLLM's request and response shapes
(`vllm/entrypoints/rl/online/api_router.py`), so a learner written against vLLM's server (its
`HTTPVLLMWeightSyncClient`, its /pause and /resume) drives this engine unmodified.

    POST /pause?mode=abort|wait|keep   POST /resume   GET /is_paused   POST /abort_requests
    POST /init_weight_transfer_engine  /start_weight_update  /update_weights  /finish_weight_update
    POST /shutdown_weight_transfer_engine  /update_weight_version   GET /weight_info  /get_world_size

Owns: the routes: reading each request and calling the backend (`rollout.serve.backend`, on the engine's
loop whichever front-end process took the request), which does the work. The weight-transfer routes
call the engine's `weight_sync_client()` (`rollout.weights.transfer`: the two-phase guarantee, epochs allocated once,
`finish_weight_update` starts the new epoch); /pause and /resume hold every live engine's vLLM
paused (`VLLMPolicy.pause_generation`), through any update meanwhile, restarted engines too (those
parked for the next update included: `WeightUpdates.held`); /abort_requests aborts HTTP
requests in flight (never the learner's own rollouts: their samples are its training data).
Errors in vLLM's shape (`{"error": {"message", "type", "param", "code"}}`): a call out of order
409, weights that do not fit the model 400, an engine failing 500, none alive 503; each names the
call, and the epoch stays. Bodies are read like every other route's (`serve.max_body_bytes`,
UTF-8, depth) and mirrored as msgspec Structs: vLLM declares them as FastAPI `Body(embed=True)`
parameters, not models we could import, and its pydantic would bypass that reading.
The API key covers these routes like the rest, from every host (vLLM's own server leaves them
outside `--api-key`, and they replace the weights every engine serves); vLLM's client, which sets
no header, carries it in its URL (`http://rollout:KEY@host:port`, sent as HTTP Basic auth:
`rollout.serve.auth.authorized`).
Does not own: the work (`rollout.serve.backend`), the update itself (`rollout.weights.transfer`), the
key's check (`rollout.serve.auth.ApiKey`), pausing vLLM (`policies.vllm_policy`).
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations.
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import msgspec

from rollout.serve import bodies
from rollout.serve import openai_api as api
from rollout.serve.backend import rl_error

PAUSE_MODES = ("abort", "wait", "keep")
TRUE, FALSE = ("true", "1", "yes", "on", "t", "y"), ("false", "0", "no", "off", "f", "n")


class InitBody(msgspec.Struct):
    init_info: dict[str, Any]


class UpdateBody(msgspec.Struct):
    update_info: dict[str, Any] | list[dict[str, Any]]


# A weight version label is echoed by every /weight_info: at most this many characters (vLLM's
# are a step number or a short name); a longer one answers 400 naming the field, and is not kept.
MAX_VERSION_CHARS = 256
Label = Annotated[str, msgspec.Meta(max_length=MAX_VERSION_CHARS)]


class FinishBody(msgspec.Struct):
    weight_version: Label | None = None


class VersionBody(msgspec.Struct):
    new_version: Label


class AbortBody(msgspec.Struct):
    request_ids: list[str] | None = None


def add_rl_routes(app: Any, backend: Any, max_body_bytes: int) -> None:
    """vLLM's RL routes on `app`, over `backend` (a `rollout.serve.backend.Backend` or a front end's
    `RemoteBackend`); bodies up to `max_body_bytes`."""
    from fastapi import Request

    routes = RLRoutes(backend, max_body_bytes)

    def route(method: str, path: str, work: Callable[[Request], Awaitable[dict[str, Any]]]) -> None:
        async def endpoint(request: Request) -> Any:
            return await routes.answer(request, work)

        app.add_api_route(path, endpoint, methods=[method])

    route("POST", "/pause", routes.pause)
    route("POST", "/resume", routes.resume)
    route("GET", "/is_paused", routes.is_paused)
    route("POST", "/abort_requests", routes.abort_requests)
    route("POST", "/init_weight_transfer_engine", routes.init)
    route("POST", "/shutdown_weight_transfer_engine", routes.shutdown)
    route("POST", "/start_weight_update", routes.start)
    route("POST", "/update_weights", routes.update)
    route("POST", "/finish_weight_update", routes.finish)
    route("POST", "/update_weight_version", routes.label)
    route("GET", "/weight_info", routes.weight_info)
    route("GET", "/get_world_size", routes.world_size)


class RLRoutes:
    """The routes: each reads its request and calls the backend (`rollout.serve.backend.Backend`: the work,
    on the engine's loop), which returns vLLM's response body (our additions: `epoch`)."""

    def __init__(self, backend: Any, max_body_bytes: int):
        self.backend, self.max_body_bytes = backend, max_body_bytes

    async def answer(self, request: Any, work: Callable[[Any], Awaitable[dict[str, Any]]]) -> Any:
        started, status = time.perf_counter(), 200
        try:
            return bodies.json_response(await work(request))
        except api.ApiError as e:
            status = e.status
            return bodies.error(e)
        except Exception as e:  # the backend's are ApiErrors already: this one is the route's or the way's
            error = rl_error(e)
            status = error.status
            return bodies.error(error)
        finally:
            self.backend.record(request.url.path, status, time.perf_counter() - started)

    async def pause(self, request: Any) -> dict[str, Any]:
        """vLLM's /pause: every live engine's vLLM stays paused until /resume (`clear_cache`, deprecated
        in vLLM, is accepted and ignored: an update clears caches as `weight_sync.mode` says)."""
        mode = request.query_params.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise api.ApiError(
                400, f"mode: expected one of {', '.join(PAUSE_MODES)}, got {mode[:40]!r}", "mode", "BadRequestError"
            )
        return await self.backend.pause(mode)

    async def resume(self, request: Any) -> dict[str, Any]:
        return await self.backend.resume()

    async def is_paused(self, request: Any) -> dict[str, Any]:
        return await self.backend.is_paused()

    async def abort_requests(self, request: Any) -> dict[str, Any]:
        """HTTP requests in flight with these ids (`X-Request-Id`, a generate request's
        `request_id`); none named: all of them. Each answers 499."""
        return await self.backend.abort((await self._body(request, AbortBody)).request_ids)

    async def init(self, request: Any) -> dict[str, Any]:
        return await self.backend.init((await self._body(request, InitBody)).init_info)

    async def shutdown(self, request: Any) -> dict[str, Any]:
        return await self.backend.shutdown()

    async def start(self, request: Any) -> dict[str, Any]:
        return await self.backend.start()

    async def update(self, request: Any) -> dict[str, Any]:
        return await self.backend.update((await self._body(request, UpdateBody)).update_info)

    async def finish(self, request: Any) -> dict[str, Any]:
        """The new epoch starts here; `weight_version` labels it."""
        return await self.backend.finish((await self._body(request, FinishBody)).weight_version)

    async def label(self, request: Any) -> dict[str, Any]:
        return await self.backend.label((await self._body(request, VersionBody)).new_version)

    async def weight_info(self, request: Any) -> dict[str, Any]:
        return await self.backend.weight_info()

    async def world_size(self, request: Any) -> dict[str, Any]:
        """include_dp (default): model workers over every engine; false: one engine's."""
        flag = request.query_params.get("include_dp", "true").lower()
        if flag not in TRUE + FALSE:  # what FastAPI's bool query (vLLM's route) accepts
            raise api.ApiError(
                400, f"include_dp: expected true or false, got {flag[:40]!r}", "include_dp", "BadRequestError"
            )
        return await self.backend.world_size(flag in TRUE)

    async def _body(self, request: Any, kind: type) -> Any:
        """The body as `kind` (an empty body: its defaults). Raises ApiError(400) naming the field."""
        body = await bodies.read_body(request, self.max_body_bytes)
        data = bodies.decode(body) if body.strip() else {}
        try:
            return msgspec.convert(data, kind)
        except msgspec.ValidationError as e:  # "... - at `$.field[0]`" or "Object missing required field `field`"
            text = str(e)
            at = text.split("`$.", 1)[1] if "`$." in text else text.split("`")[1] if "`" in text else ""
            field = at.split("`")[0].split("[")[0].split(".")[0] or None
            raise api.ApiError(400, f"{request.url.path}: {text}", field, "BadRequestError") from e
