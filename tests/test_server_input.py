"""Hostile input on the OpenAI-compatible server, over fake engines: a huge body does
not stall the loop, a bad API key is refused at start, the engine's own checks name the field,
a reward answered 429 keeps its episode, a port in use is an OSError, stop strings leave the text,
`n` gives several choices, 429 says when to retry. Real engines (seed, stop strings as vLLM
matches them): tests/integration/test_serve.py."""

from __future__ import annotations

import socket
import threading

import anyio
import pytest

from rollout.errors import InvalidConfigError
from rollout.serve import openai_api as api
from rollout.types import Trajectory
from tests.support.serving import served

BIG = 7 * 2**20  # under serve.max_body_bytes (8 MiB)


async def test_a_huge_body_is_read_off_the_loop_while_small_requests_go_on():
    """The big request's rendering waits (in its own thread) for the small request's answer: with
    the rendering on the event loop the small request cannot even start, and the wait times out."""
    async with served() as s:
        answered, rendering = threading.Event(), threading.Event()
        seen: list[bool] = []
        text = s.server.chat._text

        def slow_text(messages, tools, add_generation_prompt):
            if len(messages[0]["content"]) > 2**20:
                rendering.set()
                seen.append(answered.wait(10))  # True only if the small request was answered meanwhile
            return text(messages, tools, add_generation_prompt)

        s.server.chat._text = slow_text
        async with anyio.create_task_group() as tg:
            big: list = []

            async def send_big() -> None:
                big.append(
                    await s.http.post(
                        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * BIG}]}
                    )
                )

            tg.start_soon(send_big)
            await anyio.to_thread.run_sync(rendering.wait, 10)
            small = await s.client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            answered.set()
        assert small.choices[0].message.content is not None
        assert seen == [True], "the small request waited for the big one's rendering: it ran on the event loop"
        assert big[0].status_code == 400 and "maximum context length" in big[0].json()["error"]["message"]


async def test_a_body_far_over_the_context_is_refused_before_tokenizing():
    async with served() as s:
        calls: list[int] = []
        tokenizer = s.server.chat.tokenizer
        encode = tokenizer.encode
        tokenizer.encode = lambda text, **kw: calls.append(len(text)) or encode(text, **kw)
        r = await s.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 2**20}]})
        assert (
            r.status_code == 400
            and "maximum context length" in r.json()["error"]["message"]
            and r.json()["error"]["param"] == "messages"
        )
        assert calls == [], "a body that cannot fit the context was tokenized"


@pytest.mark.parametrize("key", ["clé€", "tab\there", ""])
async def test_an_api_key_http_cannot_carry_is_refused_at_start(key):
    async with served() as s:
        with pytest.raises(InvalidConfigError, match="serve.api_key"):
            await s.engine.serve(port=0, api_key=key)
        assert (await s.client.models.list()).data  # the first server serves on


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_k": 2**40}, "top_k"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [10**6]},
            "stop_token_ids",
        ),
        ("/v1/completions", {"prompt": [10**6], "max_tokens": 2}, "prompt"),
        (
            "/inference/v1/generate",
            {"token_ids": [5], "sampling_params": {"temperature": 5.0}},
            "sampling_params.temperature",
        ),
    ],
)
async def test_the_engines_own_checks_name_the_field(path, body, param):
    async with served() as s:
        r = await s.http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


async def test_a_reward_answered_429_keeps_its_episode_for_the_retry():
    async with served("queue.max_groups=1") as s:
        for episode in ("a", "b"):
            await s.client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": episode}],
                max_tokens=2,
                extra_body={"episode_id": episode},
            )
        assert (await s.http.post("/v1/episodes/a/reward", json={"reward": 1})).status_code == 200
        full = await s.http.post("/v1/episodes/b/reward", json={"reward": 0.5})
        assert (
            full.status_code == 429
            and full.json()["error"]["type"] == "rate_limit_error"
            and int(full.headers["retry-after"]) >= 1
        )
        assert (await s.engine.next_group()).prompt_id == "a"  # the learner takes one: room again
        retry = await s.http.post("/v1/episodes/b/reward", json={"reward": 0.5})
        assert retry.status_code == 200, retry.text
        assert retry.json()["turns"] == 1 and (await s.engine.next_group()).prompt_id == "b"


