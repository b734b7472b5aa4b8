"""A weight update's per-engine calls travel the data path, not Ray.

A Ray call costs each end ~0.3 ms of CPU; at 256 engines an update's two calls per engine held the
driver's event loop ~60-170 ms at a time, and every group an engine finished meanwhile waited behind
them (the simulator's finish-to-batch p99: 82 ms with an update every 5 s, 2.6 ms without). Once an
engine is connected, `rollout.wire.CALLS` go as a frame each way on its zmq socket; Ray
carries them before, and whatever msgpack does not carry as sent (an ObjectRef to the weights).

Real `RayEngine` handles over real `VLLMPolicy` objects on the fake vLLM (`tests.support.wire`): the frames,
the engine's dispatch and the errors are the production code; `LocalActor.made` lists what went
through the (stand-in) Ray calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import anyio
import msgspec
import pytest

from rollout.aio import fan_out
from rollout.config import Config
from rollout.errors import EngineDeadError, InvalidWeightsError, RetryableError
from rollout.types import Request, Sampling
from rollout.wire import CALL
from tests.support.wire import WirePool

TIMEOUT = 10  # seconds; reached only by a test about to fail (a hang)


@pytest.fixture
def cfg(make_cfg) -> Config:
    """One engine, one sample of 4 tokens a group."""
    return make_cfg("sampling.n=1", "sampling.max_tokens=4", "engines.count=1")


async def connected(cfg: Config) -> WirePool:
    """A pool whose engine said hello: it connects with its first group."""
    pool = await WirePool.start(cfg)
    req = Request("r0", "p", 0, Sampling(n=1, max_tokens=4), token_ids=[5, 6, 7])
    with anyio.fail_after(TIMEOUT):
        assert [t.ok async for t in pool.engines[0].generate_group([req])] == [True]
    return pool


def hang_commit(policy: object) -> tuple[asyncio.Event, asyncio.Event]:
    """The policy's `commit_weights` never ends: set `started` when it begins, `cancelled` when cancelled."""
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def commit_weights(epoch: int) -> dict[str, float]:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return {}

    policy.commit_weights = commit_weights
    return started, cancelled


async def test_an_update_s_calls_cross_the_data_path_once_the_engine_is_connected(cfg, tmp_path):
    pool = await connected(cfg)
    engine, actor, policy = pool.engines[0], pool.actors[0], pool.policies[0]
    try:
        with anyio.fail_after(TIMEOUT):
            assert await engine.stage_weights(1, str(tmp_path)) == 0
            stats = await engine.commit_weights(1)
            assert await engine.stage_weights(2, str(tmp_path)) == 0
            await engine.drop_weights(2)
    finally:
        await pool.shutdown()
    assert actor.made == ["serve"]  # before: stage_weights, commit_weights, stage_weights, drop_weights as well
    assert policy.epoch == 1 and not policy._staged
    assert {"pause_s", "load_s", "stall_s", "recomputed_tokens"} <= set(stats) and stats["stall_s"] >= stats[
        "load_s"
    ] >= 0


async def test_what_msgpack_does_not_carry_as_sent_goes_through_ray(cfg):
    """An ObjectRef does not encode; a dataclass would arrive as a dict, a tuple as a list: Ray carries them."""

    @dataclasses.dataclass
    class Info:
        rank: int

    pool = await connected(cfg)
    engine, actor = pool.engines[0], pool.actors[0]
    seen: list[object] = []

    async def init_transfer(info: object) -> None:
        seen.append(info)

    async def stage_weights(epoch: int, weights: object) -> int:
        seen.append(weights)
        return 0

    pool.policies[0].init_transfer = init_transfer
    pool.policies[0].stage_weights = stage_weights
    ref = object()
    try:
        with anyio.fail_after(TIMEOUT):
            await engine.call("init_transfer", Info(rank=3))
            await engine.call("init_transfer", {"ranks": (1, 2)})
            await engine.call("init_transfer", {"ranks": [1, 2]})
            await engine.stage_weights(1, ref)  # an ObjectRef's stand-in: it does not encode
    finally:
        await pool.shutdown()
    assert seen == [Info(rank=3), {"ranks": (1, 2)}, {"ranks": [1, 2]}, ref]  # each as sent
    assert actor.made == ["serve", "init_transfer", "init_transfer", "stage_weights"]


