"""The OpenAI-compatible server's HTTP half (`rollout.serve.server`) over fake engines, driven by the
real `openai` client and httpx: fields on every message, vLLM's conventions, streaming, every error
case, auth and overload. Sessions, episodes and disconnects (the backend's): tests/test_serve_backend.py.
Real engines: tests/integration/test_serve.py."""

from __future__ import annotations

import json

import anyio
import openai
import pytest

from rollout.errors import EngineDeadError
from tests.support.fakes import FakePool
from tests.support.serving import TIMEOUT, served


async def test_a_chat_completion_carries_tokens_logprobs_and_epochs():
    async with served() as s:
        r = await s.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        m = r.choices[0].message
        extra = m.model_extra
        assert r.object == "chat.completion" and r.model == "tiny" and r.choices[0].finish_reason in ("stop", "length")
        assert (
            len(extra["generation_token_ids"]) == len(extra["generation_log_probs"]) == r.usage.completion_tokens == 4
        )
        assert extra["prompt_token_ids"] == s.server.chat.render([{"role": "user", "content": "hi"}])
        assert (
            extra["policy_epoch"] == [[[0, 0]]]
            and extra["kv_cache_epoch"] == [[[0, 0]]]
            and extra["num_evictions"] == [0]
        )
        assert extra["rollout"]["policy_epochs"] == [[0, 0]] and extra["rollout"]["engine_id"] in (0, 1)
        assert isinstance(m.content, str) and r.usage.prompt_tokens == len(extra["prompt_token_ids"])


