"""The weight plane without vLLM or Ray: the plan and its checks, bucket assembly, and whole rounds
between a real `PlaneSender` and fake engines whose model workers run the real `PlaneReceiver`
(gloo process groups and shared-memory slots, over a real TCPStore, in this process)."""

from __future__ import annotations

import math
import threading

import anyio
import msgspec
import pytest
import torch
from safetensors.torch import save_file

from policies.transfer import Assembler, RankMeta, ShardMeta, make_plan, pack_bucket
from policies.weights import TensorSpec
from rollout.config import load_config
from rollout.engine import RolloutEngine
from rollout.errors import InvalidWeightsError
from rollout.plane_sender import PlaneSender
from tests.fakes import FakePool

TIMEOUT = 20  # seconds; only reached when a test is about to fail
STATE = {
    "embed.weight": torch.randn(40, 30),
    "layers.0.weight": torch.randn(30, 30).to(torch.bfloat16),
    "norm.weight": torch.ones(30, dtype=torch.bfloat16),
    "steps": torch.tensor(7),
}
MANIFEST = {n: TensorSpec(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in STATE.items()}


def shards(state: dict[str, torch.Tensor], **changes) -> list[ShardMeta]:
    return [ShardMeta(n, MANIFEST[n].dtype, MANIFEST[n].shape, **changes) for n in state]


def changed(k: int) -> dict[str, torch.Tensor]:
    """Distinct weights per round, same names, shapes and dtypes."""
    return {n: (t + k if t.is_floating_point() else t + k) for n, t in STATE.items()}


@pytest.fixture
def cfg(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 260}')
    save_file(STATE, str(tmp_path / "model.safetensors"))
    cfg = load_config(None, ["engines.count=2", "logging.level=error", "weight_sync.timeout_s=10"])
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=str(tmp_path)))


# -- the plan ---------------------------------------------------------------------------------


def test_a_plan_cuts_every_byte_into_buckets_and_back():
    metas = [RankMeta(0, shards(STATE))]
    nbytes = sum(t.numel() * t.element_size() for t in STATE.values())
    for size in (1, 7, 100, 10_000):
        plan = make_plan(metas, MANIFEST, size)
        assert plan.nbytes == nbytes and all(b.nbytes <= size for b in plan.buckets)
        assert len(plan.buckets) == math.ceil(nbytes / size)
        held = {i: (STATE[t.name].reshape(-1).view(torch.uint8), 0) for i, t in enumerate(plan.tensors)}
        assembler, out = Assembler(plan), {}
        for b in range(len(plan.buckets)):
            buf = torch.zeros(size, dtype=torch.uint8)
            pack_bucket(plan, b, held, buf)
            out.update(assembler.add(b, buf))
        assert set(out) == set(STATE) and not assembler.missing()
        for n, t in STATE.items():
            assert out[n].dtype == t.dtype and torch.equal(out[n], t), (size, n)


def test_shards_of_dim0_rows_from_two_ranks_make_whole_tensors():
    rows = STATE["embed.weight"].shape[0]
    metas = [
        RankMeta(0, [ShardMeta("embed.weight", "float32", (40, 30), 0, 25), *shards({"norm.weight": 0, "steps": 0})]),
        RankMeta(1, [ShardMeta("embed.weight", "float32", (40, 30), 25, rows - 25), *shards({"layers.0.weight": 0})]),
    ]
    plan = make_plan(metas, MANIFEST, 512)
    assert [b.src for b in plan.buckets[:4]] == [0, 1, 0, 1]  # ranks interleaved: both send at once
    embed = STATE["embed.weight"].reshape(-1).view(torch.uint8)
    row = 30 * 4
    held = {
        0: {0: (embed[: 25 * row], 0), 1: (STATE["norm.weight"].reshape(-1).view(torch.uint8), 0), 2: (STATE["steps"].reshape(-1).view(torch.uint8), 0)},
        1: {0: (embed[25 * row :], 25 * row), 3: (STATE["layers.0.weight"].reshape(-1).view(torch.uint8), 0)},
    }
    assembler, out = Assembler(plan), {}
    for b, bucket in enumerate(plan.buckets):
        buf = torch.zeros(512, dtype=torch.uint8)
        pack_bucket(plan, b, held[bucket.src], buf)
        out.update(assembler.add(b, buf))
    for n, t in STATE.items():
        assert torch.equal(out[n], t), n


@pytest.mark.parametrize(
    "metas, message",
    [
        ([RankMeta(0, [*shards(STATE), ShardMeta("lm_head.weight", "float32", (4,), source="head.w")])], "unknown lm_head.weight (learner name head.w) from rank 0"),
        ([RankMeta(0, shards({k: v for k, v in STATE.items() if k != "steps"}))], "missing steps"),
        ([RankMeta(0, [*shards({k: 0 for k in STATE if k != "norm.weight"}), ShardMeta("norm.weight", "float32", (30,))])], "norm.weight: dtype float32, model has bfloat16"),
        ([RankMeta(0, [*shards({k: 0 for k in STATE if k != "norm.weight"}), ShardMeta("norm.weight", "bfloat16", (31,))])], "norm.weight: shape [31], model has [30]"),
        ([RankMeta(0, shards(STATE)), RankMeta(1, shards({"steps": 0}))], "steps: sent by ranks [0, 1], one of them whole"),
        (
            [RankMeta(0, [*shards({k: 0 for k in STATE if k != "embed.weight"}), ShardMeta("embed.weight", "float32", (40, 30), 0, 20)]),
             RankMeta(1, [ShardMeta("embed.weight", "float32", (40, 30), 10, 20)])],
            "embed.weight: rows 10..30 from rank 1 were already sent",
        ),
        (
            [RankMeta(0, [*shards({k: 0 for k in STATE if k != "embed.weight"}), ShardMeta("embed.weight", "float32", (40, 30), 0, 20)])],
            "embed.weight: rows 20..40 are sent by no rank",
        ),
        ([RankMeta(0, [*shards(STATE), ShardMeta("steps", "int64", (), 0, 1)])], "steps: rank 0 sends rows 0..1 of a tensor of shape []"),
    ],
    ids=["unknown", "missing", "dtype", "shape", "twice", "overlap", "gap", "slice-of-scalar"],
)
def test_declarations_that_do_not_fit_the_model_are_named(metas, message):
    with pytest.raises(InvalidWeightsError) as e:
        make_plan(metas, MANIFEST, 64)
    assert message in str(e.value)


