"""The serving state that lives next to the engine: sessions, episodes, requests in flight, the
server's figures and vLLM's RL calls.

`rollout serve` splits in two halves. The HTTP half (`rollout.serve.server.Server`: routes, bodies,
rendering, tokenizing, response building, most of a request's CPU) can run in several processes
(`serve.api_servers`, `rollout.serve.frontends`); this half runs once, on the engine's event loop,
so whichever process took a request, a conversation finds the session (and the engine) of its turn
before, an episode collects every turn it was served, `/abort_requests` reaches every request in
flight and a weight update is one update. Every method takes and returns plain data (what msgpack
carries) and raises `ApiError` or the engine's own errors, so the HTTP half calls it in process or
over `rollout.serve.frontends.RemoteBackend`, the same way.

Owns: a request's run through the engine (its session, its abort), the sessions found by token
ids, the episodes kept until rewarded and each reward's outcome (a retried reward POST gets the
first one's, never a second group), the Prometheus figures, the RL routes' work and its errors
in vLLM's statuses (out of order 409, weights that do not fit 400, an engine failing 500, none
alive 503). Does not own: HTTP (`rollout.serve.server`, `rollout.serve.rl_routes`), scheduling.
"""

from __future__ import annotations

import hashlib
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from functools import wraps
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

import anyio
import msgspec

from rollout.episodes.loop import assemble
from rollout.errors import (
    EngineClosedError,
    EngineDeadError,
    InvalidPromptError,
    InvalidWeightsError,
    RetryableError,
    WeightSyncError,
)
from rollout.log import get_logger
from rollout.metrics.prometheus import HttpStats
from rollout.serve.openai_api import ApiError
from rollout.types import Group, Prompt, Trajectory, printable
from rollout.types import Request as EngineRequest

if TYPE_CHECKING:
    from rollout.config import Config
    from rollout.handout.queue import Submission
    from rollout.metrics.prometheus import Collector
    from rollout.weights.sync_client import WeightSyncClient

log = get_logger(__name__)
MAX_KEPT = 65536  # sessions found by token ids, episodes collecting turns: the oldest forgotten first
SEEDED = "http-seeded"  # the prompt id of every request with a `seed`: its vLLM seed depends on the seed alone
RETRY_AFTER = {"Retry-After": "1"}  # seconds; the OpenAI SDK waits this long before its retry
RESTART_RETRY_S = 10  # Retry-After while no engine is in rotation and one starts again
P, T = ParamSpec("P"), TypeVar("T")


class ServedEngine(Protocol):
    """What the backend uses of the engine (`RolloutEngine` is one)."""

    cfg: Config
    model_path: str

    @property
    def epoch(self) -> int: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def restarting(self) -> bool: ...
    def submit(
        self, prompts: list[Prompt], *, train: bool = True,
        on_tokens: Callable[[int, int, int, list[int], list[float]], None] | None = None,
    ) -> Submission: ...  # fmt: skip
    async def deliver(self, group: Group) -> None: ...
    def prometheus_collector(self) -> Collector: ...
    def weight_sync_client(self, *, wait: bool = True) -> WeightSyncClient: ...
    async def pause_generation(self, mode: str) -> None: ...
    async def resume_generation(self) -> None: ...
    async def is_paused(self) -> bool: ...


