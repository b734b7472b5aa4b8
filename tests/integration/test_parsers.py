"""vLLM's tool-call and reasoning parsers by name through `rollout serve`, driven by the real `openai`
client: hermes, llama3_json and qwen3_xml tool calls and qwen3 reasoning come back as vLLM's server
returns them (`message.tool_calls`, finish reason "tool_calls", `reasoning` / `reasoning_content`),
streamed too, a delta per engine step (`delta.tool_calls`, `delta.reasoning_content`).

How the model is made to write each parser's format: a test-only vLLM logits processor
(`tests/support/forced_output.py`, named in this module's engine config only) forces the text after
`FORCE:` in the user message, byte token by byte token, then the end-of-turn token. The engine
(one real CPU engine in a Ray actor, started once for the module), sampler, detokenizer, server,
parsers and client are the real ones. The tiny model's tokenizer here has `<|python_tag|>` added
(vLLM's llama3_json parser refuses a tokenizer without it).
"""

from __future__ import annotations

import json

import msgspec
import openai
import pytest

from rollout import RolloutEngine
from rollout.config import ServeConfig
from rollout.serve import Backend, Server
from rollout.serve.prepare import served_chat
from rollout.tiny import TinySpec, build_tiny
from tests.support.engines import held, integration_config
from tests.support.parser_cases import ARGS, CASES, TOOLS


@pytest.fixture(scope="module")
async def engine():
    model = build_tiny(TinySpec(vocab_size=261, extra_special=("<|python_tag|>",)))
    cfg = integration_config(
        f"model.path={model}",
        "engines.count=1",
        "model.max_model_len=2048",
        "engines.vllm={kv_cache_gib: 1, logits_processors: ['tests.support.forced_output:ForcedOutput']}",
    )
    async for e in held(lambda: RolloutEngine(cfg)):
        yield e


async def serve(engine: RolloutEngine, tool: str | None, reasoning: str | None) -> Server:
    """A server with these parsers on the module's engine (as `engine.serve()` starts one)."""
    cfg = msgspec.structs.replace(engine.cfg, serve=ServeConfig(tool_parser=tool or "none", reasoning_parser=reasoning))
    chat = served_chat(engine.model_path, cfg.model.max_model_len)
    server = Server(Backend(engine, chat.end_of_turn), cfg, chat)
    await server.start(engine._tg, port=0)
    engine._servers.append(server)
    return server


@pytest.mark.parametrize("tool,reasoning,text", CASES)
async def test_the_openai_client_gets_vllms_tool_calls_and_reasoning(engine, tool, reasoning, text):
    server = await serve(engine, tool, reasoning)
    thinks = text.split("<think>")[1].split("</think>")[0] if reasoning else None
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300) as client:
        request = {
            "model": server.model,
            "messages": [{"role": "user", "content": "FORCE:" + text}],
            "tools": TOOLS,
            "max_tokens": 200,
        }
        r = await client.chat.completions.create(**request)
        m, choice = r.choices[0].message, r.choices[0]
        assert (
            server.chat.decode(m.model_extra["generation_token_ids"]) == text
        )  # the forced text, then the end of the turn
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        assert calls == ([("add", ARGS)] if tool else []) and all(
            c.id and c.type == "function" for c in m.tool_calls or []
        )
        assert choice.finish_reason == ("tool_calls" if tool else "stop")
        assert m.model_extra["reasoning"] == m.model_extra["reasoning_content"] == thinks
        expected = server.parsers.parse(
            server.parsers.request({"tools": TOOLS}), text, m.model_extra["generation_token_ids"], []
        )
        assert m.content == expected["content"] and (m.content or "").find("<tool_call>") == -1

        chunks = [c async for c in await client.chat.completions.create(**request, stream=True)]
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        merged: dict[int, list[str]] = {}  # a call's deltas by index: its name, then its arguments in pieces
        for tc in (tc for d in deltas for tc in d.tool_calls or []):
            name, args = merged.setdefault(tc.index, ["", ""])
            merged[tc.index] = [name + (tc.function.name or ""), args + (tc.function.arguments or "")]
        streamed = [(name, json.loads(args)) for name, args in (merged[k] for k in sorted(merged))]
        assert len(deltas) > 2  # streamed as generated, not as one
        assert (
            streamed == calls and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
        )
        assert ("".join(d.model_extra.get("reasoning_content") or "" for d in deltas) or None) == thinks
        assert ("".join(d.content or "" for d in deltas) or None) == m.content
