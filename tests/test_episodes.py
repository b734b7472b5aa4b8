"""Multi-turn episodes on fake engines: token-exact turns, masks and records, limits, environments
that fail, engines that die mid-episode, GRPO groups of episodes; and per-caller submissions."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import anyio
import pytest

from benchmarks.envs import Calculator, evaluate
from rollout.config import load_config
from rollout.engine import RolloutEngine
from rollout.env import Step
from rollout.errors import InvalidConfigError, InvalidPromptError
from rollout.types import Batch, Prompt
from tests.fakes import EOS_ID, FakePool

TIMEOUT = 30  # a hang guard; the first episode pays the tokenizer import (seconds on a busy machine)


def cfg(*overrides: str):
    return load_config(None, ["model.path=tiny", "sampling.n=2", "sampling.max_tokens=5", "engines.count=2",
                              "model.max_model_len=128", "logging.level=error", "engines.health_interval_s=0.01",
                              "engines.restart_backoff_s=0", *overrides])  # fmt: skip


class Echo:
    """Three turns; each observation is a user message naming the turn; reward 1 per turn."""

    def __init__(self, turns: int = 3):
        self.turns = turns

    async def reset(self, prompt: Prompt):
        return None

    async def step(self, action):
        done = action.turn + 1 >= self.turns
        return Step(None if done else f"turn {action.turn}", 1.0, done)


async def episodes(config, env, prompts, pool=None):
    pool = pool or FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(config, pool=pool, env=env) as engine:
            engine.feed(prompts)
            return [g async for g in engine.groups()], engine, pool


async def test_turns_are_token_exact_and_the_episode_is_one_masked_sample():
    groups, engine, _ = await episodes(cfg(), Echo, [Prompt(text="hi", id="q")])
    (group,) = groups
    assert group.ok and len(group.trajectories) == 2
    from rollout.chat import ChatRenderer

    chat = ChatRenderer(engine.model_path)
    for ep in group.trajectories:
        assert len(ep.turns) == 3 and ep.reward == 3.0 and ep.finish_reason == "stop"
        t0, t1, t2 = ep.turns
        assert t0.prompt_token_ids == chat.render([{"role": "user", "content": "hi"}])
        # turn k+1's prompt: turn k's prompt + its tokens (+ <eos> if it did not end its turn) + the observation
        for a, b, k in ((t0, t1, 0), (t1, t2, 1)):
            obs = ([] if a.token_ids[-1:] == [EOS_ID] else [EOS_ID]) + chat.append([{"role": "user", "content": f"turn {k}"}])
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
    _, _, pool = await episodes(cfg("sampling.n=1"), Echo, [Prompt(text="a", id="q")])
    turns = [r for e in pool.engines for r in e.requests]
    assert len(turns) == 3 and len({id(e) for e in pool.engines if e.requests}) == 1
    assert [r.request_id for r in turns] == ["r1-0.t0", "r1-0.t1", "r1-0.t2"]
    assert all(r.cache_salt == "ep:r1-0" for r in turns[:1])


async def test_limits_end_an_episode_with_finish_reason_length():
    groups, _, _ = await episodes(cfg("sampling.n=1", "episode.max_turns=2"), lambda: Echo(5), [Prompt(text="a")])
    ep = groups[0].trajectories[0]
    assert ep.ok and ep.finish_reason == "length" and len(ep.turns) == 2
    groups, _, _ = await episodes(cfg("sampling.n=1", "episode.max_tokens=40"), lambda: Echo(50), [Prompt(text="a")])
    ep = groups[0].trajectories[0]
    assert ep.ok and ep.finish_reason == "length" and len(ep.prompt_token_ids) + len(ep.token_ids) <= 40


async def test_an_episode_that_outgrows_the_context_ends_at_max_model_len_and_one_that_starts_over_it_fails_alone():
    """No `episode.max_tokens`: `model.max_model_len` bounds the whole conversation. A first prompt
    already over it fails its own episode, naming the episode and the limit; the others go on."""
    groups, _, pool = await episodes(cfg("sampling.n=1", "model.max_model_len=64"), lambda: Echo(50),
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
    groups, _, _ = await episodes(cfg("episode.step_timeout_s=0.05"), lambda: Broken(how), [Prompt(text="a", id="bad")])
    for ep in groups[0].trajectories:
        assert not ep.ok and message in ep.error and ep.request_id in ep.error
    groups, _, _ = await episodes(cfg(), lambda: Broken("fine"), [Prompt(text="a")])  # and the same engine serves on
    assert groups[0].ok


async def test_an_unknown_environment_path_is_a_config_error():
    with pytest.raises(InvalidConfigError, match="env: cannot import module 'no_such.mod'"):
        async with RolloutEngine(cfg("env=no_such.mod:Env"), pool=FakePool(1)):
            pass
    with pytest.raises(InvalidConfigError, match="env_args: do not fit"):
        async with RolloutEngine(cfg("env=benchmarks.envs:Digits", "env_args={wrong: 1}"), pool=FakePool(1)):
            pass


async def test_an_episode_continues_on_another_engine_when_its_engine_dies():
    pool = FakePool(2)
    pool.engines[0].reported_tokens = 2

    class KillAfterFirstTurn(Echo):
        async def step(self, action):
            if action.turn == 0:
                await pool.engines[0].kill()  # the engine it ran on (engine 0 has the lower load)
            return await super().step(action)

    groups, _, _ = await episodes(cfg("sampling.n=1"), KillAfterFirstTurn, [Prompt(text="a")], pool)
    ep = groups[0].trajectories[0]
    assert ep.ok and len(ep.turns) == 3
    assert len({t.engine_id for t in ep.turns}) == 2  # moved after its engine died


async def test_calculator_tool_calls_and_malformed_ones():
    env = Calculator()
    await env.reset(Prompt(text="2+3?", metadata={"answer": 5}))
    from rollout.env import Action

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
    groups, _, _ = await episodes(cfg("env=benchmarks.envs:Digits", "env_args={turns: 2}"), None, [Prompt(text="go")])
    for ep in groups[0].trajectories:
        assert ep.ok and len(ep.turns) == 2 and 0.0 <= ep.reward <= 1.0


async def test_submissions_get_their_own_groups_alongside_the_learner():
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg("sampling.n=1"), pool=FakePool(2)) as engine:
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
        async with RolloutEngine(cfg("sampling.n=2", "engines.count=1"), pool=pool) as engine:
            sub = engine.submit([[5]])
            await pool.engines[0].wait_until(lambda e: e.inflight == 2)
            sub.cancel()
            await pool.engines[0].wait_until(lambda e: e.inflight == 0)
            gate.set()
    assert pool.engines[0].cancelled == 2


async def test_reasoning_gym_scores_answers_with_its_verifier():
    pytest.importorskip("reasoning_gym")
    from benchmarks.envs import ReasoningGym
    from rollout.env import Action

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


# -- hostile environments: one bad answer fails its own episode, never its group or the engine -----


class OneBad(Echo):
    """The first environment built answers turn 0 with `how` (a value, or raising); the others are Echo."""

    built = 0

    def __init__(self, how):
        super().__init__()
        type(self).built += 1
        self.bad = type(self).built == 1
        self.how = how

    async def step(self, action):
        if self.bad and action.turn == 0:
            return self.how()
        return await super().step(action)


class OneBadSync(OneBad):
    """The same with a sync `step` (run in a worker thread) and `reset`."""

    def reset(self, prompt):
        if self.bad and self.how is None:
            raise SystemExit(2)
        return None

    def step(self, action):
        if self.bad and action.turn == 0:
            return self.how()
        done = action.turn + 1 >= self.turns
        return Step(None if done else f"turn {action.turn}", 1.0, done)


def raises(error):
    def how():
        raise error

    return how


NOT_JSON = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": {1, 2}}}}]}


@pytest.mark.parametrize(
    "env, how, message",
    [
        (OneBad, lambda: Step("x", "1.0", False), "environment step of turn 0: Step.reward: expected a finite number, got '1.0'"),
        (OneBad, lambda: Step(None, float("nan"), True), "Step.reward: expected a finite number, got nan"),
        (OneBad, lambda: Step(None, 10**400, True), "Step.reward: expected a finite number, got 1000"),
        (OneBad, lambda: ("x", 1.0, "no"), "environment step of turn 0: Step.done: expected a bool, got 'no'"),
        (OneBad, lambda: Step("x", 1.0, "no"), "environment step of turn 0: Step.done: expected a bool, got 'no'"),
        (OneBad, lambda: Step(NOT_JSON), "Step.observation.tool_calls: is not JSON: TypeError: Object of type set"),
        (OneBad, lambda: Step({"role": "robot", "content": "x"}), "Step.observation.role: expected one of system, user, assistant, tool, got 'robot'"),
        (OneBad, lambda: Step([{"role": "tool", "content": 5}]), "Step.observation[0].content: expected a string, got 5"),
        (OneBad, raises(asyncio.CancelledError()), "environment step of turn 0 raised CancelledError"),
        (OneBadSync, raises(SystemExit(2)), "environment step of turn 0 raised SystemExit: 2"),
        (OneBadSync, raises(KeyboardInterrupt()), "environment step of turn 0 raised KeyboardInterrupt"),
        (OneBadSync, raises(asyncio.CancelledError()), "environment step of turn 0 raised CancelledError"),
        (OneBadSync, None, "environment reset raised SystemExit: 2"),
    ],
    ids=["reward-str", "reward-nan", "reward-huge-int", "done-str-tuple", "done-str", "tool-calls-not-json", "role",
         "content-int", "async-cancelled", "sync-systemexit", "sync-keyboardinterrupt", "sync-cancelled", "reset-systemexit"],
)  # fmt: skip
async def test_a_hostile_step_fails_its_episode_only_naming_the_field_or_the_cause(env, how, message):
    """n=4 episodes of one prompt: the first environment built answers badly, the other three are
    Echo. Only that episode fails, its error naming the field and the value (or what was raised);
    the group's other episodes finish, and the engine serves on."""
    env.built = 0
    groups, _, _ = await episodes(cfg("sampling.n=4"), lambda: env(how), [Prompt(text="a", id="q")])
    (group,) = groups
    bad = [ep for ep in group.trajectories if not ep.ok]
    assert len(bad) == 1, [ep.error for ep in group.trajectories]
    assert message in bad[0].error and bad[0].request_id in bad[0].error and bad[0].finish_reason == "error"
    assert all(ep.ok and ep.reward == 3.0 and len(ep.turns) == 3 for ep in group.trajectories if ep is not bad[0])


