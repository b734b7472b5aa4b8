"""vLLM's RL control routes on `rollout serve`, with vLLM's request and response shapes
(`vllm/entrypoints/rl/online/api_router.py`), so a learner written against vLLM's server (its
`HTTPVLLMWeightSyncClient`, its /pause and /resume) drives this engine unmodified.

    POST /pause?mode=abort|wait|keep   POST /resume   GET /is_paused   POST /abort_requests
    POST /init_weight_transfer_engine  /start_weight_update  /update_weights  /finish_weight_update
    POST /shutdown_weight_transfer_engine  /update_weight_version   GET /weight_info  /get_world_size

Owns: the routes and their mapping onto the engine. The weight-transfer routes call the engine's
`weight_sync_client()` (`rollout.weights.transfer`: the two-phase guarantee, epochs allocated once,
`finish_weight_update` starts the new epoch); /pause and /resume hold every live engine's vLLM
paused (`VLLMPolicy.pause_generation`), through any update meanwhile, restarted engines too (those
parked for the next update included: `WeightUpdates.held`); /abort_requests aborts HTTP
requests in flight (never the learner's own rollouts: their samples are its training data).
Errors in vLLM's shape (`{"error": {"message", "type", "param", "code"}}`): a call out of order
409, weights that do not fit the model 400, an engine failing 500, none alive 503; each names the
call, and the epoch stays. Bodies are read like every other route's (`serve.max_body_bytes`,
UTF-8, depth) and mirrored as msgspec Structs: vLLM declares them as FastAPI `Body(embed=True)`
parameters, not models we could import, and its pydantic would bypass that reading.
Does not own: the update itself (`rollout.weights.transfer`), auth (the app's `server_io.ApiKey`
covers these routes like the rest), pausing vLLM (`policies.vllm_policy`).
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations.
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import msgspec

from rollout.errors import EngineClosedError, EngineDeadError, InvalidWeightsError, WeightSyncError
from rollout.log import get_logger
from rollout.serve import io
from rollout.serve import openai_api as api

if TYPE_CHECKING:
    from rollout.serve.server import Server

log = get_logger(__name__)
PAUSE_MODES = ("abort", "wait", "keep")
TRUE, FALSE = ("true", "1", "yes", "on", "t", "y"), ("false", "0", "no", "off", "f", "n")


class InitBody(msgspec.Struct):
    init_info: dict[str, Any]


class UpdateBody(msgspec.Struct):
    update_info: dict[str, Any] | list[dict[str, Any]]


class FinishBody(msgspec.Struct):
    weight_version: str | None = None


class VersionBody(msgspec.Struct):
    new_version: str


class AbortBody(msgspec.Struct):
    request_ids: list[str] | None = None


def add_rl_routes(app: Any, server: "Server") -> None:
    """vLLM's RL routes on `app`, over `server.engine` (a running `RolloutEngine`)."""
    from fastapi import Request

    routes = RLRoutes(server)

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
    """The routes' work; each returns vLLM's response body (our additions: `epoch`)."""

    def __init__(self, server: "Server"):
        self.server, self.engine = server, server.engine
        self._client: Any = None

    @property
    def client(self) -> Any:
        """The engine's `WeightSyncClient`; made on the engine's loop at the first call (its
        `transfer` is the engine's one `WeightTransfer`, shared with Python learners)."""
        if self._client is None:
            self._client = self.engine.weight_sync_client()
        return self._client

    async def answer(self, request: Any, work: Callable[[Any], Awaitable[dict[str, Any]]]) -> Any:
        started, status = time.perf_counter(), 200
        try:
            return io.json_response(await work(request))
        except api.ApiError as e:
            status = e.status
            return io.error(e)
        except Exception as e:
            status, e = _status(e)
            return io.error(api.ApiError(status, str(e), kind=HTTPStatus(status).phrase))
        finally:
            self.server._stats.request(request.url.path, status, time.perf_counter() - started)

    # -- generation ------------------------------------------------------------------------------

    async def pause(self, request: Any) -> dict[str, Any]:
        """vLLM's /pause: every live engine's vLLM stays paused until /resume (`clear_cache`, deprecated
        in vLLM, is accepted and ignored: an update clears caches as `weight_sync.mode` says)."""
        mode = request.query_params.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise api.ApiError(400, f"mode: expected one of {', '.join(PAUSE_MODES)}, got {mode[:40]!r}", "mode", "BadRequestError")
        await self.engine.pause_generation(mode)
        return {"status": "paused"}

    async def resume(self, request: Any) -> dict[str, Any]:
        await self.engine.resume_generation()
        return {"status": "resumed"}

    async def is_paused(self, request: Any) -> dict[str, Any]:
        return {"is_paused": await self.engine.is_paused()}

    async def abort_requests(self, request: Any) -> dict[str, Any]:
        """HTTP requests in flight with these ids (`X-Request-Id`, a generate request's
        `request_id`); none named: all of them. Each answers 499."""
        ids = (await self._body(request, AbortBody)).request_ids
        chosen = [abort for rid, abort in list(self.server.running.values()) if not ids or rid in ids]
        for abort in chosen:
            abort()
        return {"status": "aborted", "aborted": len(chosen)}

    # -- weights (vLLM's four calls, `rollout.weights.transfer`) -------------------------------------------

    async def init(self, request: Any) -> dict[str, Any]:
        await self.client.transfer.init((await self._body(request, InitBody)).init_info)
        return {"message": "Weight transfer initialized"}

    async def shutdown(self, request: Any) -> dict[str, Any]:
        self.client.shutdown_weight_transfer_engine()
        return {"message": "Weight transfer shut down"}

    async def start(self, request: Any) -> dict[str, Any]:
        await self.client.transfer.start()
        return {"message": "Weight update started"}

    async def update(self, request: Any) -> dict[str, Any]:
        await self.client.transfer.update((await self._body(request, UpdateBody)).update_info)
        return {"message": "Weights updated"}

    async def finish(self, request: Any) -> dict[str, Any]:
        """The new epoch starts here; `weight_version` labels it."""
        epoch = await self.client.transfer.finish((await self._body(request, FinishBody)).weight_version)
        return {"message": "Weight update finished", "epoch": epoch}

    async def label(self, request: Any) -> dict[str, Any]:
        new_version = (await self._body(request, VersionBody)).new_version
        return {"success": True, "new_version": new_version, "epoch": self.client.transfer.label(new_version)}

    async def weight_info(self, request: Any) -> dict[str, Any]:
        """The current epoch's label (`update_weight_version`, `finish_weight_update`'s
        `weight_version`), else the epoch as a string (vLLM's weight version on every engine)."""
        epoch = self.engine.epoch
        labels = [v for v, e in self.client.transfer.versions.items() if e == epoch]
        return {"weight_version": labels[-1] if labels else str(epoch), "epoch": epoch}

    async def world_size(self, request: Any) -> dict[str, Any]:
        """include_dp (default): model workers over every engine (each engine is a data-parallel
        replica), what a learner's group adds itself to; false: one engine's."""
        flag = request.query_params.get("include_dp", "true").lower()
        if flag not in TRUE + FALSE:  # what FastAPI's bool query (vLLM's route) accepts
            raise api.ApiError(400, f"include_dp: expected true or false, got {flag[:40]!r}", "include_dp", "BadRequestError")
        if flag in TRUE:
            return {"world_size": self.client.transfer.world_size()}
        v = self.engine.cfg.engines.vllm
        return {"world_size": int(v.get("tensor_parallel_size", 1)) * int(v.get("pipeline_parallel_size", 1))}

    async def _body(self, request: Any, kind: type) -> Any:
        """The body as `kind` (an empty body: its defaults). Raises ApiError(400) naming the field."""
        body = await io.read_body(request, self.server.cfg.max_body_bytes)
        data = io.decode(body) if body.strip() else {}
        try:
            return msgspec.convert(data, kind)
        except msgspec.ValidationError as e:  # "... - at `$.field[0]`" or "Object missing required field `field`"
            text = str(e)
            at = text.split("`$.", 1)[1] if "`$." in text else text.split("`")[1] if "`" in text else ""
            field = at.split("`")[0].split("[")[0].split(".")[0] or None
            raise api.ApiError(400, f"{request.url.path}: {text}", field, "BadRequestError") from e


def _status(e: Exception) -> tuple[int, Exception]:
    """The HTTP status of what a route raised: out of order 409, bad weights 400, engines 500/503."""
    if isinstance(e, InvalidWeightsError):
        return 400, e
    if isinstance(e, WeightSyncError):
        return (409 if not e.failed else 500), e
    if isinstance(e, (EngineDeadError, EngineClosedError)):
        return 503, e
    if isinstance(e, (ValueError, TypeError, KeyError)):
        return 400, e
    log.exception("serve: an RL route failed")
    return 500, RuntimeError(f"internal error: {type(e).__name__}: {e}")