async def test_vllm_conventions_token_ids_as_tokens_and_return_token_ids():
    async with served() as s:
        r = await s.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3, logprobs=True,
            extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
        )  # fmt: skip
        choice = r.choices[0]
        ids = choice.message.model_extra["generation_token_ids"]
        assert [c.token for c in choice.logprobs.content] == [f"token_id:{t}" for t in ids]
        assert [c.logprob for c in choice.logprobs.content] == choice.message.model_extra["generation_log_probs"]
        assert all(c.top_logprobs == [] for c in choice.logprobs.content)
        assert (
            choice.model_extra["token_ids"] == ids
            and r.model_extra["prompt_token_ids"] == choice.message.model_extra["prompt_token_ids"]
        )

        tok = (
            await s.http.post("/tokenize", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
        ).json()
        assert tok["tokens"] == r.model_extra["prompt_token_ids"] and tok["count"] == len(tok["tokens"])
        gen = (
            await s.http.post(
                "/inference/v1/generate",
                json={
                    "model": "tiny",
                    "token_ids": [5, 6, 7],
                    "sampling_params": {"max_tokens": 4, "temperature": 0.5},
                },
            )
        ).json()
        assert gen["prompt_token_ids"] == [5, 6, 7] and len(gen["choices"][0]["token_ids"]) == 4
        assert [c["token"] for c in gen["choices"][0]["logprobs"]["content"]] == [
            f"token_id:{t}" for t in gen["choices"][0]["token_ids"]
        ]
        c = await s.client.completions.create(model="tiny", prompt="abc", max_tokens=2)
        assert c.choices[0].model_extra["generation_token_ids"] and c.usage.completion_tokens == 2
        models = await s.client.models.list()
        assert models.data[0].id == "tiny" and models.data[0].model_extra["max_model_len"] == 256
        assert (await s.http.get("/health")).json() == {"status": "ok"}
        metrics = (await s.http.get("/metrics")).text
        assert 'rollout_http_requests_total{path="/v1/chat/completions",status="200"} 1.0' in metrics
        assert "rollout_http_generated_tokens_total" in metrics and "rollout_epoch" in metrics


async def test_stream_true_sends_tokens_as_the_engine_generates_them_then_the_learner_fields_whole():
    """Agent code that always streams gets vLLM's chunks: the role, content as the engine generates
    it (the first token before the engine has finished: the fake holds the request after it),
    each chunk's logprobs and token ids, then the finish reason with the learner's fields
    whole, the usage, [DONE]; the same answer as the request not streamed."""
    async with served() as s:
        messages = [{"role": "user", "content": "hi"}]
        kwargs = {"model": "tiny", "messages": messages, "max_tokens": 4, "logprobs": True,
                  "extra_body": {"return_token_ids": True}}  # fmt: skip
        whole = (await s.client.chat.completions.create(**kwargs)).choices[0]
        gates = [e.block() for e in s.pool.engines]
        stream = await s.client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        chunks = []
        async for c in stream:
            chunks.append(c)
            if c.choices and c.choices[0].model_extra.get("token_ids"):
                break  # the first token, while the engine holds the rest
        assert sum(e.finished for e in s.pool.engines) == 1  # the non-streamed one only
        for gate in gates:
            gate.set()
        chunks += [c async for c in stream]
        assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
        deltas = [c.choices[0] for c in chunks if c.choices]
        assert deltas[0].delta.role == "assistant" and deltas[0].delta.content == ""
        assert chunks[0].model_extra["prompt_token_ids"] == s.server.chat.render(messages)
        assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [whole.finish_reason]
        assert len(deltas) >= 4  # the role, the first token, then the rest: more than one chunk of text
        extra = deltas[-1].delta.model_extra
        for key in ("generation_token_ids", "generation_log_probs", "policy_epoch", "kv_cache_epoch", "rollout"):
            assert extra[key] == whole.message.model_extra[key], key
        ids = extra["generation_token_ids"]
        assert (
            [t for d in deltas for t in d.model_extra.get("token_ids") or []] == ids == whole.model_extra["token_ids"]
        )
        assert [lp.logprob for d in deltas for lp in (d.logprobs.content if d.logprobs else [])] == extra[
            "generation_log_probs"
        ]
        assert "".join(d.delta.content or "" for d in deltas) == whole.message.content == s.server.chat.decode(ids)
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
        raw = await s.http.post(
            "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2, "stream": True}
        )
        assert raw.headers["content-type"].startswith("text/event-stream") and raw.text.endswith("data: [DONE]\n\n")

        texts = [
            c async for c in await s.client.completions.create(model="tiny", prompt="abc", max_tokens=3, stream=True)
        ]
        assert {c.object for c in texts} == {"text_completion"} and texts[-1].choices[0].finish_reason in (
            "stop",
            "length",
        )
        assert len(texts[-1].choices[0].model_extra["generation_token_ids"]) == 3
        assert "".join(c.choices[0].text for c in texts if c.choices) == s.server.chat.decode(
            texts[-1].choices[0].model_extra["generation_token_ids"]
        )
        for body, says in (
            ({"stream": "yes"}, "stream: expected true or false"),
            ({"stream": True, "stream_options": []}, "stream_options: expected an object"),
            ({"stream_options": {"include_usage": True}}, "stream_options: only with stream: true"),
            ({"stream": True, "stream_options": {"include_usage": 1}}, "include_usage: expected true or false"),
        ):
            bad = await s.http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, **body})
            assert bad.status_code == 400 and says in bad.json()["error"]["message"], bad.text


@pytest.mark.parametrize(
    "body, status, needle",
    [
        (b"{not json", 400, "malformed JSON"),
        (
            json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}).encode(),
            404,
            "model 'gpt-9' does not exist",
        ),
        (json.dumps({"model": "tiny"}).encode(), 400, "messages: required"),
        (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), 400, "messages[0].role"),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(),
            400,
            "temperature: expected a number",
        ),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": -1}).encode(), 400, "temperature"),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10000}).encode(),
            400,
            "maximum context length",
        ),
        (json.dumps({"messages": [{"role": "user", "content": "x" * 400}]}).encode(), 400, "maximum context length"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 3}).encode(), 400, "n: only n=1"),
        (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "not valid UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "nested deeper than"),
        (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nested deeper than"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "tools": ' + b"[" * 200 + b"]" * 200 + b"}",
            400,
            "nested deeper than",
        ),
    ],
)
async def test_errors_are_openai_shaped_and_name_the_field(body, status, needle):
    async with served() as s:
        r = await s.http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        assert needle in r.json()["error"]["message"] and set(r.json()["error"]) >= {"message", "type", "param", "code"}
        ok = await s.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
        assert ok.choices[0].message.content is not None  # the server serves on