class SyncEcho:
    """Echo with sync `reset` and `step` (each in a worker thread), each step a few ms of real work."""

    ran = 0

    def reset(self, prompt):
        return None

    def step(self, action):
        time.sleep(0.002)
        type(self).ran += 1
        done = action.turn + 1 >= 3
        return Step(None if done else [7, 8], 1.0, done)


async def test_a_step_timeout_times_the_step_not_the_wait_for_a_worker_thread(monkeypatch):
    """2400 concurrent 3-turn episodes (600 prompts x n=4), half the environments sync. Every worker
    thread is held until all 1200 sync `reset`s are queued for one, then the event loop's clock jumps
    past `episode.step_timeout_s` (a fake clock: queueing time is unbounded by construction, the
    steps themselves take milliseconds). The timeout starts when a call starts in its thread, so all
    2400 episodes finish; timing the wait too failed every queued one."""
    built = itertools.count()
    SyncEcho.ran = 0
    config = cfg("sampling.n=4", "episode.step_timeout_s=5", "queue.max_groups=600", "staleness.max_lag=null")
    limiter = anyio.to_thread.current_default_thread_limiter()
    loop = asyncio.get_running_loop()
    with anyio.fail_after(120):
        async with RolloutEngine(config, pool=FakePool(2), env=lambda: SyncEcho() if next(built) % 2 else Echo()) as engine:
            holders = [object() for _ in range(int(limiter.total_tokens))]
            for holder in holders:  # every worker thread busy
                await limiter.acquire_on_behalf_of(holder)
            engine.feed([Prompt(token_ids=[5, 6], id=f"q{i}") for i in range(600)])
            while limiter.statistics().tasks_waiting < 1200:  # every sync reset waits for a thread
                await anyio.sleep(0.01)
            # 2 x the timeout, until the test ends: every deadline set so far is past
            monkeypatch.setattr(loop, "time", lambda now=loop.time: now() + 10)
            for holder in holders:
                limiter.release_on_behalf_of(holder)
            groups = [g async for g in engine.groups()]
    failed = [ep.error for g in groups for ep in g.trajectories if not ep.ok]
    assert len(groups) == 600 and not failed, f"{len(failed)} failed: {failed[:1]}"
    assert SyncEcho.ran == 1200 * 3


