"""The config as vLLM engine arguments: defaults that depend on the device, and what rollout owns.

Imports vLLM's argument classes (a few seconds); starts nothing."""

from __future__ import annotations

import pytest

from rollout.config import load_config
from rollout.errors import InvalidConfigError

pytest.importorskip("vllm")

from policies.vllm_args import engine_args, engine_env  # noqa: E402


def test_the_kv_cache_default_depends_on_the_device():
    cpu = engine_args(load_config(None), "/m")
    assert cpu.kv_cache_memory_bytes == 2**30 and cpu.logprobs_mode == "processed_logprobs"
    gpu = engine_args(load_config(None, ["engines.gpus_per_engine=1"]), "/m")
    assert gpu.kv_cache_memory_bytes is None  # vLLM sizes it by gpu_memory_utilization
    shared = engine_args(load_config(None, ["engines.gpus_per_engine=0.5"]), "/m")
    assert shared.gpu_memory_utilization == 0.45 and shared.kv_cache_memory_bytes is None
    sized = engine_args(load_config(None, ["engines.gpus_per_engine=1", "engines.vllm={kv_cache_gib: 2}"]), "/m")
    assert sized.kv_cache_memory_bytes == 2 * 2**30
    assert engine_args(load_config("configs/gpu.yaml"), "/m").gpu_memory_utilization == 0.9


def test_priority_scheduling_is_asked_for_in_engines_vllm():
    """Requests always carry their remaining token budget as priority (`VllmFrontend.run`);
    vLLM uses it only with `scheduling_policy: priority`, which slowed prefill-heavy multi-turn runs."""
    assert engine_args(load_config(None), "/m").scheduling_policy == "fcfs"
    asked = load_config(None, ["engines.vllm={scheduling_policy: priority}"])
    assert engine_args(asked, "/m").scheduling_policy == "priority"


def test_raw_logprobs_and_what_rollout_owns():
    assert engine_args(load_config(None, ["sampling.logprobs=raw"]), "/m").logprobs_mode == "raw_logprobs"
    with pytest.raises(InvalidConfigError, match="engines.vllm.logprobs_mode: set by rollout from sampling.logprobs"):
        engine_args(load_config(None, ["engines.vllm={logprobs_mode: raw_logits}"]), "/m")


@pytest.mark.parametrize("bad", [".nan", ".inf", "true", "0", "-1", "1e12"])
def test_a_kv_cache_size_vllm_cannot_take_names_the_key(
    bad,
):  # found by tests/test_fuzz.py: nan/inf raised ValueError/OverflowError
    with pytest.raises(InvalidConfigError, match="engines.vllm.kv_cache_gib: expected a number > 0"):
        engine_args(load_config(None, [f"engines.vllm={{kv_cache_gib: {bad}}}"]), "/m")


def test_cpu_engines_skip_the_aot_compile_path_they_cannot_load_back(monkeypatch):
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    assert engine_env(0, 1, 0)["VLLM_USE_AOT_COMPILE"] == "0"
    assert "VLLM_USE_AOT_COMPILE" not in engine_env(0, 1, 1)  # GPU: vLLM's default
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert engine_env(0, 1, 0)["VLLM_USE_AOT_COMPILE"] == "1"  # the caller's setting wins
