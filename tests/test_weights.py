"""Weight updates without engines: the checks on incoming weights, the wire form, and the
all-or-nothing orchestration of `RolloutEngine.update_weights` over fake engines."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import torch
from safetensors.torch import save_file

from policies.weights import Packed, TensorSpec, pack, read_manifest, save_dir, unpack
from rollout.config import load_config
from rollout.engine import RolloutEngine
from rollout.epochs import kv_runs
from rollout.errors import EngineDeadError, InvalidWeightsError, WeightSyncError
from rollout.types import Prompt, Trajectory
from rollout.weights.updates import pack_on_loop
from tests.fakes import FakePool

STATE = {
    "embed.weight": torch.arange(12, dtype=torch.float32).reshape(4, 3),
    "norm.weight": torch.ones(3, dtype=torch.bfloat16),
}


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"vocab_size": 260}')
    save_file(STATE, str(d / "model.safetensors"))
    return d


@pytest.fixture
def cfg(model_dir):
    cfg = load_config(None, ["engines.count=3", "logging.level=error", "weight_sync.timeout_s=0.5"])
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=str(model_dir)))


def test_manifest_reads_headers(model_dir):
    assert read_manifest(model_dir) == {
        "embed.weight": TensorSpec("float32", (4, 3)),
        "norm.weight": TensorSpec("bfloat16", (3,)),
    }


def test_pack_roundtrip_keeps_values_and_dtypes(model_dir):
    packed = pack(STATE, read_manifest(model_dir))
    assert isinstance(packed, Packed) and packed.nbytes == 12 * 4 + 3 * 2
    back = unpack(packed)
    for name, t in STATE.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"norm.weight": torch.ones(4, dtype=torch.bfloat16)}, "norm.weight: shape [4], model has [3]"),
        ({"norm.weight": torch.ones(3)}, "norm.weight: dtype float32, model has bfloat16"),
        ({"extra": torch.ones(1)}, "unknown extra"),
        ({"embed.weight": None}, "missing embed.weight"),
        ({"embed.weight": torch.full((4, 3), float("nan"))}, "embed.weight']: contains NaN"),
        (
            {"embed.weight": torch.zeros(4, 3).index_fill_(1, torch.tensor([1]), -float("inf"))},
            "embed.weight']: contains NaN or inf",
        ),
        (
            {"norm.weight": torch.tensor([1.0, float("nan"), 1.0], dtype=torch.bfloat16)},
            "norm.weight']: contains NaN or inf",
        ),
        ({"embed.weight": [[1.0]]}, "expected a torch.Tensor, got list"),
        ({"embed.weight": torch.empty(4, 3, device="meta")}, "embed.weight']: on device meta, which holds no data"),
        ({"embed.weight": None, "norm.weight": None}, "the state dict is empty"),
    ],
)
@pytest.mark.parametrize("on_loop", [False, True], ids=["pack", "pack_on_loop"])
async def test_pack_rejects_weights_that_do_not_fit(model_dir, change, message, on_loop):
    sd = {k: v for k, v in {**STATE, **change}.items() if v is not None}
    with pytest.raises(InvalidWeightsError) as e:
        await pack_on_loop(sd, read_manifest(model_dir)) if on_loop else pack(sd, read_manifest(model_dir))
    assert message in str(e.value)


async def test_pack_on_loop_gives_the_loop_a_turn_per_tensor(tmp_path):
    """The driver's packing (`pack_on_loop`) holds the event loop one tensor at a time: another
    task runs between every two tensors, and the result is `pack`'s, byte for byte. (In a worker
    thread, each of its torch calls would wait for the GIL behind the busy loop.)"""
    sd = {f"layers.{i}.weight": torch.full((8, 8), float(i), dtype=torch.bfloat16) for i in range(50)}
    d = save_dir(sd, tmp_path / "many")
    turns = 0

    async def other_task():
        nonlocal turns
        while True:
            turns += 1
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(other_task)
        await anyio.sleep(0)
        start = turns
        packed = await pack_on_loop(sd, read_manifest(d))
        during = turns - start
        tg.cancel_scope.cancel()
    assert during >= len(sd) - 1, during
    want = pack(sd, read_manifest(d))
    assert packed.specs == want.specs and all(packed.data[n].tobytes() == want.data[n].tobytes() for n in sd)
    assert await pack_on_loop(d, read_manifest(d)) == str(d)


def test_pack_checks_directories(model_dir, tmp_path):
    assert pack(model_dir, read_manifest(model_dir)) == str(model_dir)
    other = save_dir({"embed.weight": torch.zeros(4, 3)}, tmp_path / "other")
    with pytest.raises(InvalidWeightsError, match="missing norm.weight"):
        pack(other, read_manifest(model_dir))
    with pytest.raises(InvalidWeightsError, match="not a directory"):
        pack(tmp_path / "nope", read_manifest(model_dir))


def test_kv_runs_follow_policy_epochs_and_recomputes():
    # prompt of 4, tokens g0..g9: g0-g4 epoch 0, g5.. epoch 1. Without recompute the KV of
    # position 4+5-1=8 (fed to sample g5) is epoch 1; the prompt is g0's epoch.
    assert kv_runs(4, 10, [(0, 0), (5, 1)], []) == [(0, 0), (8, 1)]
    # A recompute before g5 recomputed positions 0..8 with epoch 1.
    assert kv_runs(4, 10, [(0, 0), (5, 1)], [(5, 1)]) == [(0, 1)]
    assert kv_runs(4, 10, [(0, 0), (5, 1), (7, 2)], [(5, 1)]) == [(0, 1), (10, 2)]
    assert kv_runs(4, 0, [], []) == []
    t = Trajectory(token_ids=[5] * 10, policy_epochs=[(0, 0), (5, 2)])
    assert t.epoch_span == (0, 2) and Trajectory().epoch_span is None


async def test_update_reaches_every_engine_once_and_bumps_the_epoch(cfg):
    pool = FakePool(3)
    with anyio.fail_after(5):
        async with RolloutEngine(cfg, pool=pool) as engine:
            assert await engine.update_weights(STATE) == 1
            assert await engine.update_weights(STATE) == 2
            assert len(pool.shared) == 2  # moved once per update, not once per engine
            assert [e.commits for e in pool.engines] == [[1, 2]] * 3
            u = engine.weight_updates[-1]
            assert (u.epoch, u.bytes, u.bytes_received, u.failed) == (2, 54, 300, [])
            assert set(u.stall_s) == {0, 1, 2}


async def test_a_failed_receive_changes_no_engine(cfg):
    pool = FakePool(3)
    pool.engines[1].fail_stage = True
    with anyio.fail_after(5):
        async with RolloutEngine(cfg, pool=pool) as engine:
            with pytest.raises(WeightSyncError, match="engine 1: RuntimeError: no space left") as e:
                await engine.update_weights(STATE)
            assert e.value.failed == [1] and engine.epoch == 0
            assert all(not eng.commits and not eng.staged for eng in pool.engines)


async def test_an_engine_found_dead_at_an_update_restarts_and_the_others_load_it(cfg):
    """An engine killed a moment ago (no health report due yet): the update finds it dead while
    the weights go out, takes it out of rotation and goes on; its restart loads the new epoch."""
    e = msgspec.structs.replace(cfg.engines, restart_backoff_s=0, health_interval_s=60)
    pool = FakePool(3)
    with anyio.fail_after(5):
        async with RolloutEngine(msgspec.structs.replace(cfg, engines=e), pool=pool) as engine:
            killed = pool.engines[1]
            await killed.kill()
            assert await engine.update_weights(STATE) == 1
            u = engine.weight_updates[-1]
            assert set(u.stall_s) == {0, 2} and not u.failed
            while not engine._scheduler.runner.loads[1].healthy:
                await anyio.sleep(0.01)
            assert pool.restarts == [1] and pool.engines[1] is not killed
            assert [eng.commits for eng in pool.engines] == [[1]] * 3  # the restarted one: at the current epoch
            assert await engine.update_weights(STATE) == 2


async def test_a_live_engine_that_cannot_receive_still_calls_the_update_off(cfg):
    e = msgspec.structs.replace(cfg.engines, restart_backoff_s=0, health_interval_s=60, max_restarts=0)
    pool = FakePool(3)
    pool.engines[0].dead = True
    pool.engines[2].fail_stage = True
    with anyio.fail_after(5):
        async with RolloutEngine(msgspec.structs.replace(cfg, engines=e), pool=pool) as engine:
            with pytest.raises(WeightSyncError, match="engine 2: RuntimeError: no space left") as err:
                await engine.update_weights(STATE)
            assert err.value.failed == [0, 2] and engine.epoch == 0
            assert all(not eng.commits and not eng.staged for eng in pool.engines)
            assert [load.healthy for load in engine._scheduler.runner.loads] == [
                False,
                True,
                True,
            ]  # the dead one is out
            pool.engines[1].dead = pool.engines[2].dead = True
            with pytest.raises(WeightSyncError, match="engine 1: EngineDeadError"):  # none alive: nothing loads
                await engine.update_weights(STATE)
            assert engine.epoch == 0 and not any(eng.commits for eng in pool.engines)


async def test_a_failed_or_hung_load_takes_the_engine_out_of_rotation(cfg):
    pool = FakePool(3)
    pool.engines[0].fail_commit = True
    pool.engines[2].hang_commit = True
    with anyio.fail_after(5):
        async with RolloutEngine(cfg, pool=pool) as engine:
            with pytest.raises(WeightSyncError) as e:
                await engine.update_weights(STATE)
            msg = str(e.value)
            assert (
                "engine 0: RuntimeError: reload failed" in msg
                and "engine 2: no answer within weight_sync.timeout_s" in msg
            )
            assert e.value.failed == [0, 2] and engine.epoch == 1
            engine.feed([Prompt(token_ids=[5, 6], id="after")])
            group = await engine.next_group()
            assert group.ok and {t.engine_id for t in group.trajectories} == {1}
            pool.engines[1].fail_commit = True
            with pytest.raises(WeightSyncError, match="every engine failed"):
                await engine.update_weights(STATE)
            with pytest.raises(EngineDeadError, match="every engine is dead"):
                await engine.update_weights(STATE)


async def test_bad_weights_never_reach_the_pool(cfg, tmp_path):
    pool = FakePool(3)
    with anyio.fail_after(5):
        async with RolloutEngine(cfg, pool=pool) as engine:
            with pytest.raises(InvalidWeightsError, match="missing norm.weight"):
                await engine.update_weights({"embed.weight": STATE["embed.weight"]})
            nan = save_dir(
                {**STATE, "norm.weight": torch.full((3,), float("nan"), dtype=torch.bfloat16)}, tmp_path / "nan"
            )
            with pytest.raises(InvalidWeightsError, match=r"model.safetensors: weights\['norm.weight'\]: contains NaN"):
                await engine.update_weights(nan)
            assert not pool.shared and engine.epoch == 0


async def test_a_cancelled_update_never_lets_two_weights_share_an_epoch(cfg):
    """Engine 0 has committed epoch 1 and engine 1 is still loading when the caller gives up; the
    next update must not label different weights with epoch 1 again."""
    pool = FakePool(3)
    pool.engines[1].commit_gate = gate = anyio.Event()
    with anyio.fail_after(5):
        async with RolloutEngine(cfg, pool=pool) as engine:
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.update_weights, STATE)
                await pool.engines[0].wait_until(lambda e: e.commits == [1])
                tg.cancel_scope.cancel()  # the caller's timeout, mid-commit
                gate.set()
            second = await engine.update_weights(STATE)
            committed = [e.commits for e in pool.engines]
    assert second == 2 and committed == [[1, 2]] * 3, committed


async def test_a_drain_longer_than_the_timeout_is_not_a_failed_load(cfg):
    """In drain mode the engine waits for running requests before loading; weight_sync.timeout_s
    bounds the load, so a long generation must not make the engine 'fail' and restart."""
    drain = msgspec.structs.replace(
        cfg, weight_sync=msgspec.structs.replace(cfg.weight_sync, mode="drain", timeout_s=0.02)
    )
    pool = FakePool(3)
    for e in pool.engines:
        e.commit_gate = anyio.Event()  # the drain: running requests finishing
    with anyio.fail_after(5):
        async with RolloutEngine(drain, pool=pool) as engine:
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.update_weights, STATE)
                await anyio.sleep(0.1)  # time must pass beyond timeout_s: that is what is tested
                for e in pool.engines:
                    e.commit_gate.set()
            assert engine.epoch == 1 and not engine.weight_updates[-1].failed


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("shard", [0, 1])
def test_pack_checks_the_values_of_a_directory(model_dir, tmp_path, bad, shard):
    """A directory gets the value checks of a state dict, in whichever shard the bad tensor is;
    none of its tensors is left behind and nothing is returned to load."""
    d = tmp_path / "sharded"
    d.mkdir()
    shards = [{"embed.weight": STATE["embed.weight"].clone()}, {"norm.weight": STATE["norm.weight"].clone()}]
    name = next(iter(shards[shard]))
    shards[shard][name].view(-1)[1] = bad
    for i, part in enumerate(shards):
        save_file(part, str(d / f"model-{i + 1:05d}-of-00002.safetensors"))
    with pytest.raises(InvalidWeightsError) as e:
        pack(d, read_manifest(model_dir))
    assert f"model-{shard + 1:05d}-of-00002.safetensors" in str(e.value) and f"{name!r}" in str(e.value)
    assert "contains NaN or inf" in str(e.value)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e5m2", "float8_e4m3fn", "float32", "float64"])
def test_finite_bits_agrees_with_torch_on_every_pattern(dtype):
    """The driver reads NaN/inf from the bits (numpy, no torch intra-op threads): every 8- and
    16-bit pattern, and for wider floats the edges of every class, agree with `torch.isfinite`."""
    from policies.weights import finite_bits

    torch_dtype = getattr(torch, dtype)
    width = torch.empty(0, dtype=torch_dtype).element_size()
    if width <= 2:
        patterns = torch.arange(1 << (8 * width), dtype=torch.int32).to(
            torch.uint8 if width == 1 else torch.int16
        )  # wraps: every pattern once
        assert len(set(patterns.tolist())) == 1 << (8 * width)
        values = patterns.view(torch_dtype)
    else:
        specials = [
            0.0,
            -0.0,
            1.0,
            -1.0,
            float("inf"),
            -float("inf"),
            float("nan"),
            torch.finfo(torch_dtype).max,
            torch.finfo(torch_dtype).min,
            torch.finfo(torch_dtype).tiny,
        ]
        values = torch.tensor(specials, dtype=torch_dtype)
        values = torch.cat(
            [values, -torch.tensor([float("nan")], dtype=torch_dtype), torch.randn(1000, dtype=torch_dtype)]
        )
    finite = torch.isfinite(values.to(torch.float32) if width == 1 else values)
    for v, want in zip(values, finite.tolist()):
        got = finite_bits(dtype, v.reshape(1).view(torch.uint8).numpy())
        assert got is want, (dtype, v.reshape(1).view(torch.uint8).tolist(), got, want)
    whole = values.reshape(-1).view(torch.uint8).numpy()
    assert finite_bits(dtype, whole) is bool(finite.all())
    assert finite_bits(dtype, values[finite].reshape(-1).view(torch.uint8).numpy()) is True


def test_finite_bits_reads_past_one_chunk_and_leaves_other_dtypes_to_torch():
    from policies.weights import finite_bits

    t = torch.zeros(3 * (1 << 18) + 5, dtype=torch.bfloat16)
    assert finite_bits("bfloat16", t.view(torch.uint8).numpy()) is True
    t[-1] = float("inf")  # in the last, partial chunk
    assert finite_bits("bfloat16", t.view(torch.uint8).numpy()) is False
    assert finite_bits("int64", torch.tensor([-1]).view(torch.uint8).numpy()) is True
    assert finite_bits("float8_e4m3fnuz", torch.zeros(1, dtype=torch.uint8).numpy()) is None
    with pytest.raises(InvalidWeightsError, match=r"\['w'\]: contains NaN or inf"):
        pack(
            {"w": torch.tensor([0.0, float("nan")]).to(torch.float8_e4m3fnuz)},
            {"w": TensorSpec("float8_e4m3fnuz", (2,))},
        )
