"""Hostile environments on fake engines: a bad `Step` field, a `BaseException` out of user code, a
step that hangs, sync steps queued for a worker thread. One bad answer fails its own episode, never
its group or the engine; the caller's own cancellation still cancels."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import anyio
import pytest

from rollout.engine import RolloutEngine
from rollout.episodes.env import Step
from rollout.types import Prompt
from tests.support.episodes import TIMEOUT, Echo, episode_cfg, episodes
from tests.support.fakes import FakePool


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


ARGS_NOT_JSON = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"x": '}}],
}
NOT_JSON = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": {1, 2}}}}],
}


@pytest.mark.parametrize(
    "env, how, message",
    [
        (
            OneBad,
            lambda: Step("x", "1.0", False),
            "environment step of turn 0: Step.reward: expected a finite number, got '1.0'",
        ),
        (OneBad, lambda: Step(None, float("nan"), True), "Step.reward: expected a finite number, got nan"),
        (OneBad, lambda: Step(None, 10**400, True), "Step.reward: expected a finite number, got 1000"),
        (OneBad, lambda: ("x", 1.0, "no"), "environment step of turn 0: Step.done: expected a bool, got 'no'"),
        (OneBad, lambda: Step("x", 1.0, "no"), "environment step of turn 0: Step.done: expected a bool, got 'no'"),
        (OneBad, lambda: Step(NOT_JSON), "Step.observation.tool_calls: is not JSON: TypeError: Object of type set"),
        (
            OneBad,
            lambda: Step(ARGS_NOT_JSON),
            "Step.observation.tool_calls[0].function.arguments: is not JSON: '{\"x\": '",
        ),
        (
            OneBad,
            lambda: Step({"role": "robot", "content": "x"}),
            "Step.observation.role: expected one of system, user, assistant, tool, got 'robot'",
        ),
        (
            OneBad,
            lambda: Step([{"role": "tool", "content": 5}]),
            "Step.observation[0].content: expected a string, got 5",
        ),
        (OneBad, raises(asyncio.CancelledError()), "environment step of turn 0 raised CancelledError"),
        (OneBadSync, raises(SystemExit(2)), "environment step of turn 0 raised SystemExit: 2"),
        (OneBadSync, raises(KeyboardInterrupt()), "environment step of turn 0 raised KeyboardInterrupt"),
        (OneBadSync, raises(asyncio.CancelledError()), "environment step of turn 0 raised CancelledError"),
        (OneBadSync, None, "environment reset raised SystemExit: 2"),
    ],
    ids=[
        "reward-str",
        "reward-nan",
        "reward-huge-int",
        "done-str-tuple",
        "done-str",
        "tool-calls-not-json",
        "arguments-not-json",
        "role",
        "content-int",
        "async-cancelled",
        "sync-systemexit",
        "sync-keyboardinterrupt",
        "sync-cancelled",
        "reset-systemexit",
    ],
)
async def test_a_hostile_step_fails_its_episode_only_naming_the_field_or_the_cause(env, how, message):
    """n=4 episodes of one prompt: the first environment built answers badly, the other three are
    Echo. Only that episode fails, its error naming the field and the value (or what was raised);
    the group's other episodes finish, and the engine serves on."""
    env.built = 0
    groups, _, _ = await episodes(episode_cfg("sampling.n=4"), lambda: env(how), [Prompt(text="a", id="q")])
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
    config = episode_cfg("sampling.n=4", "episode.step_timeout_s=5", "queue.max_groups=600", "staleness.max_lag=null")
    limiter = anyio.to_thread.current_default_thread_limiter()
    loop = asyncio.get_running_loop()
    with anyio.fail_after(120):
        async with RolloutEngine(
            config, pool=FakePool(2), env=lambda: SyncEcho() if next(built) % 2 else Echo()
        ) as engine:
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
        async with RolloutEngine(episode_cfg("sampling.n=1"), pool=FakePool(2), env=stuck.env) as engine:
            sub = engine.submit([Prompt(text="a")])
            await stuck.entered.wait()
            sub.cancel()
            if not sync:
                await stuck.left.wait()
                assert stuck.cancelled
            while sub in engine._scheduler._submissions:  # its task ends
                await anyio.sleep(0.01)
            assert sub._recv.statistics().current_buffer_used == 0  # no group: nothing was delivered
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
        groups, _, _ = await episodes(
            episode_cfg("sampling.n=1", "episode.step_timeout_s=0.05"), Hangs, [Prompt(text="a")]
        )
    finally:
        release.set()
    (ep,) = groups[0].trajectories
    assert not ep.ok and "environment step of turn 0 took longer than episode.step_timeout_s=0.05" in ep.error


async def test_an_on_trajectory_callback_raising_system_exit_fails_that_group_only():
    """User code on the loop too: a callback's SystemExit fails its group (as any exception it
    raises does), not the engine's task group."""

    def on_trajectory(t):
        if t.prompt_id == "bad":
            raise SystemExit(2)

    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(episode_cfg("sampling.n=1"), pool=FakePool(1), on_trajectory=on_trajectory) as engine:
            engine.feed([Prompt(token_ids=[5, 6], id="bad"), Prompt(token_ids=[7, 8], id="good")])
            groups = {g.prompt_id: g async for g in engine.groups()}
    assert groups["good"].ok
    assert not groups["bad"].ok and "SystemExit: 2" in groups["bad"].error
