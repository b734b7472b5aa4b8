"""Feeding prompts (`RolloutEngine.feed`) on fake engines: lists checked at once, bad items of a lazy
source as failed groups, what is not prompts refused, per-prompt sampling (no vLLM, no Ray)."""

from __future__ import annotations

import anyio
import pytest

from rollout.errors import EngineClosedError, InvalidPromptError
from rollout.types import Prompt
from tests.support.fake_engine_runs import TIMEOUT, all_groups, prompts, rollout
from tests.support.fakes import EOS_ID, FakeEngine, FakePool, text_ids


async def test_bad_prompt_in_a_list_rejects_the_whole_list(make_cfg):
    pool = FakePool(2)
    async with rollout(make_cfg(), pool) as engine:
        items = [Prompt(token_ids=[5], id="good"), Prompt(token_ids=[999], id="bad"), {"tokens": [1]}]
        with pytest.raises(InvalidPromptError) as e:
            engine.feed(items)
        msg = str(e.value)
        assert msg.startswith("2 of 3 prompts rejected")
        assert "prompt 'bad': token id 999" in msg and "[2] tokens: unknown key" in msg
        assert await all_groups(engine) == []
        engine.feed([Prompt(token_ids=[5], id="later")])  # the engine goes on
        groups = await all_groups(engine)
    assert [g.prompt_id for g in groups] == ["later"]
    assert {r.prompt_id for e in pool.engines for r in e.requests} == {"later"}


@pytest.mark.parametrize(
    "bad, reason",
    [
        ("", "empty text"),
        (Prompt(token_ids=[5] * 60, id="long"), "exceed max_model_len 64"),
        ({"token_ids": [5], "sampling": {"n": 0}}, "sampling.n: expected `int` >= 1"),
    ],
)
async def test_feed_checks_single_items_and_lists(make_cfg, bad, reason):
    async with rollout(make_cfg(), FakePool(1)) as engine:
        with pytest.raises(InvalidPromptError, match=reason):
            engine.feed(bad if isinstance(bad, (str, Prompt)) else [bad])


async def test_bad_items_in_a_generator_become_failed_groups(make_cfg):
    pool = FakePool(2)

    def source():
        yield Prompt(token_ids=[5, 6], id="ok1")
        yield 42
        yield {"token_ids": [999], "id": "vocab"}
        yield {"token_ids": [5], "id": "n0", "sampling": {"n": 0}}
        yield "text prompt"
        yield [7, 8]

    async with rollout(make_cfg(), pool) as engine:
        engine.feed(source())
        groups = await all_groups(engine)
    assert len(groups) == 6
    failed = {g.prompt_id: g.error for g in groups if g.error}
    assert len(failed) == 3
    assert "cannot make a prompt from a int" in failed[""]
    assert "token id 999 outside the vocabulary" in failed["vocab"]
    assert "sampling.n:" in failed["n0"]
    ok = [g for g in groups if g.error is None]
    assert len(ok) == 3 and all(g.ok and len(g.trajectories) == 2 for g in ok)
    text = next(g for g in ok if g.prompt.text == "text prompt")
    assert text.trajectories[0].prompt_token_ids == text_ids("text prompt")
    assert {r.prompt_id for e in pool.engines for r in e.requests} == {g.prompt_id for g in ok}


async def test_a_source_raising_a_rollout_error_becomes_a_failed_group(make_cfg):
    def source():
        yield [5]
        raise InvalidPromptError("source broke")

    async with rollout(make_cfg(), FakePool(1)) as engine:
        engine.feed(source())
        engine.feed([[6]])  # later sources go on
        groups = await all_groups(engine)
    assert sorted((g.error or "ok") for g in groups) == ["ok", "ok", "source broke"]


