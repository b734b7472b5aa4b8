"""Reward functions on fake engines: loading, sync and async calls, failures that stay local."""

from __future__ import annotations

import asyncio
import math
import sys

import anyio
import msgspec
import pytest
import torch

from rollout.config import Config
from rollout.engine import RolloutEngine
from rollout.errors import InvalidConfigError
from rollout.inputs.rewards import load_reward
from rollout.types import Prompt, Trajectory
from tests.support.fakes import FakePool


def length_reward(prompt: Prompt, traj: Trajectory) -> float:
    return float(len(traj.token_ids) + traj.sample_index)


async def async_reward(prompt: Prompt, traj: Trajectory) -> float:
    await anyio.sleep(0)
    return 1.0 if prompt.metadata.get("good") else 0.0


def picky_reward(prompt: Prompt, traj: Trajectory):
    if prompt.id == "raise":
        raise KeyError("no answer key")
    return {"nan": math.nan, "text": "1.0", "bool": True}.get(prompt.id, 2)


NOT_CALLABLE = 3


@pytest.fixture
def cfg(make_cfg) -> Config:
    """Groups of 3 samples of 4 tokens."""
    return make_cfg("sampling.n=3", "sampling.max_tokens=4")


@pytest.mark.parametrize(
    "path, message",
    [
        ("nocolon", "expected 'package.module:function'"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz': ModuleNotFoundError"),
        ("tests.test_rewards:missing", "has no attribute 'missing'"),
        ("tests.test_rewards:NOT_CALLABLE", "is not callable"),
    ],
)
def test_bad_reward_paths_name_the_key(path, message):
    with pytest.raises(InvalidConfigError, match="^reward: ") as e:
        load_reward(path)
    assert message in str(e.value)


async def test_a_bad_reward_path_fails_before_engines_start(cfg):
    pool = FakePool(2)
    with pytest.raises(InvalidConfigError, match="reward: cannot import"):
        async with RolloutEngine(msgspec.structs.replace(cfg, reward="nope_mod:f"), pool=pool):
            pass
    assert total_requests(pool) == 0


def total_requests(pool: FakePool) -> int:
    return sum(len(e.requests) for e in pool.engines)


async def test_sync_reward_from_config_and_grpo_advantages(cfg):
    with anyio.fail_after(5):
        async with RolloutEngine(
            msgspec.structs.replace(cfg, reward="tests.test_rewards:length_reward"), pool=FakePool(2)
        ) as engine:
            engine.feed([Prompt(token_ids=[5, 6], id="a"), Prompt(token_ids=[7], id="b")])
            batch = await engine.batches(groups=2)
    assert [t.reward for g in batch.groups for t in g.trajectories] == [4.0, 5.0, 6.0] * 2
    tensors = batch.to_tensors()
    assert tensors["rewards"].tolist() == [4.0, 5.0, 6.0] * 2
    assert torch.allclose(tensors["advantages"], torch.tensor([-1.0, 0.0, 1.0] * 2), atol=1e-5)  # std of (4,5,6) = 1
    assert torch.allclose(batch.to_tensors(normalize_std=False)["advantages"], torch.tensor([-1.0, 0.0, 1.0] * 2))


async def test_async_reward_passed_in_code(cfg):
    with anyio.fail_after(5):
        async with RolloutEngine(cfg, pool=FakePool(2), reward=async_reward) as engine:
            engine.feed([Prompt(token_ids=[5], id="g", metadata={"good": True}), Prompt(token_ids=[6], id="b")])
            groups = {g.prompt_id: g async for g in engine.groups()}
    assert [t.reward for t in groups["g"].trajectories] == [1.0] * 3
    assert [t.reward for t in groups["b"].trajectories] == [0.0] * 3


async def test_reward_failures_mark_only_that_trajectory(cfg):
    with anyio.fail_after(5):
        async with RolloutEngine(cfg, pool=FakePool(2), reward=picky_reward) as engine:
            engine.feed([Prompt(token_ids=[5], id=i) for i in ("raise", "nan", "text", "bool", "fine")])
            groups = {g.prompt_id: g async for g in engine.groups()}
    assert groups["fine"].ok and [t.reward for t in groups["fine"].trajectories] == [2.0] * 3
    raised = groups["raise"].trajectories[0]
    assert (
        raised.finish_reason == "error" and "KeyError: 'no answer key'" in raised.error and "Traceback" in raised.error
    )
    assert "returned nan, expected a finite number" in groups["nan"].trajectories[0].error
    assert "returned '1.0'" in groups["text"].trajectories[0].error
    assert "returned True" in groups["bool"].trajectories[0].error


def test_a_reward_module_in_the_working_directory_imports_from_the_console_script(tmp_path, monkeypatch):
    # `rollout` is a console script: its sys.path lacks the working directory, where
    # `reward: mymodule:fn` and `env: rollout.episodes.examples:Observations` live
    (tmp_path / "cwd_reward_mod.py").write_text("def fn(prompt, traj):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_reward("cwd_reward_mod:fn") is not None


def exiting_reward(prompt: Prompt, traj: Trajectory):
    """Sync (a worker thread): sample 0 of each prompt raises what its id names."""
    if traj.sample_index == 0:
        if prompt.id == "exit":
            raise SystemExit(3)  # argparse on a bad answer
        if prompt.id == "interrupt":
            raise KeyboardInterrupt
        if prompt.id == "huge":
            return 10**400  # an int past float's range
    return 1.0


async def cancelling_reward(prompt: Prompt, traj: Trajectory):
    if traj.sample_index == 0:
        if prompt.id == "cancel":
            raise asyncio.CancelledError  # its own, not the engine's cancellation
        if prompt.id == "exit":
            raise SystemExit(4)
    return 1.0


@pytest.mark.parametrize(
    "reward, prompt_id, message",
    [
        (exiting_reward, "exit", "SystemExit: 3"),
        (exiting_reward, "interrupt", "KeyboardInterrupt"),
        (exiting_reward, "huge", "returned 1000"),
        (cancelling_reward, "cancel", "CancelledError"),
        (cancelling_reward, "exit", "SystemExit: 4"),
    ],
)
async def test_a_reward_raising_a_base_exception_fails_that_trajectory_only(cfg, reward, prompt_id, message):
    with anyio.fail_after(5):
        async with RolloutEngine(cfg, pool=FakePool(2), reward=reward) as engine:
            engine.feed([Prompt(token_ids=[5], id=prompt_id), Prompt(token_ids=[6], id="fine")])
            groups = {g.prompt_id: g async for g in engine.groups()}
    first, *rest = groups[prompt_id].trajectories
    assert first.finish_reason == "error" and message in first.error
    assert [t.reward for t in rest] == [1.0, 1.0] and [t.reward for t in groups["fine"].trajectories] == [1.0] * 3
