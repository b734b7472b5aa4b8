"""Exporters to Megatron-Core's and NeMo Gym's epoch fields, checked on hand-worked examples.

Megatron's dynamic engine (what a Megatron-RL consumer expects): a request starts both lists at
`(0, epoch at admission)`; at each weight update it appends `(P + G - 1, new epoch)` to both, P the
prompt length and G the tokens generated so far (the input position of the first step under the
new weights); an eviction drops the KV and re-stamps `kv_cache_epoch` to `[(0, epoch)]` when the
request is scheduled again, and counts in `num_evictions`. Expanded over the sequence, position x
of `policy_epoch` is the epoch of the step whose input is x, the one that sampled token x + 1.

Every example: P = 4 prompt tokens (positions 0..3), generated g_i at position 4 + i.
"""

from __future__ import annotations

import pytest

from rollout.epochs import kv_runs
from rollout.learner.export import expand_megatron_runs, policy_epochs_from_megatron, to_megatron, to_nemo_gym
from rollout.types import Trajectory

P = 4


def traj(epochs: list[tuple[int, int]], length: int, recomputes: list[tuple[int, int]] = ()) -> Trajectory:
    recomputes = list(recomputes)
    return Trajectory(
        prompt_token_ids=[9, 8, 7, 6],
        token_ids=list(range(20, 20 + length)),
        logprobs=[-1.0] * length,
        policy_epochs=epochs,
        kv_epochs=kv_runs(P, length, epochs, recomputes),
        kv_recomputes=recomputes,
        num_preemptions=len(recomputes),
    )


SEVERAL, M_SEVERAL = [(0, 2), (2, 3), (5, 4)], [(0, 2), (5, 3), (8, 4)]

# (ours, Megatron's): policy_epoch, kv_cache_epoch, num_evictions, worked out by hand
EXAMPLES = {
    # g0..g2 at epoch 3, an update, g3..g5 at 4: G = 3 at the update, boundary 4 + 3 - 1 = 6
    "keep, one update": (traj([(0, 3), (3, 4)], 6), [(0, 3), (6, 4)], [(0, 3), (6, 4)], 0),
    # the update recomputed positions 0..6 with epoch 4 before g3 (Megatron: an eviction, the
    # KV re-stamped when scheduled again; policy_epoch keeps its history)
    "recompute": (traj([(0, 3), (3, 4)], 6, [(3, 4)]), [(0, 3), (6, 4)], [(0, 4)], 1),
    # g0..g1 at 2, g2..g4 at 3, g5..g7 at 4: boundaries at 4 + 2 - 1 = 5 and 4 + 5 - 1 = 8
    "several updates": (traj(SEVERAL, 8), M_SEVERAL, M_SEVERAL, 0),
    # as above, the second update recomputing
    "several, the last recomputes": (traj(SEVERAL, 8, [(5, 4)]), M_SEVERAL, [(0, 4)], 1),
    # the KV dropped and recomputed before g4 without an update (a move to another engine), then
    # an update before g5: re-stamped at 3, then the update's boundary
    "a recompute, then an update": (traj(SEVERAL, 8, [(4, 3)]), M_SEVERAL, [(0, 3), (8, 4)], 1),
    # an update right after g0: the step whose input is g0 (position 4) runs the new weights
    "an update after the first token": (traj([(0, 3), (1, 4)], 3), [(0, 3), (4, 4)], [(0, 3), (4, 4)], 0),
    # an update before the first token: the request reruns from scratch at the new epoch (README,
    # "Per-token epochs"), which is Megatron's admission at that epoch, not a boundary at P - 1
    "an update before the first token": (traj([(0, 4)], 3), [(0, 4)], [(0, 4)], 0),
    # drain: no update while the request runs, no boundary
    "drain": (traj([(0, 3)], 5), [(0, 3)], [(0, 3)], 0),
}


@pytest.mark.parametrize("name", EXAMPLES)
def test_megatron_export_is_megatrons_convention(name):
    t, policy, kv, evictions = EXAMPLES[name]
    assert to_megatron(t) == {"policy_epoch": policy, "kv_cache_epoch": kv, "num_evictions": evictions}


@pytest.mark.parametrize("name", EXAMPLES)
def test_both_expansions_give_every_sampled_token_the_same_epoch(name):
    t, *_ = EXAMPLES[name]
    m, n = to_megatron(t), len(t.token_ids)
    per_position = expand_megatron_runs(m["policy_epoch"], P + n)
    assert len(per_position) == P + n
    # g_i is sampled by the step whose input is position P + i - 1
    assert [per_position[P + i - 1] for i in range(n)] == t.token_epochs()
    assert policy_epochs_from_megatron(m["policy_epoch"], P, n) == t.policy_epochs


