"""The logprob oracle: exact replays of epoch schedules, sensitivity of `compare`, errors, CLI."""

from __future__ import annotations

import math
import random
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from policies.oracle import Oracle, compare, main
from policies.processing import Processing
from rollout.epochs import expand_runs
from rollout.tiny import TinySpec, build_tiny
from rollout.types import Trajectory

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


def test_processed_logprobs_follow_vllms_order_of_operations() -> None:
    """Hand-computed: min_tokens mask, then temperature, then top-k, then top-p, then log_softmax."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]])
    token = torch.tensor([1])
    raw = Processing(logprobs="raw", temperature=0.5, top_k=2, min_tokens=5, stop_ids=(5,))
    assert raw.logprobs_of(logits, token, 0)[0].item() == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())

    # min_tokens: id 5 (the largest) masked at index 0, not at index 5
    p = Processing(temperature=1.0, min_tokens=5, stop_ids=(5,))
    masked = logits[0].clone()
    masked[5] = -math.inf
    assert p.logprobs_of(logits, token, 0)[0].item() == pytest.approx(torch.log_softmax(masked, -1)[1].item())
    assert p.logprobs_of(logits, token, 5)[0].item() == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())

    # temperature then top-k: keep the 2 largest of logits / 0.5 -> ids 5 and 0; token 0
    tk = Processing(temperature=0.5, top_k=2)
    expected = torch.log_softmax(torch.tensor([2.0, 3.0]) / 0.5, -1)[0].item()
    assert tk.logprobs_of(logits, torch.tensor([0]), 0)[0].item() == pytest.approx(expected)
    assert tk.logprobs_of(logits, token, 0)[0].item() == -math.inf  # id 1 cut by top-k

    # top-p 0.8 at temperature 1: probabilities sorted ascending, drop while cumulative <= 0.2
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort()
    cum = probs[order].cumsum(0)
    keep = torch.ones(6, dtype=torch.bool)
    keep[order[cum <= 0.2]] = False
    expected = torch.log_softmax(logits[0].masked_fill(~keep, -math.inf), -1)[0].item()
    got, alts = Processing(top_p=0.8).logprobs_of(logits, torch.tensor([0]), 0)
    assert got.item() == pytest.approx(expected) and alts == [[]]
    # greedy (temperature 0) reports log_softmax(logits): the temperature-1 distribution
    assert Processing(temperature=0.0).logprobs_of(logits, token, 0)[0].item() == pytest.approx(
        torch.log_softmax(logits[0], -1)[1].item()
    )


def test_a_top_p_cut_on_a_token_accepts_either_side() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))  # ascending cumulative: 0.1, 0.3, 0.6, 1.0
    got, alts = Processing(top_p=0.7).logprobs_of(logits, torch.tensor([3]), 0)  # the cut (0.3) sits on id 1
    assert sorted({round(x, 5) for x in [got.item(), *alts[0]]}) == pytest.approx(
        sorted([math.log(0.4 / 0.9), math.log(0.4 / 0.7)]), abs=1e-5
    )


def test_a_top_k_cut_between_near_equal_logits_accepts_either_side() -> None:
    # ids 1 and 2 differ by 1e-6: vLLM (keeping logits >= the k-th) may keep both where the oracle
    # keeps one; a CI run saw two such tokens off by 0.0095 in 25661
    logits = torch.tensor([[0.0, 1.0, 1.0 + 1e-6, 3.0]])
    got, alts = Processing(top_k=2).logprobs_of(logits, torch.tensor([3]), 0)
    both = math.log(math.exp(3) / (math.exp(3) + 2 * math.exp(1)))
    assert any(both == pytest.approx(a, abs=1e-5) for a in alts[0]) and abs(got.item() - both) > 1e-2
    _, clear = Processing(top_k=2).logprobs_of(torch.tensor([[0.0, 1.0, 1.5, 3.0]]), torch.tensor([3]), 0)
    assert clear == [[]]


def test_a_top_k_tie_the_engine_broke_accepts_exactly_k_and_the_top_p_cut_that_follows() -> None:
    # A CI run: the oracle saw the 50th and 51st logits equal and kept both; the engine, its
    # float error breaking the tie, kept 50, and without that token's mass its top-p cut dropped
    # one more token: 0.0095 off. Here top_k=3: ids 1 and 2 tie at the 3rd; top_p=0.8.
    logits = torch.log(torch.tensor([[0.02, 0.1, 0.1, 0.13, 0.65]]))
    token = torch.tensor([4])

    def kept(ids: list[int]) -> float:
        x = torch.full((5,), -math.inf)
        x[ids] = logits[0, ids]
        return torch.log_softmax(x, -1)[4].item()

    got, alts = Processing(top_k=3, top_p=0.8).logprobs_of(logits, token, 0)
    # oracle: ids 1-4 kept (ascending cumulative 0.102, 0.204 > 0.2: id 1 dropped by top-p) -> ids 2, 3, 4
    assert got.item() == pytest.approx(kept([2, 3, 4]), abs=1e-6)
    # engine: exactly 3 kept (ids 2, 3, 4 or 1, 3, 4), then top-p drops the lowest (cumulative 0.113 <= 0.2) -> ids 3, 4
    assert any(a == pytest.approx(kept([3, 4]), abs=1e-6) for a in alts[0]), alts
    _, clear = Processing(top_k=3, top_p=0.8).logprobs_of(
        torch.log(torch.tensor([[0.02, 0.08, 0.12, 0.13, 0.65]])), token, 0
    )
    assert clear == [[]]


def test_the_sampled_token_tied_with_its_neighbour_across_a_top_p_cut_accepts_either_order() -> None:
    # A CI run (test_weights drain, every run the same token): the sampled token and another one
    # 1e-5 apart in logit sit either side of the top-p cut, 0.09 and 0.102 in ascending cumulative
    # probability, far from the cut itself. The engine's float error ordered them the other way:
    # it kept the sampled token and dropped its twin, the oracle dropped the sampled one (-inf).
    probs = torch.tensor([[0.25, 0.03, 0.06, 0.06 + 1e-7, 0.6 - 1e-7]])
    logits, token = torch.log(probs), torch.tensor([2])  # id 2 sorts just below its twin, id 3

    def kept(ids: list[int]) -> float:
        x = torch.full((5,), -math.inf)
        x[ids] = logits[0, ids]
        return torch.log_softmax(x, -1)[2].item()

    got, alts = Processing(top_p=0.9).logprobs_of(logits, token, 0)  # ascending cumulative: 0.03, 0.09, 0.15, ...
    assert got.item() == -math.inf  # the oracle's order: ids 1 and 2 dropped (<= 0.1)
    assert any(a == pytest.approx(kept([0, 2, 4]), abs=1e-5) for a in alts[0]), alts  # the engine's: 1 and 3 dropped
    _, clear = Processing(top_p=0.9).logprobs_of(torch.log(torch.tensor([[0.25, 0.03, 0.05, 0.07, 0.6]])), token, 0)
    assert clear == [[]]


def test_under_speculation_the_tokens_just_past_min_tokens_accept_the_stop_mask() -> None:
    """vLLM masks a speculative step's bonus token by the count at the step's start: with K draft
    tokens, tokens min_tokens..min_tokens+K may have been sampled with the stop ids masked."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]] * 8)
    tokens = torch.tensor([1] * 8)
    masked = logits[0].clone()
    masked[5] = -math.inf
    free, stopped = torch.log_softmax(logits[0], -1)[1].item(), torch.log_softmax(masked, -1)[1].item()
    got, alts = Processing(min_tokens=3, stop_ids=(5,), spec_tokens=2).logprobs_of(logits, tokens, 0)
    assert got.tolist() == pytest.approx([stopped] * 3 + [free] * 5)
    assert [i for i, a in enumerate(alts) if a] == [3, 4, 5]  # min_tokens .. +K
    assert alts[3:6] == [pytest.approx([stopped])] * 3
    _, alts = Processing(min_tokens=3, stop_ids=(5,)).logprobs_of(logits, tokens, 0)
    assert not any(alts)  # no speculation: no boundary slack


