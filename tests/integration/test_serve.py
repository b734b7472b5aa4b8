"""`rollout serve` on real engines, driven by the official `openai` client over loopback.

- Conversations of 4 turns whose token ids are carried in the assistant messages, with weight
  updates fired between and during turns: every served token's processed logprob is replayed by
  the oracle (the conversation as an episode: the KV carried from turn to turn), and each turn's
  prompt extends the one before token for token.
- An engine killed mid-request: the request still completes, on the other engine.
- 512 concurrent chat requests: every one answered exactly once, the driver's memory bounded.
- A seeded chat streamed and not: the same answer, the streamed one token by token; a client
  that leaves mid-stream aborts its engine request.
- A learner iterating `engine.groups()` with nothing fed collects the agents' rewarded episodes, one
  group each (a reward POST retried after its connection was reset too), and stops with serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import msgspec
import openai
import pytest
from safetensors.torch import load_file

from policies.oracle import Oracle, compare
from policies.processing import Processing
from rollout import RolloutEngine
from rollout.types import Trajectory
from tests.support.engines import held, integration_config
from tests.support.oracle_runs import commit_when, kill, random_weights, ungate

SAMPLING = {"temperature": 0.7, "top_p": 0.9}
EXTRA = {"top_k": 50, "min_tokens": 128}  # long turns: more to go than an update takes to land
TURNS = 4
PILOTS = 2  # conversations with short turns


@pytest.fixture(scope="module")
async def served(pools) -> AsyncIterator[tuple[RolloutEngine, Any]]:
    """One start of 2 engines and their server for the module's tests (an engine start is the slow
    part), in file order: the oracle test (which kills an engine: health checks every 0.5 s,
    restart after 0.5 s), then the 512 requests (128 in flight per engine), then seeds and stop
    strings, on weights that changed and engines that restarted."""
    cfg = integration_config(
        "engines.count=2",
        "engines.health_interval_s=0.5",
        "model.max_model_len=1024",
        "engines.restart_backoff_s=0.5",
        "engines.max_inflight_per_engine=128",
    )
    async for engine in held(lambda: pools.engine(cfg)):
        yield engine, await engine.serve(port=0)


@contextlib.asynccontextmanager
async def connected(server: Any) -> AsyncIterator[openai.AsyncOpenAI]:
    """A client of the test's own, closed before the server goes (an unclosed client's sockets,
    closed by the garbage collector, stay in the loop's selector map: a later socket given the same
    fd number is never polled)."""
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600) as client:
        yield client


def turn(message: dict) -> Trajectory:
    r = message["rollout"]
    return Trajectory(
        prompt_token_ids=message["prompt_token_ids"], token_ids=message["generation_token_ids"],
        logprobs=message["generation_log_probs"], policy_epochs=[tuple(x) for x in r["policy_epochs"]],
        kv_recomputes=[tuple(x) for x in r["kv_recomputes"]], kv_reused=r["kv_reused"], engine_id=r["engine_id"],
    )  # fmt: skip


async def test_served_turns_match_the_oracle_across_updates_and_a_killed_engine(served):
    engine, server = served
    async with connected(server) as client:
        start = engine.epoch  # the shared engines' epoch: update k makes start + k
        base = load_file(f"{engine.model_path}/model.safetensors")
        weights = {start: base}
        landed, piloted, pilot_turns = (
            [asyncio.Event() for _ in range(TURNS)],
            [asyncio.Event() for _ in range(TURNS)],
            [0] * TURNS,
        )

        async def conversation(c: int) -> list[dict]:
            pilot = (
                c < PILOTS
            )  # short turns: once all of turn k's are served, update k commits (the long turns mid-way)
            messages, out = [{"role": "user", "content": f"conversation {c}: " + "z" * (3 * c)}], []
            for k in range(TURNS):
                if k >= 2:
                    await landed[
                        k - 1
                    ].wait()  # update k-1 lands between turns k-1 and k (turns 0 and 1 share the first epoch)
                kwargs = {
                    "max_tokens": 8 if pilot else 160,
                    "extra_body": {**EXTRA, "min_tokens": 8} if pilot else EXTRA,
                    **SAMPLING,
                }
                if c % 2:  # as agents that always stream: the text in deltas, the token fields in the last
                    chunks = [chunk async for chunk in await client.chat.completions.create(
                        model=server.model, messages=messages, stream=True, **kwargs)]  # fmt: skip
                    assert chunks[-1].choices[0].finish_reason
                    m = {**chunks[-1].choices[0].delta.model_dump(), "role": "assistant",
                         "content": "".join(x.choices[0].delta.content or "" for x in chunks)}  # fmt: skip
                else:
                    m = (
                        (await client.chat.completions.create(model=server.model, messages=messages, **kwargs))
                        .choices[0]
                        .message.model_dump()
                    )
                out.append(m)
                messages = [*messages, m, {"role": "user", "content": f"next {k}"}]
                if pilot:
                    pilot_turns[k] += 1
                    if pilot_turns[k] == PILOTS:
                        piloted[k].set()
            return out

        async def updates() -> None:  # never against a clock: each commit waits for the pilots' turn
            for k in range(1, TURNS):
                weights[start + k] = random_weights(base, seed=900 + k)
                await engine.update_weights(weights[start + k])
                landed[k].set()
                if k == 2:
                    loads = engine._scheduler.runner.loads
                    victim = max(
                        range(len(loads)), key=lambda i: (loads[i].healthy, loads[i].requests)
                    )  # one mid-request
                    await kill(engine._scheduler.runner.engines[victim], "actor")
                    while loads[victim].healthy:  # out of rotation before the next update stages
                        await asyncio.sleep(0.05)

        commit_when(engine, lambda epoch: asyncio.wait_for(piloted[epoch - start].wait(), 300))
        updater = asyncio.ensure_future(updates())
        conversations = await asyncio.gather(*(conversation(c) for c in range(16)))
        await updater
        ungate(engine)
        oracle = Oracle(engine.model_path, weights)
    processing = Processing(temperature=0.7, top_p=0.9, top_k=50, min_tokens=128, stop_ids=(2,))
    episodes = []
    for conv in conversations:
        turns = [turn(m) for m in conv]
        for a, b in zip(turns, turns[1:]):
            before = a.prompt_token_ids + a.token_ids
            assert b.prompt_token_ids[: len(before)] == before, "a turn's prompt extends the one before"
        episodes.append(
            Trajectory(request_id=f"c{len(episodes)}", prompt_token_ids=turns[0].prompt_token_ids, turns=turns)
        )
    served = [t for e in episodes for t in e.turns]
    assert {epoch for t in served for _, epoch in t.policy_epochs} == set(weights), (
        "updates must land while turns are served"
    )
    assert any(len(t.policy_epochs) > 1 for t in served), "an update inside a turn"
    assert any(t.kv_reused for t in served), "turns reuse the KV of the turns before"
    report = await asyncio.to_thread(compare, oracle, episodes, 1e-3, 20, processing)
    assert report.ok and report.tokens == sum(len(t.token_ids) for t in served), msgspec.json.encode(report).decode()[
        :2000
    ]


async def test_512_concurrent_requests_are_each_answered_once_in_bounded_memory(served):
    _, server = served
    async with connected(server) as client:
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        results = await asyncio.gather(*(
            client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": f"request {i}"}],
                                           max_tokens=8, extra_body={"session_id": f"s{i}", "min_tokens": 8})
            for i in range(512)
        ))  # fmt: skip
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert len(results) == 512 and all(
            len(r.choices[0].message.model_extra["generation_token_ids"]) == 8 for r in results
        )
        prompts = [r.choices[0].message.model_extra["prompt_token_ids"] for r in results]
        assert len({tuple(p) for p in prompts}) == 512, "every request answered once, with its own prompt"
        assert server.inflight == 0
        assert (rss_after - rss_before) * 1024 < 512 * 2**20, (
            f"driver grew {rss_after - rss_before} KiB (pid {os.getpid()})"
        )


STOPS = [
    *"eao",
    *"bcdfghijklmnpqrstuvwxyz0123456789",
]  # single characters: a 64-token turn of the random model hits one


async def test_seed_repeats_the_tokens_and_stop_strings_leave_the_text_as_vllms_server(served):
    """Same seed, same request, same weights: the same tokens (each HTTP request had a random prompt
    id, and the per-request vLLM seed is derived from it). A turn ended by a stop string returns
    the text before it, as vLLM's server does; the token ids keep the token that completed it."""
    _, server = served
    async with connected(server) as client:
        chat = {
            "model": server.model,
            "messages": [{"role": "user", "content": "seeded"}],
            "max_tokens": 24,
            "temperature": 1.0,
        }
        a, b = [(await client.chat.completions.create(**chat, seed=7)).choices[0].message.model_extra for _ in range(2)]
        assert a["generation_token_ids"] == b["generation_token_ids"]
        unseeded = [
            (await client.chat.completions.create(**chat)).choices[0].message.model_extra["generation_token_ids"]
            for _ in range(2)
        ]
        assert unseeded[0] != unseeded[1], "temperature 1 without a seed: two samples"
        text = {"model": server.model, "prompt": "seeded", "max_tokens": 24, "temperature": 1.0, "seed": 11}
        c, d = [
            (await client.completions.create(**text)).choices[0].model_extra["generation_token_ids"] for _ in range(2)
        ]
        assert c == d

        tokenizer = server.chat
        stopped = 0
        for seed in range(8):
            r = await client.chat.completions.create(**{**chat, "max_tokens": 64}, stop=STOPS, seed=seed)
            choice, ids = r.choices[0], r.choices[0].message.model_extra["generation_token_ids"]
            if choice.finish_reason != "stop" or ids[-1] == 2:  # ended by length or EOS: nothing to cut
                continue
            stopped += 1
            full = tokenizer.decode(ids)
            assert not any(s in choice.message.content for s in STOPS), choice.message.content
            assert full.startswith(choice.message.content) and full[len(choice.message.content)] in STOPS
            streamed = [
                x
                async for x in await client.chat.completions.create(
                    **{**chat, "max_tokens": 64}, stop=STOPS, seed=seed, stream=True
                )
            ]
            assert "".join(x.choices[0].delta.content or "" for x in streamed if x.choices) == choice.message.content
            t = await client.completions.create(
                model=server.model,
                prompt=[
                    int(i)
                    for i in r.model_extra.get("prompt_token_ids") or choice.message.model_extra["prompt_token_ids"]
                ],
                max_tokens=64,
                temperature=1.0,
                stop=STOPS,
                seed=seed,
            )
            assert t.choices[0].text == choice.message.content and t.choices[0].finish_reason == "stop"
        assert stopped, "no turn ended by a stop string"


