"""Weights on their way to the engines, without engines (`rollout.tensors`): the model's manifest,
the checks on incoming weights (names, dtypes, shapes, finite values) and their wire form. Their
orchestration over the engines (`rollout.weights.updates`): tests/test_weight_updates.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from rollout.epochs import kv_runs
from rollout.errors import InvalidWeightsError
from rollout.tensors import Packed, TensorSpec, pack, read_manifest, save_dir, unpack
from rollout.types import Trajectory
from rollout.weights.update_checks import pack_on_loop
from tests.support.model import STATE


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
    from rollout.tensors import finite_bits

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
    from rollout.tensors import finite_bits

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


@pytest.mark.parametrize("damage", ["truncated", "zeroed", "empty", "header cut"])
def test_a_damaged_file_in_a_weights_directory_is_invalid_weights_naming_it(model_dir, tmp_path, damage):
    """A file cut short (a copy interrupted) or zeroed (a disk or sync failure) fails as weights
    that do not fit, naming the file, not with safetensors' own message about a header."""
    d = save_dir(STATE, tmp_path / "damaged")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) - 10], "zeroed": bytes(len(data)), "empty": b"",
                   "header cut": data[:20]}[damage])  # fmt: skip
    with pytest.raises(InvalidWeightsError, match="model.safetensors") as e:
        pack(d, read_manifest(model_dir))
    assert str(d) in str(e.value)
    with pytest.raises(InvalidWeightsError, match="model.safetensors"):
        read_manifest(d)