def test_the_worked_example_both_ways():
    """README's example: policy_epochs [(0, 3), (3, 4)] <-> Megatron's [(0, 3), (6, 4)]."""
    t, *_ = EXAMPLES["keep, one update"]
    assert expand_megatron_runs([(0, 3), (6, 4)], P + 6) == [3, 3, 3, 3, 3, 3, 4, 4, 4, 4]
    assert t.token_epochs() == [3, 3, 3, 4, 4, 4]
    assert policy_epochs_from_megatron([(0, 3), (6, 4)], P, 6) == [(0, 3), (3, 4)]


def test_our_fields_are_left_as_they_are():
    t, *_ = EXAMPLES["recompute"]
    before = (list(t.policy_epochs), list(t.kv_epochs), list(t.kv_recomputes), t.num_preemptions)
    to_megatron(t), to_nemo_gym(t)
    assert (t.policy_epochs, t.kv_epochs, t.kv_recomputes, t.num_preemptions) == before
    assert before == ([(0, 3), (3, 4)], [(0, 4)], [(3, 4)], 1)


def test_kv_cache_epoch_is_worked_out_when_a_trajectory_lacks_kv_epochs():
    t, _, kv, _ = EXAMPLES["a recompute, then an update"]
    t.kv_epochs = []
    assert to_megatron(t)["kv_cache_epoch"] == kv


def test_a_trajectory_without_tokens_has_no_epochs():
    t = Trajectory(prompt_token_ids=[9, 8], finish_reason="error", error="boom")
    assert to_megatron(t) == {"policy_epoch": [], "kv_cache_epoch": [], "num_evictions": 0}


def test_megatron_runs_may_repeat_a_start_the_later_wins():
    """Two updates with no step between append two boundaries at the same position."""
    assert expand_megatron_runs([(0, 3), (5, 4), (5, 5)], 7) == [3, 3, 3, 3, 3, 5, 5]
    assert expand_megatron_runs([], 0) == []
    with pytest.raises(ValueError, match="start at position 0"):
        expand_megatron_runs([(2, 3)], 4)
    with pytest.raises(ValueError, match="never decrease"):
        expand_megatron_runs([(0, 3), (5, 4), (4, 5)], 7)


def test_nemo_gym_has_one_inner_list_per_turn():
    """NeMo Gym's Megatron backend reads, per output item (one per turn): prompt_token_ids,
    generation_token_ids, generation_log_probs, policy_epoch / kv_cache_epoch as lists of
    [start_token_index, epoch] pairs over that turn's prompt + generation, num_evictions an int;
    it collects them into one inner list per turn and num_evictions as a list of ints."""
    keep, recompute = EXAMPLES["keep, one update"][0], EXAMPLES["recompute"][0]
    gym = to_nemo_gym([keep, recompute])
    assert gym == {
        "prompt_token_ids": [[9, 8, 7, 6], [9, 8, 7, 6]],
        "generation_token_ids": [list(range(20, 26))] * 2,
        "generation_log_probs": [[-1.0] * 6] * 2,
        "policy_epoch": [[[0, 3], [6, 4]], [[0, 3], [6, 4]]],
        "kv_cache_epoch": [[[0, 3], [6, 4]], [[0, 4]]],
        "num_evictions": [0, 1],
    }
    single = to_nemo_gym(keep)
    assert single["num_evictions"] == [0] and single["policy_epoch"] == [[[0, 3], [6, 4]]]
    pairs = [pair for turn in gym["policy_epoch"] + gym["kv_cache_epoch"] for pair in turn]
    assert all(type(pair) is list and len(pair) == 2 and all(type(x) is int for x in pair) for pair in pairs)


def test_an_episode_exports_one_inner_list_per_turn():
    t0 = Trajectory(
        prompt_token_ids=[1, 2, 3], token_ids=[4, 5], logprobs=[-1.0, -1.0], policy_epochs=[(0, 1)], kv_epochs=[(0, 1)]
    )
    t1 = Trajectory(prompt_token_ids=[1, 2, 3, 4, 5, 9], token_ids=[6, 7, 8], logprobs=[-1.0] * 3,
                    policy_epochs=[(0, 1), (2, 2)], kv_epochs=[(0, 1), (7, 2)], kv_reused=3)  # fmt: skip
    ep = Trajectory(prompt_token_ids=[1, 2, 3], token_ids=[4, 5, 9, 6, 7, 8], turns=[t0, t1])
    m = to_megatron(ep)
    assert m["policy_epoch"] == [[(0, 1)], [(0, 1), (7, 2)]] and m["num_evictions"] == [0, 0]
    assert m["kv_cache_epoch"] == [[(0, 1)], [(0, 1), (7, 2)]]
    assert to_nemo_gym(ep)["generation_token_ids"] == [[4, 5], [6, 7, 8]]
