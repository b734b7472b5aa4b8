"""The vLLM adapter fails closed: a vLLM whose internals changed is refused at engine start, naming
what changed, instead of an engine that starts and records wrong epochs. The checks run against the
installed vLLM, with one internal changed at a time (the real engines pass them at every start:
tests/integration)."""

from __future__ import annotations

import asyncio
import types

import pytest

from policies.vllm_adapter import UNTESTED_ENV, VllmChangedError, check_vllm
from policies.vllm_adapter.frontend import Finished, VllmFrontend

pytest.importorskip("vllm")


def test_the_installed_vllm_passes():
    import vllm

    assert check_vllm() == vllm.__version__


def test_an_untested_version_is_refused_unless_asked_for(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.delenv(UNTESTED_ENV, raising=False)
    with pytest.raises(VllmChangedError, match=f"vLLM 0.99.0.*{UNTESTED_ENV}=1"):
        check_vllm()
    monkeypatch.setenv(UNTESTED_ENV, "1")
    assert check_vllm() == "0.99.0"  # the shape checks still ran, and passed


def test_a_scheduler_hook_with_another_signature_is_named(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "_preempt_request", lambda self, request: None)
    with pytest.raises(
        VllmChangedError, match=r"Scheduler\._preempt_request is not \(request, timestamp, drop_stale_output\)"
    ):
        check_vllm()


def test_a_scheduler_that_preempts_another_way_is_refused(monkeypatch):
    """If vLLM preempted without `_preempt_request`, preemptions would go unrecorded: the KV epochs
    of a recomputed request would be wrong without a word."""
    from vllm.v1.core.sched.scheduler import Scheduler

    def schedule(self):
        return None

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    with pytest.raises(VllmChangedError, match=r"Scheduler\.schedule no longer preempts through _preempt_request"):
        check_vllm()


def test_a_missing_engine_output_field_is_refused(monkeypatch):
    from vllm.v1 import engine

    monkeypatch.setattr(engine, "FinishReason", types.SimpleNamespace(STOP=0, LENGTH=1))  # no ABORT
    with pytest.raises(VllmChangedError, match="FinishReason.ABORT"):
        check_vllm()


def request_state(**missing: bool):
    """What vLLM's output processor holds for a running request, less the fields named."""
    fields = {
        "is_prefilling": False,
        "detokenizer": types.SimpleNamespace(output_token_ids=[5, 6]),
        "logprobs_processor": types.SimpleNamespace(logprobs=None),
        "weight_version_starts": [(0, 0)],
        "num_cached_tokens": 0,
    }
    return types.SimpleNamespace(**{k: v for k, v in fields.items() if k not in missing})


def frontend(state, spans=((0, 0),)) -> VllmFrontend:
    f = VllmFrontend(llm=None)

    async def run(piece_id, token_ids, cache_salt, params):
        return Finished([5, 6], [-0.1, -0.2], "length", False, list(spans))

    f.run = run  # type: ignore[method-assign]
    f.state = lambda piece_id: state  # type: ignore[method-assign]
    f.so_far = lambda s: ([5, 6], [], list(spans), 0)  # type: ignore[method-assign]
    return f


async def test_the_probe_passes_a_request_state_with_every_field():
    await frontend(request_state())._probe()


@pytest.mark.parametrize("field", ["is_prefilling", "detokenizer", "weight_version_starts", "num_cached_tokens"])
async def test_the_probe_names_a_request_state_field_that_is_gone(field):
    with pytest.raises(VllmChangedError, match=f"request state has no {field}"):
        await frontend(request_state(**{field: True}))._probe()


async def test_the_probe_refuses_a_vllm_that_reports_no_weight_versions():
    """Without weight versions every token would be labelled with no epoch (once, epoch 0)."""
    with pytest.raises(VllmChangedError, match="did not report weight versions"):
        await frontend(request_state(), spans=())._probe()


async def test_the_probe_refuses_a_vllm_that_keeps_no_state_for_a_running_request():
    with pytest.raises(VllmChangedError, match="no request_states entry"):
        await frontend(None)._probe()


async def test_a_request_runs_at_the_priority_of_its_remaining_budget():
    """VLLM (`scheduling_policy: priority`, lower runs earlier) starts the longest remaining
    budget first, so a long-tailed set's long samples do not start last and run alone at the end."""
    from policies.vllm_args import sampling_params
    from rollout.types import Sampling

    sent: list[tuple[str, int]] = []

    class Llm:
        async def generate(self, prompt, params, request_id, priority=0):
            sent.append((request_id, priority))
            completion = types.SimpleNamespace(
                token_ids=[5],
                logprobs=types.SimpleNamespace(logprobs=[-0.1], start_indices=[0]),
                weight_versions=[],
                finish_reason="length",
                stop_reason=None,
            )
            yield types.SimpleNamespace(outputs=[completion], num_cached_tokens=0)

    f = VllmFrontend(llm=Llm())
    await f.run("long", [1, 2], "salt", sampling_params(Sampling(max_tokens=512), None))
    continuation = sampling_params(Sampling(max_tokens=512), None, done=500)  # 12 left
    await f.run("rest", [1, 2], "salt", continuation)
    assert sent == [("long", -512), ("rest", -12)]


async def test_the_engine_keeps_vllms_stat_logging_off(monkeypatch):
    """`engine_args` says `disable_log_stats`, but AsyncLLM built from a VllmConfig does not read it
    there (`from_vllm_config` takes it as an argument, default False): vLLM's per-step iteration
    stats and Prometheus logger then cost every engine's front end ~10-15% of its CPU."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from policies.vllm_args import engine_args
    from rollout.config import load_config

    class Built(Exception):
        pass

    seen: dict = {}

    def from_vllm_config(config, **kwargs):
        seen.update(kwargs)
        raise Built

    args = engine_args(load_config(None), "/m")
    config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(scheduler_cls=None, async_scheduling=False))
    monkeypatch.setattr(args, "create_engine_config", lambda usage: config)
    monkeypatch.setattr(AsyncLLM, "from_vllm_config", from_vllm_config)
    with pytest.raises(Built):
        await VllmFrontend.start(args, None, lambda: None)
    assert args.disable_log_stats and seen.get("disable_log_stats") is True


class StuckCore:
    """vLLM's AsyncLLM whose engine core answers a utility call only when the test lets it."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()
        self.asked = asyncio.Event()
        self.calls = 0

    async def is_paused(self) -> bool:
        self.calls += 1
        self.asked.set()
        await self.answer.wait()
        return False

    async def init_weight_transfer_engine(self, request) -> None:
        await self.answer.wait()


async def test_an_engine_core_that_answers_nothing_is_silent_for_as_long_and_a_weight_call_is_not_counted():
    now = [100.0]
    llm = StuckCore()
    f = VllmFrontend(llm=llm, clock=lambda: now[0])
    watch = asyncio.ensure_future(f.watch_core(0.0))
    try:
        await llm.asked.wait()
        assert f.core_silent_s() == 0.0
        now[0] += 45.0
        assert f.core_silent_s() == 45.0  # stuck: the round trip is still unanswered
        init = asyncio.ensure_future(f.init_transfer({}))
        await asyncio.sleep(0)
        now[0] += 100.0
        assert f.core_silent_s() == 0.0  # a weight call runs in the core: its caller bounds it
        llm.answer.set()
        await init
        assert f.core_silent_s() == 0.0  # the core answers again
        while llm.calls < 3:  # and the watch goes on asking
            await asyncio.sleep(0)
    finally:
        watch.cancel()


async def test_a_progress_report_names_an_engine_core_that_answers_nothing():
    from policies.vllm_policy import VLLMPolicy
    from rollout.config import Config
    from rollout.errors import EngineDeadError

    cfg = Config()
    policy = VLLMPolicy(cfg, "unused", frontend=types.SimpleNamespace(dead=False, core_silent_s=lambda: 1.0))
    policy.progress()  # silent for less than engines.health_timeout_s: a report
    bound = cfg.engines.health_timeout_s
    policy._vllm = types.SimpleNamespace(dead=False, core_silent_s=lambda: bound + 1)
    with pytest.raises(EngineDeadError, match="engine core has answered nothing.*stuck inside a step or a call"):
        policy.progress()