@pytest.mark.parametrize("kind", ["generator", "async generator"])
async def test_a_source_raising_any_error_fails_one_group_and_the_rest_goes_on(make_cfg, kind):
    """A user's generator with a bug must not take the engine down: its error comes out as a failed
    group naming it, the groups it already started and every other source finish."""

    def source():
        yield [5]
        raise KeyError("user bug")

    async def asource():
        yield [5]
        raise KeyError("user bug")

    pool = FakePool(1)
    with anyio.fail_after(TIMEOUT):
        async with rollout(make_cfg(), pool) as engine:
            engine.feed(source() if kind == "generator" else asource())
            engine.feed([[6], [7]])
            groups = await all_groups(engine)
    errors = [g.error for g in groups if g.error]
    assert len(groups) == 4 and len(errors) == 1 and "prompt source raised KeyError: 'user bug'" in errors[0]
    assert pool.shutdown_calls == 1


@pytest.mark.parametrize("bad", [None, 5, b"bytes"])
async def test_feed_refuses_what_is_not_prompts(make_cfg, bad):
    async with rollout(make_cfg(), FakePool(1)) as engine:
        with pytest.raises(InvalidPromptError, match="feed: expected prompts"):
            engine.feed(bad)


async def test_a_single_dict_is_one_prompt(make_cfg):
    async with rollout(make_cfg(), FakePool(1)) as engine:
        engine.feed({"token_ids": [5, 6], "id": "d"})
        groups = await all_groups(engine)
    assert [g.prompt_id for g in groups] == ["d"] and groups[0].ok


async def test_every_method_of_a_closed_engine_says_so(make_cfg):
    async with rollout(make_cfg(), FakePool(1)) as engine:
        pass
    for call in (lambda: engine.feed([[5]]), lambda: engine.submit([[5]]), lambda: engine.limits):
        with pytest.raises(EngineClosedError, match="shut down"):
            call()
    for coro in (engine.next_group, lambda: engine.next_batch(1), lambda: engine.update_weights({})):
        with pytest.raises(EngineClosedError, match="shut down"):
            with anyio.fail_after(TIMEOUT):
                await coro()


async def test_async_generator_source_and_several_feeds(make_cfg):
    async def source():
        for p in prompts(3):
            yield p

    async with rollout(make_cfg(), FakePool(2)) as engine:
        engine.feed(source())
        engine.feed(Prompt(token_ids=[4], id="single"))
        engine.feed("some text")
        groups = await all_groups(engine)
    assert len(groups) == 5 and all(g.ok for g in groups)
    assert {"q0", "q1", "q2", "single"} < {g.prompt_id for g in groups}


async def test_prompt_sampling_overrides_and_stop_tokens(make_cfg):
    pool = FakePool([FakeEngine(0, eos_at=2)])
    async with rollout(make_cfg("engines.count=1"), pool) as engine:
        engine.feed(
            [
                Prompt(token_ids=[5], id="stops"),
                Prompt(token_ids=[5], id="no-stop", sampling={"stop_token_ids": []}),
                Prompt(token_ids=[5], id="short", sampling={"max_tokens": 2, "n": 1}),
                Prompt(token_ids=[5], id="min", sampling={"min_tokens": 4}),
            ]
        )
        groups = {g.prompt_id: g for g in await all_groups(engine)}
    stops = groups["stops"].trajectories
    assert [len(t.token_ids) for t in stops] == [3, 3] and stops[0].token_ids[-1] == EOS_ID
    assert {t.finish_reason for t in stops} == {"stop"}
    assert [len(t.token_ids) for t in groups["no-stop"].trajectories] == [6, 6]
    assert {t.finish_reason for t in groups["no-stop"].trajectories} == {"length"}
    assert [len(t.token_ids) for t in groups["short"].trajectories] == [2]
    assert [len(t.token_ids) for t in groups["min"].trajectories] == [6, 6]  # EOS before min_tokens is ignored


async def test_feed_names_bad_prompts_without_ids(make_cfg):
    async with rollout(make_cfg(), FakePool(1)) as engine:
        with pytest.raises(InvalidPromptError) as e:
            engine.feed([[5], [6], [999]])
    assert "[2]" in str(e.value) and "token id 999" in str(e.value), str(e.value)
