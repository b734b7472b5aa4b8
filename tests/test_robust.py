"""Nothing hangs, nothing fails silently: every failure reaches the caller that waits for it.

Values the validators accept must cross the next layer (msgpack to the engines, vLLM's own checks);
a failure while a batch of groups is encoded or sent, in a callback, or in a task nobody awaits,
fails exactly the groups it belongs to, with the reason. Real `RayEngine` handles and `VLLMPolicy`
objects talk msgpack here (`tests.support.wire`); every wait is bounded by `anyio.fail_after`.
"""

from __future__ import annotations

import asyncio

import anyio
import msgspec
import pytest

from rollout.aio import as_finished
from rollout.config import Config, config_from_dict, load_config
from rollout.engine import RolloutEngine
from rollout.errors import InvalidConfigError, InvalidPromptError, RetryableError, RolloutError, WeightSyncError
from rollout.types import Prompt, Request, Sampling
from rollout.wire import RESULTS
from tests.support.fakes import FakePool
from tests.support.wire import WirePool

TIMEOUT = 10  # seconds; reached only by a test about to fail (a hang)


@pytest.fixture
def cfg(make_cfg) -> Config:
    """One engine."""
    return make_cfg("engines.count=1")


def request(rid: str, **kwargs) -> Request:
    return Request(rid, "p", 0, Sampling(n=1, max_tokens=4), **kwargs)


# -- the wire: encoding and sending a batch of groups ------------------------------------------


async def test_a_group_that_cannot_be_encoded_fails_alone_and_its_batch_goes_on(cfg):
    pool = await WirePool.start(cfg)
    engine = pool.engines[0]
    results: dict[str, object] = {}

    async def run(name: str, req: Request) -> None:
        try:
            results[name] = [t async for t in engine.generate_group([req])]
        except RolloutError as e:
            results[name] = e

    try:
        with anyio.fail_after(TIMEOUT):  # before: the batch's submit callback raised, both waited forever
            async with anyio.create_task_group() as tg:  # started in one turn: one batch, one submit
                tg.start_soon(run, "good", request("r1", token_ids=[5, 6, 7]))
                tg.start_soon(run, "bad", request("r2", text="a\ud800b"))  # a lone surrogate: not UTF-8
    finally:
        await pool.shutdown()
    assert isinstance(results["bad"], InvalidPromptError) and "r2" in str(results["bad"]), results["bad"]
    assert "surrogate" in str(results["bad"]) or "UTF-8" in str(results["bad"])
    assert len(results["good"]) == 1 and results["good"][0].ok


async def test_a_serve_call_ray_refuses_fails_its_groups_with_the_reason(cfg):
    pool = await WirePool.start(cfg)
    pool.actors[0].fail["serve"] = RuntimeError("object store full")
    try:
        with anyio.fail_after(TIMEOUT), pytest.raises(RetryableError, match="object store full"):
            [t async for t in pool.engines[0].generate_group([request("r1", token_ids=[5, 6])])]
    finally:
        await pool.shutdown()


async def test_a_failed_call_fails_its_groups_whatever_the_error_type(cfg):
    pool = await WirePool.start(cfg)
    engine = pool.engines[0]
    pool.actors[0].fail["serve"] = WeightSyncError("odd error from the engine", [0])  # no one-argument constructor
    try:
        with anyio.fail_after(TIMEOUT), pytest.raises(WeightSyncError, match="odd error"):
            [t async for t in engine.generate_group([request("r1", token_ids=[5, 6])])]
    finally:
        await pool.shutdown()


async def test_a_result_the_driver_cannot_decode_fails_the_engines_groups(cfg):
    pool = await WirePool.start(cfg)
    policy = pool.policies[0]

    def garbled() -> None:
        if policy._sock is not None and policy._results:
            policy._results = []
            policy._sock.send_multipart([RESULTS, b"\xc1"])  # never valid msgpack

    policy._flush = garbled
    try:
        with anyio.fail_after(TIMEOUT), pytest.raises(RetryableError, match="engine 0"):
            [t async for t in pool.engines[0].generate_group([request("r1", token_ids=[5, 6])])]
    finally:
        await pool.shutdown()