def test_compare_replays_processed_logprobs_and_fails_with_the_other_setting(oracle: Oracle) -> None:
    tokens, runs = random_tokens(16, seed=21), [(0, 0), (8, 1)]
    processed = Processing(temperature=0.7, top_k=50, top_p=0.9)
    logprobs = oracle.replay(PROMPT, tokens, runs, processing=Processing(temperature=0.7, top_k=50, top_p=0.9))
    # the sampled tokens here are arbitrary: some fall outside top-k/top-p; keep the ones that did not
    keep = [i for i, x in enumerate(logprobs) if math.isfinite(x)]
    t = Trajectory("p", prompt_token_ids=PROMPT, token_ids=tokens, logprobs=logprobs, policy_epochs=runs)
    assert keep and compare(oracle, [t], processing=processed).mismatched == len(tokens) - len(keep)
    assert compare(oracle, [t], processing=Processing(logprobs="raw")).mismatched == len(tokens)


def test_an_episode_replays_with_the_kv_of_earlier_turns_kept_where_reused(
    oracle: Oracle, model_dir: Path, weights
) -> None:
    """Turn 2 reuses 9 positions of turn 1's KV (epochs 0 then 1), computes the rest with epoch 2;
    a naive replay that keeps exactly those KV entries agrees, and claiming no reuse does not."""
    models = {e: hf_model(model_dir, weights[e]) for e in EPOCHS}
    gen1, obs, gen2 = random_tokens(6, seed=31), [50, 51, 52], random_tokens(5, seed=32)
    p1 = PROMPT
    p2 = [*p1, *gen1, *obs]
    runs1, runs2 = [(0, 0), (3, 1)], [(0, 2), (2, 3)]
    t1 = Trajectory("t", prompt_token_ids=p1, token_ids=gen1, policy_epochs=runs1)
    t1.logprobs = oracle.replay(p1, gen1, runs1)
    # naive: one step at a time, the cache kept through turn 1, cut to 9 positions, the rest at epoch 2
    ids, e2 = [*p2, *gen2], expand_runs(runs2, 5)
    cache = DynamicCache()
    with torch.no_grad():
        for i in range(len(gen1) - 1):  # turn 1's steps that computed KV entries (prompt, then g0..g4)
            step = p1 if i == 0 else [gen1[i - 1]]
            models[expand_runs(runs1, 6)[i]](input_ids=torch.tensor([step]), past_key_values=cache, use_cache=True)
        models[expand_runs(runs1, 6)[5]](input_ids=torch.tensor([[gen1[4]]]), past_key_values=cache, use_cache=True)
        cache.crop(9 - cache.get_seq_length())
        expected, pos = [], 9
        for i, token in enumerate(gen2):
            step = ids[pos : len(p2) + i]
            logits = models[e2[i]](input_ids=torch.tensor([step]), past_key_values=cache, use_cache=True).logits
            expected.append(torch.log_softmax(logits[0, -1], dim=-1)[token].item())
            pos = len(p2) + i
    t2 = Trajectory("t", prompt_token_ids=p2, token_ids=gen2, policy_epochs=runs2, kv_reused=9, logprobs=expected)
    (lp1, _), (lp2, _) = oracle.replay_episode([t1, t2])
    assert lp1 == pytest.approx(t1.logprobs, abs=1e-5) and lp2 == pytest.approx(expected, abs=1e-5)
    episode = Trajectory("e", prompt_token_ids=p1, token_ids=[*gen1, *obs, *gen2], turns=[t1, t2])
    assert compare(oracle, [episode]).ok and compare(oracle, [episode]).tokens == 11
    fresh = msgspec.structs.replace(episode, turns=[t1, msgspec.structs.replace(t2, kv_reused=0)])
    assert not compare(oracle, [fresh]).ok
    more = msgspec.structs.replace(episode, turns=[t1, msgspec.structs.replace(t2, kv_reused=10)])
    assert not compare(oracle, [more]).ok