async def test_api_key_body_limit_and_overload():
    async with served("serve.max_body_bytes=2000", "serve.max_concurrency=1", api_key="sekret") as s:
        assert (await s.http.get("/v1/models")).status_code == 401
        async with openai.AsyncOpenAI(base_url=f"{s.server.url}/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
        auth = {"authorization": "Bearer sekret"}
        big = {"messages": [{"role": "user", "content": "x" * 5000}]}
        assert (await s.http.post("/v1/chat/completions", json=big, headers=auth)).status_code == 413
        gate = [e.block() for e in s.pool.engines]
        async with anyio.create_task_group() as tg:
            first = s.http.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}]}, headers=auth
            )
            tg.start_soon(lambda: first)
            while s.server.inflight < 1:
                await anyio.sleep(0.01)
            r = await s.http.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "b"}]}, headers=auth
            )
            assert (
                r.status_code == 429
                and "max_concurrency" in r.json()["error"]["message"]
                and r.headers["retry-after"] == "1"
            )
            for g in gate:
                g.set()


async def test_every_engine_gone_is_503_on_every_route_and_every_request_after_it():
    """The first request to find every engine dead, and every one after it, on every route and
    through the SDK: a 503 at once, never a wait for an engine that cannot come back."""
    pool = FakePool(1)
    chat = {"messages": [{"role": "user", "content": "x"}]}
    async with served("engines.count=1", "engines.max_restarts=0", pool=pool) as s:
        pool.engines[0].dead = True
        for path, body in [
            ("/v1/chat/completions", chat),
            ("/v1/chat/completions", chat),
            ("/v1/completions", {"prompt": "x"}),
            ("/inference/v1/generate", {"token_ids": [1, 2]}),
        ]:
            with anyio.fail_after(TIMEOUT):
                r = await s.http.post(path, json=body)
            assert r.status_code == 503 and "every engine is dead" in r.json()["error"]["message"], (path, r.text)
        with anyio.fail_after(TIMEOUT), pytest.raises(openai.InternalServerError) as e:
            await s.client.chat.completions.create(model=s.server.model, **chat)
        assert e.value.status_code == 503
        with anyio.fail_after(TIMEOUT), pytest.raises(EngineDeadError, match="every engine is dead"):
            await s.engine.submit(["x"], train=False).result()


async def test_with_no_engine_in_rotation_and_one_restarting_a_request_is_503_at_once_with_retry_after():
    """An agent framework or load balancer retries (the SDK honours Retry-After) instead of holding
    a connection for an engine start; once the engine is back, requests are served again."""
    pool = FakePool(1)
    pool.restart_gate = anyio.Event()
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    async with served("engines.count=1", "engines.max_restarts=1", "engines.restart_backoff_s=0", pool=pool) as s:
        pool.engines[0].dead = True
        waiting = s.engine.submit(["x"], train=False)  # finds the engine dead; waits for its restart
        with anyio.fail_after(TIMEOUT):
            while s.engine.healthy or not s.engine.restarting:
                await anyio.sleep(0.01)
            for path, body in [("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "x", "max_tokens": 2})]:
                r = await s.http.post(path, json=body)
                assert r.status_code == 503 and r.headers["retry-after"] == "10", r.text
                assert "one is starting again" in r.json()["error"]["message"]
        pool.restart_gate.set()
        with anyio.fail_after(TIMEOUT):
            assert (await waiting.result())[0].ok
            assert (await s.http.post("/v1/chat/completions", json=chat)).status_code == 200


async def test_a_streaming_client_that_takes_no_chunk_is_cut_off_and_its_request_aborted(monkeypatch):
    """Backpressure: a client whose socket takes nothing (here a `send` that never returns) holds
    no growing buffer, and past `STALL_S` its stream ends and its run is aborted (`on_close`),
    whether it stalled on the first chunk or a later one."""
    from rollout.serve import server as server_module

    monkeypatch.setattr(server_module, "STALL_S", 0.05)

    async def body():
        while True:
            yield b"data: {}\n\n"

    for stall_at in (0, 3):  # the response's start, or a chunk after some were taken
        closed, sent = anyio.Event(), []

        async def send(message):
            if len(sent) >= stall_at:
                await anyio.sleep_forever()
            sent.append(message)

        async def receive():
            await anyio.sleep_forever()

        with anyio.fail_after(30):
            events = server_module.Events(body(), closed.set, media_type="text/event-stream")
            await events({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
            await closed.wait()
        assert len(sent) == stall_at