async def test_a_group_the_engine_cannot_decode_comes_back_failed_and_the_engine_serves_on(cfg):
    pool = await WirePool.start(cfg)
    engine = pool.engines[0]
    bad = Request(
        "r1", "p", 0, Sampling(n=1, max_tokens=4, temperature=5.0), token_ids=[5, 6]
    )  # the decoder's bounds refuse it
    try:
        with anyio.fail_after(TIMEOUT):
            with pytest.raises(RetryableError, match="engine 0: the group did not decode.*temperature"):
                [t async for t in engine.generate_group([bad])]
            good = [t async for t in engine.generate_group([request("r2", token_ids=[5, 6])])]
    finally:
        await pool.shutdown()
    assert len(good) == 1 and good[0].ok


# -- what the validators accept crosses the wire ----------------------------------------------


@pytest.mark.parametrize(
    "prompt, why",
    [
        ({"text": "a\ud800b"}, "text"),
        ({"token_ids": [5, 6], "id": "x\udcff"}, "id"),
        ({"token_ids": [5, 6], "sampling": {"stop": ["\ud800"]}}, "stop"),
        ({"token_ids": [5, 6], "sampling": {"seed": 2**64}}, "seed"),
        ({"token_ids": [5, 6], "sampling": {"seed": -(2**63) - 1}}, "seed"),
        ({"text": "hi", "sampling": {"max_tokens": 2**70}}, "max_tokens"),
        ({"text": "hi", "sampling": {"max_tokens": 64}}, "max_model_len"),
        ({"token_ids": [5, 6], "sampling": {"top_k": 2**63}}, "top_k"),
        ({"token_ids": [5, 6], "sampling": {"stop_token_ids": [2**64]}}, "stop_token_ids"),
        ({"token_ids": [5, 6], "sampling": {"stop_token_ids": [260]}}, "stop_token_ids"),
        ({"token_ids": [5, 6], "sampling": {"temperature": 3.0}}, "temperature"),
        ({"token_ids": [5, 6], "sampling": {"temperature": float("inf")}}, "temperature"),
        # found by tests/test_fuzz.py: msgspec raised UnicodeEncodeError (not a validation error) naming nothing
        ({"token_ids": [5, 6], "sampling": {"\ud800": 1}}, "sampling key"),
        ({"token_ids": [5, 6], "\udc80odd": 1}, "key"),
        ({"token_ids": [5, 6], "metadata": {"note": "\ud800"}}, "metadata.note"),
        # a Prompt made in code: its constructor checks no types, the wire decoder does
        (Prompt(token_ids=[5, True]), "token_ids"),
        (Prompt(text=5), "text"),
    ],
)
async def test_a_value_the_next_layer_refuses_is_refused_at_feed(cfg, prompt, why):
    pool = await WirePool.start(cfg)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            with pytest.raises(InvalidPromptError, match=why):
                engine.feed([prompt])
            engine.feed(iter([prompt, [5, 6, 7]]))  # lazily: a failed group, and the rest goes on
            groups = [g async for g in engine.groups()]
    bad = [g for g in groups if not g.ok]
    assert len(groups) == 2 and len(bad) == 1, [g.error for g in groups]
    assert why in (bad[0].error or "") + "".join(t.error or "" for t in bad[0].trajectories)


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"sampling": {"seed": 2**64}}, "sampling.seed"),
        ({"sampling": {"stop": ["ok", "\udcff"]}}, "sampling.stop"),
        ({"sampling": {"stop_token_ids": [2**31]}}, "sampling.stop_token_ids"),
        ({"sampling": {"max_tokens": 2**63}}, "sampling.max_tokens"),
        ({"sampling": {"temperature": 2.5}}, "sampling.temperature"),
        ({"model": {"seed": 2**32}}, "model.seed"),
        ({"model": {"seed": -1}}, "model.seed"),
        ({"model": {"max_model_len": 2**40}}, "model.max_model_len"),
        ({"engines": {"max_inflight_per_engine": 2**40}}, "engines.max_inflight_per_engine"),
        ({"prompts": {"count": 2**63}}, "prompts.count"),
        ({"sampling": {"\ud800": 1}}, "sampling key"),
    ],
)
def test_a_config_value_the_next_layer_refuses_is_refused_at_load(raw, key):
    with pytest.raises(InvalidConfigError, match=key.replace(".", r"\.")):
        config_from_dict(raw)


# -- tasks and callbacks nobody awaits --------------------------------------------------------


