"""The cluster simulator (`benchmarks/cluster_sim.py`) end to end on a tiny load, its engines in this
process (`SimPool(local=True)`: the driver's real `RayEngine`s over `SimEngine`s, no Ray): every fed
prompt comes out once, an update lands inside samples with exact epoch runs, a killed engine loses
nothing, and bad inputs are refused naming the flag."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from benchmarks.cluster_sim import WEIGHTS, Options, config, main, model_dir, parse, run_one
from benchmarks.sim_engine import SimEngine, SimSpec
from benchmarks.sim_pool import SimPool
from rollout.engine import RolloutEngine
from rollout.epochs import expand_runs
from rollout.errors import EngineDeadError
from rollout.types import Prompt

TIMEOUT = 30  # seconds; only reached when a test is about to fail


def options(**kw) -> Options:
    spec = SimSpec(**{"tokens_per_s": 4000, "ttft_s": 0, "capacity": 8, "length": "fixed:10", **kw.pop("spec", {})})
    base = {
        "engines": [2],
        "queued": 8,
        "max_tokens": 16,
        "prompt_len": 4,
        "n": 2,
        "batch": 1,
        "hosts": 2,
        "update_every": 0,
        "local": True,
    }
    return Options(spec=spec, **{**base, **kw})


def engines(pool: SimPool) -> list[SimEngine]:
    return [e for host in pool.objects for e in host.engines.values()]


async def until(pool: SimPool, predicate) -> None:
    """Wait until `predicate()` holds, re-checked whenever a simulated engine parks a sequence."""
    async with asyncio.timeout(TIMEOUT):
        while not predicate():
            waits = [asyncio.ensure_future(e.changed.wait()) for e in engines(pool)]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()


def prompts(count: int) -> list[Prompt]:
    return [Prompt(token_ids=[5, 6, 7, 8], id=f"q{i}") for i in range(count)]


async def test_every_prompt_comes_out_once_with_consistent_epochs():
    # ~1.5 s of generation (0.4 s a sample) with an update every 50 ms: a slower machine only adds updates
    o = options(
        spec={"preempt": 0.5, "length": "lognormal:40:0.8", "tokens_per_s": 800}, max_tokens=100, update_every=0.05
    )
    result = await asyncio.wait_for(run_one(o, 3, prompts(40)), TIMEOUT)
    assert (result["fed"], result["out"], result["lost"], result["duplicated"], result["failed_trajectories"]) == (
        40,
        40,
        0,
        0,
        0,
    )
    assert result["epoch"] >= 1
    for runs, length in result["epochs"]:
        expand_runs(runs, length)  # raises on runs that do not cover the tokens
        epochs = [e for _, e in runs]
        assert epochs == sorted(epochs) and epochs[-1] <= result["epoch"]


async def test_with_the_durable_log_every_prompt_comes_out_once(tmp_path):
    result = await asyncio.wait_for(run_one(options(durable=str(tmp_path / "log")), 2, prompts(12)), TIMEOUT)
    assert (result["fed"], result["out"], result["lost"], result["duplicated"]) == (12, 12, 0, 0)
    assert (tmp_path / "log").is_dir() and any((tmp_path / "log").iterdir())


async def test_an_update_lands_inside_every_held_sample(tmp_path):
    o = options()
    pool = SimPool.start(o.spec, 2, o.hosts, local=True)
    for e in engines(pool):
        e.hold = True  # each sequence waits at its last token
    async with RolloutEngine(config(o, 2, model_dir(str(tmp_path), o.spec.vocab)), pool=pool) as engine:
        engine.feed(prompts(4))
        await until(pool, lambda: sum(len(e.parked) for e in engines(pool)) == 8)
        assert await engine.update_weights(WEIGHTS) == 1
        for e in engines(pool):
            e.release()
        groups = [g async for g in engine.groups()]
    trajectories = [t for g in groups for t in g.trajectories]
    assert len(trajectories) == 8 and all(t.ok for t in trajectories)
    assert {tuple(map(tuple, t.policy_epochs)) for t in trajectories} == {
        ((0, 0), (9, 1))
    }  # 9 tokens at 0, the last at 1


async def test_a_killed_engine_loses_nothing(tmp_path):
    o = options()
    pool = SimPool.start(o.spec, 3, 3, local=True)
    for e in engines(pool):
        e.hold = True
    async with RolloutEngine(config(o, 3, model_dir(str(tmp_path), o.spec.vocab)), pool=pool) as engine:
        engine.feed(prompts(6))
        await until(pool, lambda: sum(len(e.parked) for e in engines(pool)) == 12)
        on_0 = {s.req.prompt_id for s in pool.objects[0].engines[0].parked}
        await pool.kill(0)
        for e in engines(pool):
            e.release()
        groups = [g async for g in engine.groups()]
    assert on_0 and sorted(g.prompt_id for g in groups) == sorted(p.id for p in prompts(6))
    moved = [t for g in groups if g.prompt_id in on_0 for t in g.trajectories]
    assert all(t.ok and t.engine_id != 0 for g in groups for t in g.trajectories) and len(moved) == 2 * len(on_0)


async def test_a_stalled_engine_is_killed_by_the_health_watch_and_loses_nothing(tmp_path):
    o = options()
    pool = SimPool.start(o.spec, 3, 3, local=True)
    for e in engines(pool):
        e.hold = True
    cfg = config(o, 3, model_dir(str(tmp_path), o.spec.vocab))
    cfg = msgspec.structs.replace(
        cfg, engines=msgspec.structs.replace(cfg.engines, health_interval_s=0.05, health_timeout_s=0.2)
    )
    async with RolloutEngine(cfg, pool=pool) as engine:
        engine.feed(prompts(6))
        await until(pool, lambda: sum(len(e.parked) for e in engines(pool)) == 12)
        on_0 = {s.req.prompt_id for s in pool.objects[0].engines[0].parked}
        await pool.stall(0)  # answers nothing from now on: only the health watch can find out
        for e in engines(pool)[1:]:
            e.release()
        groups = [g async for g in engine.groups()]
        await asyncio.wait_for(pool.restarted.wait(), TIMEOUT)
    assert on_0 and sorted(g.prompt_id for g in groups) == sorted(p.id for p in prompts(6)) and pool.restarts == [0]
    assert all(t.ok and t.engine_id != 0 for g in groups for t in g.trajectories)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--engines", "0"], "--engines"),
        (["--engines", "8,x"], "--engines"),
        (["--tokens-per-s", "-5"], "--tokens-per-s"),
        (["--ttft", "nan"], "--ttft"),
        (["--length", "zipf:3"], "--length"),
        (["--length", "lognormal:200"], "--length"),
        (["--length", "uniform:9:3"], "--length"),
        (["--preempt", "1.5"], "--preempt"),
        (["--capacity", "4", "--n", "8"], "--n"),
        (["--kill", "three@10"], "--kill"),
        (["--engines", "8", "--stall", "8@1"], "--stall"),
        (["--gc-threshold", "700,x"], "--gc-threshold"),
        (["--gc-threshold", "1,2,3,4"], "--gc-threshold"),
    ],
)
def test_bad_input_is_refused_naming_the_flag(argv, flag, capsys):
    with pytest.raises(ValueError, match=f"^{flag}:"):
        parse(argv)
    assert main(argv) == 2 and f"cluster_sim: {flag}:" in capsys.readouterr().err


async def test_progress_reports_cross_the_data_path_once_the_engine_is_connected(tmp_path):
    """A Ray call costs the driver as much as a group: once an engine's `serve` call is connected,
    the health watch's reports come on the zmq socket (the host counts no Ray `progress` call),
    and an engine whose report fails (vLLM's core died) says so as EngineDeadError."""
    o = options()
    pool = SimPool.start(o.spec, 2, 2, local=True)
    for e in engines(pool):
        e.hold = True
    cfg = config(o, 2, model_dir(str(tmp_path), o.spec.vocab))
    async with RolloutEngine(cfg, pool=pool) as engine:
        engine.feed(prompts(2))
        await until(pool, lambda: sum(len(e.parked) for e in engines(pool)) == 4)
        handle, host = pool.engines[0], pool.objects[0]
        before = host.calls.get("progress", 0)
        report = await handle.progress()
        assert host.calls.get("progress", 0) == before and len(report) == 2
        assert all(t.token_ids for t in report.values())  # each parked sample at its last token

        def broken() -> bytes:
            raise EngineDeadError("vLLM's engine core died")

        host.engines[0].progress = broken
        with pytest.raises(
            EngineDeadError, match="engine 0: health report failed: EngineDeadError: vLLM's engine core died"
        ):
            await handle.progress()
        for e in engines(pool):
            e.release()
        assert len([g async for g in engine.groups()]) == 2
