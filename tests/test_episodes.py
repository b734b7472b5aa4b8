"""Multi-turn episodes on fake engines: token-exact turns, masks and records, limits, environments
that fail, engines that die mid-episode, GRPO groups of episodes; and per-caller submissions."""

from __future__ import annotations

import anyio
import pytest

from rollout.batch import Batch
from rollout.engine import RolloutEngine
from rollout.episodes.env import Step
from rollout.episodes.examples import Calculator, evaluate
from rollout.errors import InvalidConfigError, InvalidPromptError
from rollout.types import Prompt
from tests.support.episodes import TIMEOUT, Echo, episode_cfg, episodes
from tests.support.fakes import EOS_ID, FakePool


async def test_turns_are_token_exact_and_the_episode_is_one_masked_sample():
    groups, engine, _ = await episodes(episode_cfg(), Echo, [Prompt(text="hi", id="q")])
    (group,) = groups
    assert group.ok and len(group.trajectories) == 2
    from rollout.episodes.chat import ChatRenderer

    chat = ChatRenderer(engine.model_path)
    for ep in group.trajectories:
        assert len(ep.turns) == 3 and ep.reward == 3.0 and ep.finish_reason == "stop"
        t0, t1, t2 = ep.turns
        assert t0.prompt_token_ids == chat.render([{"role": "user", "content": "hi"}])
        # turn k+1's prompt: turn k's prompt + its tokens (+ <eos> if it did not end its turn) + the observation
        for a, b, k in ((t0, t1, 0), (t1, t2, 1)):
            obs = ([] if a.token_ids[-1:] == [EOS_ID] else [EOS_ID]) + chat.append(
                [{"role": "user", "content": f"turn {k}"}]
            )
            assert b.prompt_token_ids == a.prompt_token_ids + a.token_ids + obs
            assert a.cache_salt == "" or b.kv_reused >= 0
        assert ep.prompt_token_ids == t0.prompt_token_ids
        assert ep.prompt_token_ids + ep.token_ids == t2.prompt_token_ids + t2.token_ids
        model = [i for i, m in enumerate(ep.loss_mask) if m]
        assert [ep.token_ids[i] for i in model] == t0.token_ids + t1.token_ids + t2.token_ids
        assert [ep.logprobs[i] for i in model] == t0.logprobs + t1.logprobs + t2.logprobs
        assert all(ep.logprobs[i] == 0.0 for i, m in enumerate(ep.loss_mask) if not m)
        epochs = ep.token_epochs()
        assert all((e == -1) == (not m) for e, m in zip(epochs, ep.loss_mask))
        assert [t.reward for t in ep.turns] == [1.0, 1.0, 1.0]
    tensors = Batch(groups=[group]).to_tensors()
    assert tensors["loss_mask"].sum().item() == sum(sum(ep.loss_mask) for ep in group.trajectories)


async def test_each_turn_of_an_episode_stays_on_its_engine_and_passes_its_salt():
    _, _, pool = await episodes(episode_cfg("sampling.n=1"), Echo, [Prompt(text="a", id="q")])
    turns = [r for e in pool.engines for r in e.requests]
    assert len(turns) == 3 and len({id(e) for e in pool.engines if e.requests}) == 1
    assert [r.request_id for r in turns] == ["r1-0.t0", "r1-0.t1", "r1-0.t2"]
    assert all(r.cache_salt == "ep:r1-0" for r in turns[:1])


async def test_limits_end_an_episode_with_finish_reason_length():
    groups, _, _ = await episodes(
        episode_cfg("sampling.n=1", "episode.max_turns=2"), lambda: Echo(5), [Prompt(text="a")]
    )
    ep = groups[0].trajectories[0]
    assert ep.ok and ep.finish_reason == "length" and len(ep.turns) == 2
    groups, _, _ = await episodes(
        episode_cfg("sampling.n=1", "episode.max_tokens=40"), lambda: Echo(50), [Prompt(text="a")]
    )
    ep = groups[0].trajectories[0]
    assert ep.ok and ep.finish_reason == "length" and len(ep.prompt_token_ids) + len(ep.token_ids) <= 40


async def test_an_episode_that_outgrows_the_context_ends_at_max_model_len_and_one_that_starts_over_it_fails_alone():
    """No `episode.max_tokens`: `model.max_model_len` bounds the whole conversation. A first prompt
    already over it fails its own episode, naming the episode and the limit; the others go on."""
    groups, _, pool = await episodes(episode_cfg("sampling.n=1", "model.max_model_len=64"), lambda: Echo(50),
                                     [Prompt(text="a", id="fits"), Prompt(text="x" * 80, id="over")])  # fmt: skip
    by_id = {g.prompt_id: g for g in groups}
    ep = by_id["fits"].trajectories[0]
    assert ep.ok and ep.finish_reason == "length" and len(ep.turns) > 1
    assert len(ep.prompt_token_ids) + len(ep.token_ids) <= 64
    assert all(len(r.token_ids) + r.sampling.max_tokens <= 64 for e in pool.engines for r in e.requests)
    (over,) = by_id["over"].trajectories
    assert not over.ok and "model.max_model_len is 64" in over.error and "first prompt" in over.error


class Broken:
    def __init__(self, how: str):
        self.how = how

    async def reset(self, prompt):
        if self.how == "reset":
            raise RuntimeError("no such task")
        return None

    async def step(self, action):
        if self.how == "step":
            raise ValueError("bad action")
        if self.how == "slow":
            await anyio.sleep(10)
        if self.how == "garbage":
            return {"not": "a step"}
        if self.how == "vocab":
            return Step([5, 9999], 0.0, False)
        if self.how == "no_observation":
            return Step(None, 0.0, False)
        return Step("ok", 0.0, True)