def rl_call(work: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """An RL route's work, its failures as vLLM's statuses (each message names the call or tensor)."""

    @wraps(work)
    async def call(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await work(*args, **kwargs)
        except ApiError:
            raise
        except Exception as e:
            raise rl_error(e) from e

    return call


class Backend:
    """One per served engine, on its event loop; any number of HTTP front ends call it."""

    def __init__(self, engine: ServedEngine, end_of_turn: int | None):
        self.engine = engine
        self.end_of_turn = (
            end_of_turn  # the chat template's end-of-turn id: a turn's ids end with it in the next prompt
        )
        self.by_ids: OrderedDict[bytes, str] = OrderedDict()  # hash of a turn's prompt + generation -> session
        self.episodes: OrderedDict[str, list[Trajectory]] = OrderedDict()
        self.rewarded: OrderedDict[str, Outcome] = OrderedDict()  # closed episodes: what their reward POST got
        self.running: dict[object, tuple[str, Callable[[], None]]] = {}  # requests in flight: (request id, abort it)
        self.stats = HttpStats(engine.prometheus_collector())
        self._client: WeightSyncClient | None = None

    # -- requests ----------------------------------------------------------------------------

    async def run(self, prompt_ids: list[int], sampling: dict[str, Any], session: str | None, prefix: int,
                  episode: str | None, rid: str | None,
                  on_tokens: Callable[[int, int, list[int], list[float]], None] | None = None,
                  ) -> list[Trajectory]:  # fmt: skip
        """One prompt (its `n` samples) through the engine, in the session of the turn it continues.
        Cancelled (the client gone), it aborts the engine request; `/abort_requests` naming `rid`
        (else its prompt id) answers 499. Raises InvalidPromptError for what the engine refused.
        `on_tokens(sample_index, position, token_ids, logprobs)`: streamed, each sample's new
        tokens after every engine step (`RolloutEngine.submit`). With no engine in rotation and
        one starting again: 503 at once, with `Retry-After`."""
        if not self.engine.healthy and self.engine.restarting:  # a client's retry does better than a wait
            raise ApiError(503, "no engine in rotation: one is starting again; retry", kind="service_unavailable",
                           headers={"Retry-After": str(RESTART_RETRY_S)})  # fmt: skip
        single = sampling.get("n", 1) == 1  # a session continues one conversation: n samples start none
        session = (session or self._session_of(prompt_ids, prefix)) if single else None
        pid = SEEDED if sampling.get("seed") is not None else f"http-{uuid.uuid4().hex[:12]}"
        submission = self.engine.submit(
            [Prompt(token_ids=prompt_ids, sampling=sampling, session=session, id=pid)], train=False,
            on_tokens=(lambda _, k, start, ids, lps: on_tokens(k, start, ids, lps)) if on_tokens else None,
        )  # fmt: skip
        groups, aborted, token = None, False, object()
        with anyio.CancelScope() as scope:

            def abort() -> None:  # POST /abort_requests
                nonlocal aborted
                aborted = True
                scope.cancel()

            self.running[token] = (rid or pid, abort)
            try:
                groups = await submission.result()
            finally:
                self.running.pop(token, None)
                if groups is None:  # aborted, or cancelled by whoever awaited this
                    submission.cancel()
        if groups is None and aborted:
            raise ApiError(499, "aborted by POST /abort_requests", kind="request_aborted")
        (group,) = groups
        if group.error is not None or not group.trajectories:
            raise InvalidPromptError(group.error or "no sample came back")
        for traj in group.trajectories:
            if not traj.ok:
                raise ApiError(500, f"generation failed: {traj.error}", kind="server_error")
            self.stats.tokens(len(traj.prompt_token_ids), len(traj.token_ids))
        if session is not None:
            self._remember(session, group.trajectories[0], episode)
        return group.trajectories

    def _session_of(self, ids: list[int], prefix: int) -> str:
        """The session of the turn whose ids (an assistant message's, `prefix` of them) start this
        prompt, else a new one."""
        if prefix and (session := self.by_ids.get(_key(ids[:prefix]))) is not None:
            return session
        return uuid.uuid4().hex

    def _remember(self, session: str, traj: Trajectory, episode: str | None) -> None:
        ids = traj.prompt_token_ids + traj.token_ids
        for key in (_key(ids), _key(ids + [self.end_of_turn] if self.end_of_turn is not None else ids)):
            _put(self.by_ids, key, session)
        if episode is not None:
            turns = self.episodes.get(episode) or []
            turns.append(traj)
            self.stats.episodes_forgotten.inc(_put(self.episodes, episode, turns))

    async def reward(self, episode_id: str, value: Any) -> dict[str, Any]:
        """Close an episode: its turns become one trajectory, rewarded, handed to the learner.
        Idempotent: a retry (its client timed out, its connection reset) gets the first POST's outcome,
        the answer or the error, waiting for it if the first is still handing in; turns served
        under the id after its reward make a new episode. A full learner's queue (429) leaves the
        episode as it was, for the client's retry. Raises ApiError (400 a bad reward, 404 no such
        episode, 409 turns that do not continue each other, 429), or the engine's error."""
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or value != value
            or abs(value) == float("inf")
        ):
            raise ApiError(400, "reward: expected a finite number", "reward")
        turns = self.episodes.pop(episode_id, None)
        if not turns:
            if (outcome := self.rewarded.get(episode_id)) is not None:
                return await outcome.result()
            raise ApiError(
                404,
                f"episode {printable(episode_id)!r}: no turns were served with this episode_id",
                kind="not_found_error",
            )
        outcome = Outcome()
        _put(self.rewarded, episode_id, outcome)
        try:
            with anyio.CancelScope(shield=True):  # begun, it ends: delivered once, its outcome kept
                answer = await self._deliver(episode_id, turns, float(value))
        except RetryableError as e:  # not closed: the turns are kept for the retry
            if self.rewarded.get(episode_id) is outcome:
                del self.rewarded[episode_id]
            kept = turns + self.episodes.get(episode_id, [])  # before any turn sent meanwhile
            self.stats.episodes_forgotten.inc(_put(self.episodes, episode_id, kept))
            outcome.set(error := ApiError(429, str(e), kind="rate_limit_error", headers=RETRY_AFTER))
            raise error from e
        except Exception as e:
            outcome.set(e)
            raise
        outcome.set(answer)
        return answer

    async def _deliver(self, episode_id: str, turns: list[Trajectory], reward: float) -> dict[str, Any]:
        observations = []
        for a, b in zip(turns, turns[1:]):
            before = a.prompt_token_ids + a.token_ids
            if b.prompt_token_ids[: len(before)] != before:
                raise ApiError(
                    409, f"episode {printable(episode_id)!r}: a turn does not continue the one before token for token"
                )
            observations.append(b.prompt_token_ids[len(before) :])
        first = turns[0].prompt_token_ids
        request = EngineRequest(episode_id, episode_id, 0, self.engine.cfg.sampling, token_ids=first)
        episode = assemble(request, turns, observations, "stop", None)
        episode.reward = reward
        group = Group(prompt_id=episode_id, prompt=Prompt(token_ids=first, id=episode_id), trajectories=[episode])
        await self.engine.deliver(group)
        return {"episode_id": episode_id, "turns": len(turns), "tokens": len(episode.token_ids), "reward": reward}

    def record(self, path: str, status: int, seconds: float) -> None:
        """An HTTP request answered (by any front end)."""
        self.stats.request(path, status, seconds)

    async def metrics(self) -> str:
        return await self.stats.exposition()

    async def healthy(self) -> bool:
        return self.engine.healthy

    # -- vLLM's RL routes (`rollout.serve.rl_routes`) -----------------------------------------

    @property
    def client(self) -> WeightSyncClient:
        """The engine's `WeightSyncClient`; made on the engine's loop at the first call (its
        `transfer` is the engine's one `WeightTransfer`, shared with Python learners)."""
        if self._client is None:
            self._client = self.engine.weight_sync_client()
        return self._client

    @rl_call
    async def pause(self, mode: str) -> dict[str, Any]:
        await self.engine.pause_generation(mode)
        return {"status": "paused"}

    @rl_call
    async def resume(self) -> dict[str, Any]:
        await self.engine.resume_generation()
        return {"status": "resumed"}

    @rl_call
    async def is_paused(self) -> dict[str, Any]:
        return {"is_paused": await self.engine.is_paused()}

    async def abort(self, ids: list[str] | None) -> dict[str, Any]:
        """HTTP requests in flight with these ids; none named: all of them. Each answers 499."""
        chosen = [abort for rid, abort in list(self.running.values()) if not ids or rid in ids]
        for abort in chosen:
            abort()
        return {"status": "aborted", "aborted": len(chosen)}

    @rl_call
    async def init(self, info: dict[str, Any]) -> dict[str, Any]:
        await self.client.transfer.init(info)
        return {"message": "Weight transfer initialized"}

    @rl_call
    async def shutdown(self) -> dict[str, Any]:
        self.client.shutdown_weight_transfer_engine()
        return {"message": "Weight transfer shut down"}

    @rl_call
    async def start(self) -> dict[str, Any]:
        await self.client.transfer.start()
        return {"message": "Weight update started"}

    @rl_call
    async def update(self, info: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
        await self.client.transfer.update(info)
        return {"message": "Weights updated"}

    @rl_call
    async def finish(self, version: str | None) -> dict[str, Any]:
        """The new epoch starts here; `version` labels it."""
        return {"message": "Weight update finished", "epoch": await self.client.transfer.finish(version)}

    @rl_call
    async def label(self, version: str) -> dict[str, Any]:
        return {"success": True, "new_version": version, "epoch": self.client.transfer.label(version)}

    @rl_call
    async def weight_info(self) -> dict[str, Any]:
        """The current epoch's label (`update_weight_version`, `finish_weight_update`'s
        `weight_version`), else the epoch as a string (vLLM's weight version on every engine)."""
        epoch = self.engine.epoch
        labels = [v for v, e in self.client.transfer.versions.items() if e == epoch]
        return {"weight_version": labels[-1] if labels else str(epoch), "epoch": epoch}

    @rl_call
    async def world_size(self, include_dp: bool) -> dict[str, Any]:
        """include_dp: model workers over every engine (each engine is a data-parallel replica), what a
        learner's group adds itself to; else one engine's."""
        if include_dp:
            return {"world_size": self.client.transfer.world_size()}
        v = self.engine.cfg.engines.vllm
        return {"world_size": int(v.get("tensor_parallel_size", 1)) * int(v.get("pipeline_parallel_size", 1))}


def rl_error(e: Exception) -> ApiError:
    """vLLM's status for what an RL route raised: out of order 409, bad weights 400, engines 500/503."""
    from http import HTTPStatus

    if isinstance(e, InvalidWeightsError):
        status = 400
    elif isinstance(e, WeightSyncError):
        status = 409 if not e.failed else 500
    elif isinstance(e, (EngineDeadError, EngineClosedError)):
        status = 503
    elif isinstance(e, (ValueError, TypeError, KeyError)):
        status = 400
    else:
        log.exception("serve: an RL route failed")
        status, e = 500, RuntimeError(f"internal error: {type(e).__name__}: {e}")
    return ApiError(status, str(e), kind=HTTPStatus(status).phrase)


class Outcome:
    """What an episode's reward POST got, its answer or its error, once it has one."""

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._answer: dict[str, Any] | None = None
        self._error: Exception | None = None

    def set(self, answer: dict[str, Any] | Exception) -> None:
        if isinstance(answer, Exception):
            self._error = answer
        else:
            self._answer = answer
        self._done.set()

    async def result(self) -> dict[str, Any]:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._answer is not None
        return self._answer


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