async def test_a_call_s_error_reaches_the_driver_as_through_ray(cfg):
    """One of ours as itself; anything else as RetryableError naming the engine and the message."""
    pool = await connected(cfg)
    engine, policy = pool.engines[0], pool.policies[0]
    raised: list[Exception] = [InvalidWeightsError("tensor 'embed.weight': shape (3, 8), the model's (260, 8)"),
                               TimeoutError("no load within weight_sync.timeout_s=1.0")]  # fmt: skip

    async def commit_weights(epoch: int) -> dict[str, float]:
        raise raised.pop(0)

    policy.commit_weights = commit_weights
    try:
        with anyio.fail_after(TIMEOUT):
            with pytest.raises(InvalidWeightsError, match=r"^tensor 'embed.weight': shape \(3, 8\)"):
                await engine.commit_weights(1)
            with pytest.raises(RetryableError, match=r"^engine 0: no load within weight_sync.timeout_s=1.0$"):
                await engine.commit_weights(1)
    finally:
        await pool.shutdown()
    assert pool.actors[0].made == ["serve"]


async def test_a_call_given_up_by_the_driver_is_cancelled_in_the_engine(cfg):
    pool = await connected(cfg)
    engine, policy = pool.engines[0], pool.policies[0]
    started, cancelled = hang_commit(policy)
    try:
        with anyio.fail_after(TIMEOUT):
            call = asyncio.ensure_future(engine.commit_weights(1))
            await started.wait()
            call.cancel()  # as `weight_sync.timeout_s` gives up on it
            await cancelled.wait()  # before: the frame path left it running in the engine
            assert call.cancelled() and not policy._calls
    finally:
        await pool.shutdown()


async def test_a_call_out_when_the_engine_goes_fails_with_engine_dead(cfg):
    pool = await connected(cfg)
    engine = pool.engines[0]
    started, _ = hang_commit(pool.policies[0])
    try:
        with anyio.fail_after(TIMEOUT):
            call = asyncio.ensure_future(engine.commit_weights(1))
            await started.wait()
            engine.close()  # the engine shut down: its `serve` call ends, and nothing will answer
            with pytest.raises(EngineDeadError, match="engine 0 was shut down"):
                await call
    finally:
        await pool.shutdown()


async def test_fan_out_lets_the_loop_turn_between_every_few_calls():
    """256 calls started in one turn held the loop for all of them; now at most `per_turn` start
    between two turns of the loop (a socket's reader runs in between)."""
    started = 0
    seen: list[int] = []  # calls started when the loop came round, at each turn
    done = False

    def turn() -> None:
        seen.append(started)
        if not done:
            asyncio.get_running_loop().call_soon(turn)

    async def call(k: int) -> int:
        nonlocal started
        started += 1
        await asyncio.sleep(0)
        return k

    asyncio.get_running_loop().call_soon(turn)
    results = await fan_out((call(k) for k in range(100)), per_turn=16)
    done = True
    assert results == list(range(100))
    steps = [b - a for a, b in itertools.pairwise(seen)]
    assert max(steps) <= 16 and seen[-1] == 100, seen  # asyncio.gather: [0, 100]


async def test_fan_out_returns_errors_in_place_and_cancelled_it_cancels_what_it_started():
    async def fails() -> None:
        raise ValueError("engine 3")

    results = await fan_out([fails(), asyncio.sleep(0, "ok")])
    assert isinstance(results[0], ValueError) and results[1] == "ok"

    started: list[int] = []
    cancelled: list[int] = []

    async def waits(k: int) -> None:
        started.append(k)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(k)
            raise

    waiting = asyncio.ensure_future(fan_out((waits(k) for k in range(40)), per_turn=4))
    while len(started) < 4:
        await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.sleep(0)
    assert 4 <= len(started) < 40 and sorted(cancelled) == sorted(started)


async def test_a_call_frame_naming_anything_else_is_refused_and_the_engine_serves_on(cfg):
    """The engine runs only `CALLS` from a call frame: a frame naming another method (`shutdown`,
    a dunder) is answered with an error naming it, nothing runs, and groups go on."""
    pool = await connected(cfg)
    engine, policy = pool.engines[0], pool.policies[0]
    ran: list[str] = []
    policy.shutdown = lambda *a: ran.append("shutdown")
    loop = asyncio.get_running_loop()
    try:
        with anyio.fail_after(TIMEOUT):
            for call_id, name in ((1001, "shutdown"), (1002, "__init__"), (1003, "_answer")):
                answer = engine._calls[call_id] = loop.create_future()
                engine._channel.send(engine._identity, CALL, msgspec.msgpack.encode((call_id, name, [])))
                with pytest.raises(RetryableError, match=f"^engine 0: '{name}' is not a call of the data path$"):
                    await answer
            req = Request("r1", "p", 0, Sampling(n=1, max_tokens=4), token_ids=[5, 6])
            assert [t.ok async for t in engine.generate_group([req])] == [True]
    finally:
        await pool.shutdown()
    assert ran == []