async def test_serving_on_a_port_in_use_raises_oserror_and_the_engine_serves_on():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        async with served() as s:
            with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
                await s.engine.serve(port=port)
            r = await s.client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
            assert r.choices[0].message.content is not None
            assert (await s.engine.submit({"token_ids": [5, 6], "sampling": {"n": 1}}, train=False).result())[
                0
            ].trajectories


def test_the_stop_string_is_cut_from_the_text_and_kept_in_the_token_ids():
    """vLLM's rule: the text ends before the stop string its last token completed (and anything
    after it in that token); the ids keep every token. A stop id's text is left out too."""
    from rollout.episodes.chat import ChatRenderer
    from rollout.tiny import resolve_model_path

    chat = ChatRenderer(resolve_model_path("tiny"))
    ids = chat.encode("xyzabcde")
    traj = Trajectory(prompt_token_ids=[5], token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop")
    stops = [
        "de",
        "e",
        "b",
    ]  # "de" and "e" end with the last token (the first listed wins); "b" is not in its reach (min_tokens)
    body = api.completion_response(api.Call([5], {"stop": stops}, stop=stops), [traj], "tiny", chat)
    assert body["choices"][0]["text"] == "xyzabc"
    assert body["choices"][0]["generation_token_ids"] == ids
    assert api.visible_text(chat, ids, "length", ["e"], []) == "xyzabcde"  # ended by length: nothing cut
    assert api.visible_text(chat, ids, "stop", ["q"], [ids[-1]]) == "xyzabcd"  # by a stop id: its text left out
    message = api.chat_response(api.Call([5], {}, stop=["e"]), [traj], "tiny", chat, "none")["choices"][0]["message"]
    assert message["content"] == "xyzabcd" and message["generation_token_ids"] == ids


async def test_n_gives_n_choices_on_completions_and_generate():
    async with served() as s:
        c = await s.client.completions.create(model="tiny", prompt="abc", max_tokens=3, n=3)
        assert [ch.index for ch in c.choices] == [0, 1, 2] and c.usage.completion_tokens == 9
        assert (
            len({tuple(ch.model_extra["generation_token_ids"]) for ch in c.choices}) == 3
        )  # the fake's samples differ by index
        g = (
            await s.http.post(
                "/inference/v1/generate", json={"token_ids": [5, 6], "sampling_params": {"max_tokens": 2, "n": 2}}
            )
        ).json()
        assert [ch["index"] for ch in g["choices"]] == [0, 1] and all(len(ch["token_ids"]) == 2 for ch in g["choices"])
        streamed = [
            x
            async for x in await s.client.completions.create(model="tiny", prompt="abc", max_tokens=2, n=2, stream=True)
        ]
        assert sorted({ch.index for x in streamed for ch in x.choices}) == [0, 1]
        for bad in ({"prompt": "abc", "n": 0}, {"prompt": "abc", "n": "2"}, {"prompt": "abc", "n": 10**6}):
            r = await s.http.post("/v1/completions", json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        chat = await s.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 2})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "n"


def test_rollout_serve_refuses_such_a_key_before_any_engine_starts(capsys):
    from rollout.cli import main

    assert main(["serve", "configs/tiny.yaml", "--api-key", "clé€"]) == 2
    assert "serve.api_key (--api-key): character 2" in capsys.readouterr().err


@pytest.mark.parametrize(
    "body, says, param",
    [
        (b'{"messages": "\\ud800"}', "messages: is not valid UTF-8: lone surrogate '\\ud800'", "messages"),
        (b'{"messages": [{"role": "user", "content": "ok \\udfff"}]}', "messages[0].content: is not valid UTF-8",
         "messages"),
        (b'{"messages": "\\ud800x"}', "messages: is not valid UTF-8: lone surrogate", "messages"),
        (b'{"messages": [], "a": "\xff"}', "not valid UTF-8: byte 23: invalid start byte", None),
        (b'{"messages": [', "truncated", None),
        (b'{"messages": [] "n": 1}', "malformed JSON", None),
    ],
    ids=["lone-surrogate", "nested-surrogate", "surrogate-then-text", "raw-invalid-utf8", "truncated", "no-comma"],
)  # fmt: skip
async def test_a_malformed_body_is_answered_400_saying_what_is_malformed(body, says, param):
    """msgspec answers a lone surrogate escape before a closing quote with "Input data was
    truncated", and places a byte that is not UTF-8 inside its string: the 400 says what it is
    and where, in the body."""
    async with served() as s:
        r = await s.http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == 400 and says in err["message"] and err["param"] == param, r.text
        if says != "truncated":
            assert "truncated" not in err["message"], err