@pytest.mark.parametrize(
    "how, message",
    [
        ("reset", "environment reset raised RuntimeError: no such task"),
        ("step", "environment step of turn 0 raised ValueError: bad action"),
        ("slow", "took longer than episode.step_timeout_s=0.05"),
        ("garbage", "environment step of turn 0 returned {'not': 'a step'}"),
        ("vocab", "observation of turn 0: token id 9999 outside the vocabulary"),
        ("no_observation", "returned no observation and did not end the episode"),
    ],
)
async def test_an_environment_that_fails_fails_its_episode_only(how, message):
    groups, _, _ = await episodes(
        episode_cfg("episode.step_timeout_s=0.05"), lambda: Broken(how), [Prompt(text="a", id="bad")]
    )
    for ep in groups[0].trajectories:
        assert not ep.ok and message in ep.error and ep.request_id in ep.error
    groups, _, _ = await episodes(
        episode_cfg(), lambda: Broken("fine"), [Prompt(text="a")]
    )  # and the same engine serves on
    assert groups[0].ok


async def test_an_unknown_environment_path_is_a_config_error():
    with pytest.raises(InvalidConfigError, match="env: cannot import module 'no_such.mod'"):
        async with RolloutEngine(episode_cfg("env=no_such.mod:Env"), pool=FakePool(1)):
            pass
    with pytest.raises(InvalidConfigError, match="env_args: do not fit"):
        async with RolloutEngine(
            episode_cfg("env=rollout.episodes.examples:Digits", "env_args={wrong: 1}"), pool=FakePool(1)
        ):
            pass


async def test_an_episode_continues_on_another_engine_when_its_engine_dies():
    pool = FakePool(2)
    pool.engines[0].reported_tokens = 2

    class KillAfterFirstTurn(Echo):
        async def step(self, action):
            if action.turn == 0:
                await pool.engines[0].kill()  # the engine it ran on (engine 0 has the lower load)
            return await super().step(action)

    groups, _, _ = await episodes(episode_cfg("sampling.n=1"), KillAfterFirstTurn, [Prompt(text="a")], pool)
    ep = groups[0].trajectories[0]
    assert ep.ok and len(ep.turns) == 3
    assert len({t.engine_id for t in ep.turns}) == 2  # moved after its engine died


async def test_calculator_tool_calls_and_malformed_ones():
    env = Calculator()
    await env.reset(Prompt(text="2+3?", metadata={"answer": 5}))
    from rollout.episodes.env import Action

    step = await env.step(Action('{"tool": "calculator", "expression": "2 + 3"}', [], "stop", 0))
    assert step.observation == {"role": "tool", "content": "5"} and not step.done
    step = await env.step(Action("2+3", [], "stop", 1))
    assert "not a JSON tool call" in step.observation["content"] and not step.done
    step = await env.step(Action('{"tool": "calculator", "expression": "__import__(1)"}', [], "stop", 2))
    assert "error:" in step.observation["content"]
    assert (await env.step(Action('{"answer": 5}', [], "stop", 3))) == Step(None, 1.0, True)
    assert evaluate("2 ** 10 - (3 * 4) / 2") == 1018.0
    with pytest.raises(ValueError):
        evaluate("9 ** 999")


async def test_digits_episodes_through_the_engine():
    groups, _, _ = await episodes(
        episode_cfg("env=rollout.episodes.examples:Digits", "env_args={turns: 2}"), None, [Prompt(text="go")]
    )
    for ep in groups[0].trajectories:
        assert ep.ok and len(ep.turns) == 2 and 0.0 <= ep.reward <= 1.0


async def test_submissions_get_their_own_groups_alongside_the_learner():
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(episode_cfg("sampling.n=1"), pool=FakePool(2)) as engine:
            engine.feed([[5], [6], [7]])
            a = engine.submit([[8], [9]])
            b = engine.submit([Prompt(token_ids=[10], id="x")], train=False)
            got_a = await a.result()
            got_b = await b.result()
            learner = [g async for g in engine.groups()]
            with pytest.raises(InvalidPromptError, match="1 of 2 prompts rejected"):
                engine.submit([[5], []])
    assert [g.prompt.token_ids for g in got_a] == [[8], [9]] and [g.prompt_id for g in got_b] == ["x"]
    assert sorted(g.prompt.token_ids[0] for g in learner) == [5, 6, 7]


async def test_a_cancelled_submission_aborts_its_requests():
    pool = FakePool(1)
    gate = pool.engines[0].block()
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(episode_cfg("sampling.n=2", "engines.count=1"), pool=pool) as engine:
            sub = engine.submit([[5]])
            await pool.engines[0].wait_until(lambda e: e.inflight == 2)
            sub.cancel()
            await pool.engines[0].wait_until(lambda e: e.inflight == 0)
            gate.set()
    assert pool.engines[0].cancelled == 2


async def test_reasoning_gym_scores_answers_with_its_verifier():
    pytest.importorskip("reasoning_gym")
    from rollout.episodes.env import Action
    from rollout.episodes.examples import ReasoningGym

    env = ReasoningGym("basic_arithmetic", seed=1, size=10, attempts=2)
    question = env.reset(Prompt(text="solve", metadata={"index": 3}))
    answer = env.entry["answer"]
    assert isinstance(question, str) and question == env.entry["question"]
    wrong = env.step(Action("not a number", [], "stop", 0))
    assert wrong == Step("Incorrect, try again.", 0.0, False)
    assert env.step(Action(f" {answer} ", [], "stop", 1)) == Step(None, 1.0, True)
    env.reset(Prompt(text="solve", id="other"))
    env.step(Action("x", [], "stop", 0))
    assert env.step(Action("y", [], "stop", 1)).done  # out of attempts
