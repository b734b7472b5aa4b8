"""Speculative decoding's settings against the installed vLLM: the methods it knows, the options it
takes (`policies.speculative`, `policies.vllm_args`), and the CPU repair's expansion of per-request
values to draft rows (`policies.vllm_adapter.worker`). Imports vLLM; starts nothing (the oracle on
real engines with speculation: tests/integration/test_spec_decode.py)."""

from __future__ import annotations

import pytest

from rollout.config import load_config
from rollout.errors import InvalidConfigError
from rollout.speculative import SPECULATIVE_METHODS

pytest.importorskip("vllm")

K = 3
SPEC = [
    "speculative.method=ngram",
    f"speculative.num_speculative_tokens={K}",
    "speculative.prompt_lookup_min=2",
    "speculative.prompt_lookup_max=4",
]


def test_methods_match_the_installed_vllm():
    from typing import get_args

    from vllm.config.speculative import SpeculativeMethod

    def flat(t):
        return set().union(*(flat(a) if get_args(a) else {a} for a in get_args(t)))

    assert SPECULATIVE_METHODS == flat(SpeculativeMethod)


def test_engine_args_check_options_against_vllm():
    from policies.vllm_args import engine_args

    args = engine_args(load_config(None, SPEC), "/m")
    assert args.speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": K,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    with pytest.raises(InvalidConfigError, match=r"^speculative\.options\.no_such_field: not a field"):
        engine_args(load_config(None, [*SPEC, "speculative.options={no_such_field: 1}"]), "/m")
    with pytest.raises(InvalidConfigError, match=r"^speculative\.options\.target_model_config"):
        engine_args(load_config(None, [*SPEC, "speculative.options={target_model_config: 1}"]), "/m")


def test_cpu_expand_fix_matches_vllm_semantics():
    import torch

    from policies.vllm_adapter.worker import expand_batch_to_tokens

    # request i's value over its rows (ends at cu[i]); a request with no rows takes none; 0 -> 1
    got = expand_batch_to_tokens(
        torch.tensor([0.5, 0.0, 0.8, 2.0]), torch.tensor([2, 3, 3, 5], dtype=torch.int32), 5, 0, 1
    )
    assert got.tolist() == pytest.approx([0.5, 0.5, 1.0, 2.0, 2.0])
    assert expand_batch_to_tokens(torch.tensor([7, 0]), torch.tensor([1, 3]), 3).tolist() == [7, 0, 0]