class Stuck:
    """The first episode's step waits until cancelled (async) or released (sync, on a threading.Event
    in its thread); later episodes end at once."""

    def __init__(self, sync: bool):
        self.sync = sync
        self.entered, self.left = anyio.Event(), anyio.Event()
        self.release = threading.Event()
        self.cancelled = False

    def env(self):
        stuck = self

        class Env:
            async def reset(self, prompt):
                return None

            async def step(self, action):
                if stuck.entered.is_set():
                    return Step(None, 1.0, True)
                stuck.entered.set()
                try:
                    await anyio.sleep_forever()
                except anyio.get_cancelled_exc_class():
                    stuck.cancelled = True
                    raise
                finally:
                    stuck.left.set()

        class SyncEnv(Env):
            def step(self, action):
                if not stuck.release.is_set():
                    anyio.from_thread.run_sync(stuck.entered.set)
                    stuck.release.wait()
                return Step(None, 1.0, True)

        return SyncEnv() if self.sync else Env()


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
async def test_cancelling_a_submission_mid_step_still_cancels_it(sync):
    """The caller's own cancellation is not the environment's failure: a submission cancelled while
    its step runs hands in no group (an async step sees the cancellation; a sync one's thread is
    abandoned), and the engine serves on."""
    stuck = Stuck(sync)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg("sampling.n=1"), pool=FakePool(2), env=stuck.env) as engine:
            sub = engine.submit([Prompt(text="a")])
            await stuck.entered.wait()
            sub.cancel()
            if not sync:
                await stuck.left.wait()
                assert stuck.cancelled
            while sub in engine._scheduler._submissions:  # its task ends
                await anyio.sleep(0.01)
            assert sub._recv.statistics().current_buffer_used == 0  # no group: nothing was handed in
            stuck.release.set()
            groups = await engine.submit([Prompt(text="b")], train=False).result()
    assert groups[0].ok


async def test_a_sync_step_that_hangs_fails_its_episode_and_its_thread_is_abandoned():
    release = threading.Event()

    class Hangs(Echo):
        def step(self, action):
            release.wait()  # a thread cannot be killed: it runs on until released
            return Step(None, 1.0, True)

    try:
        groups, _, _ = await episodes(cfg("sampling.n=1", "episode.step_timeout_s=0.05"), Hangs, [Prompt(text="a")])
    finally:
        release.set()
    (ep,) = groups[0].trajectories
    assert not ep.ok and "environment step of turn 0 took longer than episode.step_timeout_s=0.05" in ep.error