# -- whole rounds over fake engines -----------------------------------------------------------


@pytest.mark.parametrize("backend", ["gloo", "shm"])
async def test_the_learner_sends_straight_to_every_engine_and_the_epoch_advances(cfg, backend):
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            plane = await engine.weight_plane(backend=backend, bucket_bytes=1000)
            for k in (1, 2):
                assert await plane.send(changed(k)) == k
                for e in pool.engines:
                    assert set(e.plane.loaded) == set(STATE)
                    assert all(torch.equal(e.plane.loaded[n], t) for n, t in changed(k).items())
            assert [e.commits for e in pool.engines] == [[1, 2]] * 2 and not pool.shared  # nothing through the driver
            u = engine.weight_updates[-1]
            assert (u.epoch, u.failed, u.bytes) == (2, [], sum(t.numel() * t.element_size() for t in STATE.values()))
            await plane.close()


async def test_a_name_map_turns_trainer_names_into_checkpoint_names(cfg):
    pool = FakePool(2)
    trainer = {f"module.{n}": t for n, t in changed(3).items()} | {"module.rotary.inv_freq": torch.ones(2)}
    hook = lambda name: None if "rotary" in name else name.removeprefix("module.")  # noqa: E731
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            plane = await engine.weight_plane(name_map=hook)
            assert await plane.send(trainer) == 1
            assert all(torch.equal(pool.engines[0].plane.loaded[n], t) for n, t in changed(3).items())


@pytest.mark.parametrize(
    "weights, name_map, message",
    [
        ({**STATE, "embed.weight": torch.full((40, 30), float("nan"))}, None, "weights['embed.weight']: contains NaN or inf"),
        ({**STATE, "embed.weight": torch.empty(40, 30, device="meta")}, None, "on device meta, which holds no data"),
        ({**STATE, "extra": torch.ones(1)}, lambda n: "model.extra" if n == "extra" else n, "unknown model.extra (learner name extra)"),
        ({**STATE, "norm.weight": torch.ones(30)}, None, "norm.weight: dtype float32, model has bfloat16"),
        ({"a": STATE["steps"], "b": STATE["steps"]}, lambda n: "steps", "'a' and 'b' both map to 'steps'"),
    ],
    ids=["nan", "meta", "unknown-after-mapping", "dtype", "two-to-one"],
)
async def test_bad_weights_are_refused_before_any_engine_changes(cfg, weights, name_map, message):
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            plane = await engine.weight_plane(name_map=name_map)
            with pytest.raises(InvalidWeightsError) as e:
                await plane.send(weights)
            assert message in str(e.value)
            assert engine.epoch == 0 and all(not eng.staged and not eng.commits for eng in pool.engines)
            if name_map is None:
                assert await plane.send(changed(1)) == 1  # the plane goes on


async def test_a_sharded_learner_sends_what_each_rank_holds(cfg):
    """Two learner ranks in other threads (as in other processes): rank 0 hosts the store, each
    sends dim-0 rows of embed.weight and some whole tensors; the driver only runs the round."""
    pool = FakePool(2)
    full = changed(5)
    parts = [
        ({"embed.weight": full["embed.weight"][:15], "norm.weight": full["norm.weight"]}, {"embed.weight": (0, (40, 30))}),
        ({"embed.weight": full["embed.weight"][15:], "layers.0.weight": full["layers.0.weight"], "steps": full["steps"]}, {"embed.weight": (15, (40, 30))}),
    ]
    rank0 = PlaneSender(port=0, rank=0, ranks=2, bucket_bytes=700, timeout_s=10)
    rank1 = PlaneSender(port=rank0.port, rank=1, ranks=2, bucket_bytes=700, timeout_s=10)
    results: dict[int, object] = {}

    def run(rank: int, sender: PlaneSender) -> None:
        try:
            results[rank] = sender.send(*parts[rank])
        except Exception as e:
            results[rank] = e

    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            plane = await engine.weight_plane(port=rank0.port, ranks=2, local=False)
            threads = [threading.Thread(target=run, args=(r, s)) for r, s in enumerate((rank0, rank1))]
            for t in threads:
                t.start()
            assert await plane.update() == 1
            await anyio.to_thread.run_sync(lambda: [t.join() for t in threads])
    assert results == {0: 1, 1: 1}
    for e in pool.engines:
        assert all(torch.equal(e.plane.loaded[n], t) for n, t in full.items())
    rank1.close()
    rank0.close()


def test_the_sync_facade_joins_the_plane_too(cfg):
    from rollout.sync_engine import SyncRolloutEngine

    pool = FakePool(2)
    with SyncRolloutEngine(cfg, pool=pool) as engine:
        plane = engine.weight_plane(backend="shm")
        assert plane.send(changed(1)) == 1 and plane.send(changed(2)) == 2 and engine.epoch == 2
        assert all(torch.equal(pool.engines[1].plane.loaded[n], t) for n, t in changed(2).items())
        plane.close()