async def test_as_finished_reports_a_coroutine_cancelled_from_within():
    async def cancelled_inside() -> int:
        raise asyncio.CancelledError()  # e.g. a library's own timeout or abort, not our cancellation

    async def fine() -> int:
        return 1

    with anyio.fail_after(TIMEOUT), pytest.raises(RuntimeError, match="cancelled"):  # before: waited forever
        [x async for x in as_finished([fine(), cancelled_inside()])]


async def test_a_group_cancelled_inside_the_engine_comes_back_failed(cfg):
    pool = await WirePool.start(cfg)
    policy = pool.policies[0]
    real = policy.stream_group

    async def cancelled_inside(requests):
        if requests[0].request_id == "bad":
            raise asyncio.CancelledError()
        async for t in real(requests):
            yield t

    policy.stream_group = cancelled_inside
    try:
        with anyio.fail_after(TIMEOUT), pytest.raises(RetryableError, match="cancelled"):  # before: never came back
            [t async for t in pool.engines[0].generate_group([request("bad", token_ids=[5])])]
        with anyio.fail_after(TIMEOUT):  # the engine serves on
            assert [t.ok async for t in pool.engines[0].generate_group([request("good", token_ids=[5])])] == [True]
    finally:
        await pool.shutdown()


async def test_an_on_trajectory_callback_that_raises_fails_that_group_and_the_rest_goes_on(cfg):
    def on_trajectory(t):
        if t.prompt_id == "bad":
            raise ValueError("progress bar broke")

    with anyio.fail_after(TIMEOUT):  # before: the task group died, groups() waited forever
        async with RolloutEngine(cfg, pool=FakePool(1), on_trajectory=on_trajectory) as engine:
            engine.feed([{"token_ids": [5, 6], "id": "bad"}, {"token_ids": [7, 8], "id": "good"}])
            groups = {g.prompt_id: g async for g in engine.groups()}
    assert groups["good"].ok
    assert not groups["bad"].ok and "progress bar broke" in groups["bad"].error


async def test_a_bug_while_admitting_a_group_fails_that_group(cfg):
    with anyio.fail_after(TIMEOUT):  # before: its queue slot stayed reserved, the learner waited forever
        async with RolloutEngine(cfg, pool=FakePool(1)) as engine:
            real = engine._scheduler.runner.take  # what routes a group, run as a task or not

            def take(n, cost, on=None):
                if cost == 2 + 6:  # the two-token prompt's group
                    raise RuntimeError("router bug")
                return real(n, cost, on)

            engine._scheduler.runner.take = take
            engine.feed(iter([[5, 6], [5, 6, 7]]))
            groups = [g async for g in engine.groups()]
    assert len(groups) == 2 and sum(g.ok for g in groups) == 1
    assert "router bug" in next(g.error for g in groups if not g.ok)


async def test_a_dead_health_watch_reaches_the_waiting_learner(cfg):
    pool = FakePool(1)
    with anyio.fail_after(TIMEOUT):  # before: the engine's task group died, the learner waited forever
        async with RolloutEngine(cfg, pool=pool) as engine:
            pool.engines[0].block()  # the group never finishes by itself

            async def broken():
                raise RuntimeError("watch bug")

            engine._scheduler.runner.watch = broken
            engine._scheduler.start(engine._tg)  # a second watch, which dies at once
            engine.feed([[5, 6]])
            with pytest.raises(RolloutError, match="watch bug"):
                [g async for g in engine.groups()]


def test_an_override_value_that_is_not_utf8_names_its_key():  # found by the fuzz tier: UnicodeEncodeError
    with pytest.raises(InvalidConfigError, match="model.max_model_len: override value: is not valid UTF-8"):
        load_config(None, ["model.max_model_len=\ud800"])


def test_every_value_a_sampling_accepts_encodes():
    s = msgspec.convert({"seed": 2**63 - 1, "top_k": 2**31 - 1, "stop_token_ids": [2**31 - 1]}, Sampling)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=Sampling) == s


async def test_configured_stop_token_ids_outside_the_vocabulary_stop_the_start_naming_the_key(cfg):
    """`rollout validate` refuses them; so does the engine's start, before any engine or prompt
    runs (else every prompt would fail on its own with the same reason)."""
    bad = msgspec.structs.replace(cfg, sampling=msgspec.structs.replace(cfg.sampling, stop_token_ids=[2, 260]))
    pool = FakePool(1)
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(
            InvalidConfigError, match=r"sampling.stop_token_ids\[1\]: 260 outside the vocabulary \(vocab size 260\)"
        ):
            async with RolloutEngine(bad, pool=pool):
                pass
