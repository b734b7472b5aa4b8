"""The logprob oracle: exact replays of epoch schedules, sensitivity of `compare`, errors, CLI."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from policies.oracle import Oracle, compare, main
from policies.tiny import TinySpec, build_tiny
from rollout.types import Trajectory, expand_runs

EPOCHS = (0, 1, 2, 3)
PROMPT = [1, 40, 41, 42, 43, 44, 45]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny(TinySpec())


@pytest.fixture(scope="module")
def weights(model_dir: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Distinct random weights per epoch (norms stay 1, as in the tiny model)."""
    names = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).state_dict()
    out = {}
    for epoch in EPOCHS:
        gen = torch.Generator().manual_seed(100 + epoch)
        out[epoch] = {
            name: torch.ones_like(t) if name.endswith("norm.weight") else torch.randn(t.shape, generator=gen) * 0.08
            for name, t in sorted(names.items())
        }
    return out


@pytest.fixture(scope="module")
def oracle(model_dir: Path, weights: dict[int, dict[str, torch.Tensor]]) -> Oracle:
    return Oracle(model_dir, weights)


def hf_model(model_dir: Path, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), attn_implementation="eager")
    model.load_state_dict(state)
    return model.float().eval()


def naive_replay(models, prompt, tokens, runs, recomputes) -> list[float]:
    """One step per generated token, swapping weights and dropping the cache as the engine did."""
    epochs, recomputed, ids, p = expand_runs(runs, len(tokens)), dict(recomputes), [*prompt, *tokens], len(prompt)
    out, cache = [], None
    with torch.no_grad():
        for i, token in enumerate(tokens):
            if i == 0 or i in recomputed:
                cache, step = DynamicCache(), ids[: p + i]
            else:
                step = ids[p + i - 1 : p + i]
            logits = models[epochs[i]](input_ids=torch.tensor([step]), past_key_values=cache, use_cache=True).logits
            out.append(torch.log_softmax(logits[0, -1], dim=-1)[token].item())
    return out


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 260) for _ in range(n)]


def test_single_epoch_equals_one_full_forward(oracle: Oracle, model_dir: Path, weights) -> None:
    model = hf_model(model_dir, weights[0])
    gen = torch.Generator().manual_seed(7)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(20):  # sample from the model itself
            probs = torch.softmax(model(input_ids=ids).logits[0, -1], dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)[None]], dim=1)
        full = torch.log_softmax(model(input_ids=ids).logits[0], dim=-1)
    tokens = ids[0, len(PROMPT) :].tolist()
    expected = [full[len(PROMPT) + i - 1, t].item() for i, t in enumerate(tokens)]
    assert oracle.replay(PROMPT, tokens, [(0, 0)]) == pytest.approx(expected, abs=1e-5)


def test_schedule_with_recomputes_matches_naive_steps(oracle: Oracle, model_dir: Path, weights) -> None:
    models = {e: hf_model(model_dir, weights[e]) for e in EPOCHS}
    rng = random.Random(3)
    for trial in range(3):
        tokens = random_tokens(30, seed=trial)
        starts = sorted(rng.sample(range(1, 30), 3))
        runs = [(0, 0), *((s, e) for s, e in zip(starts, rng.sample([1, 2, 3], 3)))]
        epochs = expand_runs(runs, 30)
        recomputes = [(j, epochs[j]) for j in sorted(rng.sample(range(1, 30), 2))]
        expected = naive_replay(models, PROMPT, tokens, runs, recomputes)
        got = oracle.replay(PROMPT, tokens, runs, recomputes)
        assert got == pytest.approx(expected, abs=1e-5), (runs, recomputes)


def test_compare_detects_a_shifted_boundary_and_a_dropped_recompute(oracle: Oracle) -> None:
    tokens, runs = random_tokens(24, seed=11), [(0, 0), (6, 1), (12, 2), (18, 3)]
    truth = oracle.replay(PROMPT, tokens, runs, [(15, 2)])
    exact = oracle.replay(PROMPT, tokens, runs)

    def traj(request_id: str, policy_epochs, logprobs) -> Trajectory:
        return Trajectory(
            request_id, prompt_token_ids=PROMPT, token_ids=tokens, logprobs=logprobs, policy_epochs=policy_epochs
        )

    ok = compare(oracle, [traj("ok", runs, exact)])
    assert ok.ok and ok.tokens == 24 and ok.mismatched == 0 and ok.max_abs_err < 1e-5

    shifted = compare(oracle, [traj("shifted", [(0, 0), (7, 1), (12, 2), (18, 3)], exact)])
    assert not shifted.ok and shifted.max_abs_err > 1e-3
    assert shifted.failures[0].first_index == 6  # later tokens differ too: position P+5 has epoch-0 KV now
    assert shifted.worst_request_id == "shifted" and shifted.worst_index >= 6

    recorded = msgspec.structs.replace(traj("recorded", runs, truth), kv_recomputes=[(15, 2)])
    assert compare(oracle, [recorded]).ok

    dropped = compare(oracle, [traj("dropped", runs, truth)])  # the engine recomputed at 15; the record lost it
    assert not dropped.ok and dropped.max_abs_err > 1e-3 and dropped.failures[0].first_index == 15
    assert dropped.worst_request_id == "dropped" and dropped.failed_trajectories == 1


def test_unknown_epoch_and_bad_tokens_are_named(oracle: Oracle) -> None:
    with pytest.raises(KeyError, match="epoch 9"):
        oracle.replay(PROMPT, [5, 6], [(0, 0), (1, 9)])
    with pytest.raises(ValueError, match="out of vocab"):
        oracle.replay(PROMPT, [5, 260], [(0, 0)])
    with pytest.raises(ValueError, match="out of vocab"):
        oracle.replay([-1, *PROMPT], [5], [(0, 0)])
    with pytest.raises(ValueError, match="recompute"):
        oracle.replay(PROMPT, [5, 6, 7], [(0, 0), (2, 1)], [(1, 1)])


def test_cli_reads_weight_dirs_and_exits_by_verdict(oracle: Oracle, model_dir: Path, weights, tmp_path: Path) -> None:
    args = ["--model", str(model_dir)]
    for epoch in (0, 1):
        (tmp_path / f"e{epoch}").mkdir()
        save_file(weights[epoch], tmp_path / f"e{epoch}" / "model.safetensors")
        args += ["--weights", f"{epoch}={tmp_path / f'e{epoch}'}"]
    tokens, runs = random_tokens(10, seed=5), [(0, 0), (4, 1)]
    logprobs = oracle.replay(PROMPT, tokens, runs)
    good = Trajectory("g", prompt_token_ids=PROMPT, token_ids=tokens, logprobs=logprobs, policy_epochs=runs)
    bad = msgspec.structs.replace(good, request_id="b", policy_epochs=[(0, 0), (5, 1)])
    for name, trajs, code in (("good", [good], 0), ("bad", [good, bad], 1)):
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(b"".join(msgspec.json.encode(t) + b"\n" for t in trajs))
        assert main([*args, str(path)]) == code