async def test_a_seeded_request_streamed_is_the_same_answer_token_by_token_and_a_client_gone_aborts_it(served):
    """The same seeded chat, streamed and not: the same text, token ids, logprobs and epochs, the
    streamed one arriving in many chunks (the first before the last token is generated: it holds
    fewer than all of them). A client that leaves mid-stream aborts its request in the engine."""
    engine, server = served
    async with connected(server) as client:
        chat = {"model": server.model, "messages": [{"role": "user", "content": "stream me"}], "max_tokens": 48,
                "temperature": 1.0, "seed": 5, "logprobs": True,
                "extra_body": {"min_tokens": 48, "return_token_ids": True}}  # fmt: skip
        whole = (await client.chat.completions.create(**chat)).choices[0]
        chunks = [c async for c in await client.chat.completions.create(**chat, stream=True)]
        deltas = [c.choices[0] for c in chunks if c.choices]
        fields, ids = deltas[-1].delta.model_extra, whole.message.model_extra["generation_token_ids"]
        for key in ("generation_token_ids", "generation_log_probs", "policy_epoch", "rollout"):
            assert fields[key] == whole.message.model_extra[key], key
        assert "".join(d.delta.content or "" for d in deltas) == whole.message.content
        per_chunk = [d.model_extra.get("token_ids") or [] for d in deltas]
        assert [t for p in per_chunk for t in p] == ids and len(ids) == 48
        assert 0 < len(next(p for p in per_chunk if p)) < len(ids), per_chunk
        assert [lp.logprob for d in deltas for lp in (d.logprobs.content if d.logprobs else [])] == fields[
            "generation_log_probs"
        ]

    before = await engine.stats()
    long = {"model": server.model, "messages": [{"role": "user", "content": "leave me"}], "max_tokens": 900,
            "min_tokens": 900, "stream": True, "return_token_ids": True}  # fmt: skip
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as http:
        async with http.stream("POST", "/v1/chat/completions", json=long) as r:
            async for line in r.aiter_lines():
                if '"token_ids"' in line:
                    break  # generating: leave
    with anyio.fail_after(120):  # the engine request ends long before its 900 tokens
        while sum(s.running for s in await engine.stats()):
            await anyio.sleep(0.1)
    after = await engine.stats()
    assert sum(a.requests_finished - b.requests_finished for a, b in zip(after, before)) == 0


async def test_a_learner_iterates_rewarded_episodes_until_serving_stops(served):
    """Last in the file: it stops the module's server."""
    engine, server = served
    agents = 4  # and one more whose first reward POST's connection is reset
    send, taken = anyio.create_memory_object_stream[str](2 * agents)

    async def learner() -> None:  # nothing fed: the stream is the served episodes
        async with send:
            async for group in engine.groups():
                await send.send(group.prompt_id)

    async def episode(client: openai.AsyncOpenAI, name: str) -> None:
        messages = [{"role": "user", "content": name}]
        for k in range(2):
            r = await client.chat.completions.create(
                model=server.model, messages=messages, max_tokens=4, extra_body={"episode_id": name}
            )
            messages = [*messages, r.choices[0].message.model_dump(), {"role": "user", "content": f"turn {k}"}]

    async def dropped(name: str) -> None:  # the POST sent, its connection reset before any answer
        url = httpx.URL(server.url)
        body = b'{"reward": 1}'
        head = f"POST /v1/episodes/{name}/reward HTTP/1.1\r\nHost: {url.host}\r\nContent-Length: {len(body)}"
        async with await anyio.connect_tcp(url.host, url.port) as conn:
            await conn.send(f"{head}\r\nContent-Type: application/json\r\n\r\n".encode() + body)
            raw = conn.extra(anyio.abc.SocketAttribute.raw_socket)
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: RST

    names = [f"agent-{i}" for i in range(agents)]
    async with (
        connected(server) as client,
        httpx.AsyncClient(base_url=server.url, timeout=600) as http,
        anyio.create_task_group() as tg,
        taken,
    ):
        tg.start_soon(learner)
        answers = {}
        for name in [*names, "dropped"]:
            await episode(client, name)
        for name in names:
            answers[name] = await http.post(f"/v1/episodes/{name}/reward", json={"reward": 1})
        await dropped("dropped")
        retried = [await http.post("/v1/episodes/dropped/reward", json={"reward": 1}) for _ in range(2)]
        assert all(r.status_code == 200 for r in [*answers.values(), *retried]), [r.text for r in retried]
        assert retried[0].json() == retried[1].json() and retried[0].json()["turns"] == 2
        with anyio.fail_after(300):
            got = sorted([await taken.receive() for _ in range(agents + 1)])
        assert got == sorted([*names, "dropped"])
        await engine.stop_serving()
        assert [name async for name in taken] == []  # nothing more: the dropped one was delivered once
