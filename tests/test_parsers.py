"""vLLM's tool-call and reasoning parsers by name (`rollout.parsers`, `serve.tool_parser`,
`serve.reasoning_parser`): the adapter returns what vLLM's own parser classes extract, non-streaming
and streamed token by token; names are checked at config time; the tiny model's chat template
writes tool calls the `hermes` parser reads back; the server's message and stream shapes.
No engine: the real parsers on the tiny model's real tokenizer. Through real engines and the
`openai` client: tests/integration/test_parsers.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import transformers  # noqa: F401  (before vLLM's parser modules: rollout.parsers' docstring)

from rollout.config import load_config
from rollout.episodes.chat import ChatRenderer
from rollout.errors import InvalidConfigError
from rollout.parsers import ChatParsers, check_names
from rollout.serve import openai_api as api
from rollout.serve import sse
from rollout.tiny import EOS_ID, TinySpec, build_tiny
from rollout.types import Trajectory
from tests.support.parser_cases import ARGS, CASES, TOOLS


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tiny model's byte tokenizer, with `<|python_tag|>` (vLLM's llama3_json looks it up)."""
    path = build_tiny(TinySpec(vocab_size=261, extra_special=("<|python_tag|>",)), root=tmp_path_factory.mktemp("tiny"))
    return ChatRenderer(path).tokenizer


def vllm_extracts(tokenizer, tool, reasoning, text, request):
    """What vLLM's own parser classes extract from `text`: (reasoning, content, [(name, args)])."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    content, thought = text, None
    if reasoning:
        thought, content = ReasoningParserManager.get_reasoning_parser(reasoning)(tokenizer).extract_reasoning(
            text, request
        )
    calls = []
    if tool:
        info = ToolParserManager.get_tool_parser(tool)(tokenizer, request.tools).extract_tool_calls(
            content or "", request
        )
        if info.tools_called:
            calls, content = (
                [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls],
                info.content,
            )
    return thought, content or None, calls


@pytest.mark.parametrize("tool,reasoning,text", CASES)
def test_the_adapter_extracts_what_vllms_parsers_do_whole_and_streamed_token_by_token(tokenizer, tool, reasoning, text):
    parsers = ChatParsers(tokenizer, tool, reasoning)
    request = parsers.request({"tools": TOOLS})
    ids = tokenizer.encode(text, add_special_tokens=False)
    thought, content, calls = vllm_extracts(tokenizer, tool, reasoning, text, request)
    assert calls == ([("add", ARGS)] if tool else []) and (thought is not None) == bool(reasoning)

    parsed = parsers.parse(request, text, ids, [1])
    assert parsed["reasoning"] == thought and (parsed["content"] or None) == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed["tool_calls"]] == calls
    assert all(c["id"] and c["type"] == "function" for c in parsed["tool_calls"])

    def decode(x):
        return tokenizer.decode(x, skip_special_tokens=True)

    deltas = parsers.stream(request, [[t] for t in ids], [1], decode)  # one token per step, as vLLM streams
    assert len(deltas) > 1 and "".join(d.get("reasoning", "") for d in deltas) == (thought or "")
    assert ("".join(d.get("content", "") for d in deltas) or None) == content
    names = [
        tc["function"]["name"] for d in deltas for tc in d.get("tool_calls", []) if tc.get("function", {}).get("name")
    ]
    args = "".join(
        tc["function"].get("arguments") or "" for d in deltas for tc in d.get("tool_calls", []) if tc.get("function")
    )
    assert [(n, json.loads(args)) for n in names] == calls


def test_unknown_parser_names_are_refused_at_config_time_listing_the_valid_ones(tmp_path):
    with pytest.raises(
        InvalidConfigError,
        match=r"serve\.tool_parser: 'json' is not a parser vLLM registers; one of: none, .*hermes.*llama3_json",
    ):
        load_config(None, ["serve.tool_parser=json"])
    with pytest.raises(InvalidConfigError, match=r"serve\.reasoning_parser: 'qwen4' is not .*deepseek_r1.*qwen3"):
        load_config(None, ["serve.reasoning_parser=qwen4"])
    cfg = load_config(None, ["serve.tool_parser=qwen3_xml", "serve.reasoning_parser=qwen3"])
    assert (cfg.serve.tool_parser, cfg.serve.reasoning_parser) == ("qwen3_xml", "qwen3")
    assert load_config(None, ["serve.tool_parser=none"]).serve.tool_parser == "none"
    check_names(None, None)
    path = tmp_path / "c.yaml"
    path.write_text("serve:\n  tool_parser: nope\n")
    done = subprocess.run(
        [sys.executable, "-m", "rollout.cli", "validate", str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "serve.tool_parser: 'nope' is not a parser vLLM registers" in done.stderr


def test_the_tiny_templates_tool_calls_are_read_back_by_vllms_hermes_parser():
    chat = ChatRenderer(build_tiny())
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": json.dumps(ARGS)}}
    as_object = {**call, "function": {"name": "add", "arguments": ARGS}}
    for c in (call, as_object):  # arguments as the API's JSON string, or an object
        ids = chat.render(
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [c]}], TOOLS, False
        )
        turn = chat.decode(ids).split("<assistant>", 1)[1]
        parsers = ChatParsers(chat.tokenizer, "hermes", None)
        parsed = parsers.parse(parsers.request({"tools": TOOLS}), turn, chat.encode(turn), [])
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed["tool_calls"]] == [
            ("add", ARGS)
        ]


def test_a_chat_reply_carries_tool_calls_and_reasoning_as_vllms_server_does_streamed_too():
    chat = ChatRenderer(build_tiny())
    parsers = ChatParsers(chat.tokenizer, "hermes", "qwen3")
    text = '<think>call add</think><tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    ids = [*chat.encode(text), EOS_ID]
    traj = Trajectory(request_id="r", prompt_id="p", prompt_token_ids=[5, 6], token_ids=ids, logprobs=[0.0] * len(ids),
                      finish_reason="stop", policy_epochs=[(0, 0)], kv_epochs=[(0, 0)])  # fmt: skip
    for stream in (False, True):
        data = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "stream": stream}
        call = api.chat(data, chat, None, parsers)
        body = api.chat_response(call, [traj], "tiny", chat, parsers)
        m, choice = body["choices"][0]["message"], body["choices"][0]
        assert (
            m["reasoning"] == m["reasoning_content"] == "call add"
            and m["content"] is None
            and choice["finish_reason"] == "tool_calls"
        )
        assert m["tool_calls"][0]["function"] == {"name": "add", "arguments": json.dumps(ARGS)}
        if stream:
            for step in (1, 3):  # a token per engine step, or three (a speculating engine)
                chunks = streamed_chunks(call, traj, chat, parsers, step)
                deltas = [c["choices"][0]["delta"] for c in chunks]
                assert deltas[0] == {"role": "assistant", "content": ""}
                assert "".join(d.get("reasoning", "") for d in deltas) == "call add"
                assert "".join(d.get("reasoning_content", "") for d in deltas) == "call add"
                assert not "".join(d.get("content") or "" for d in deltas[1:])
                calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
                assert [tc["function"]["name"] for tc in calls if tc["function"].get("name")] == ["add"]
                assert json.loads("".join(tc["function"].get("arguments") or "" for tc in calls)) == ARGS
                assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"
                assert deltas[-1]["generation_token_ids"] == ids and "stream" not in chunks[-1]["choices"][0]
        else:
            assert "stream" not in choice
    no_tools = api.chat_response(
        api.chat(
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "none", "tools": TOOLS}, chat, None, parsers
        ),
        [traj],
        "tiny",
        chat,
        parsers,
    )
    assert "tool_calls" not in no_tools["choices"][0]["message"] and no_tools["choices"][0]["finish_reason"] == "stop"
    with pytest.raises(api.ApiError, match="tool_choice"):
        api.chat({"messages": [{"role": "user", "content": "x"}], "tool_choice": 7}, chat, None, parsers)


def streamed_chunks(call, traj, chat, parsers, step: int) -> list[dict]:
    """The chunks `rollout.serve.sse` sends for `traj`, its tokens arriving `step` at a time."""
    chunks = sse.Chunks(call, "tiny", chat, parsers, True, 1, False)
    ids, out = list(traj.token_ids), [chunks.start()]
    for k in range(0, len(ids) - 1, step):  # the last token arrives with the finished trajectory
        part = ids[k : min(k + step, len(ids) - 1)]
        out.append(chunks.step({0: (part, [0.0] * len(part))}))
        chunks.seen[0] = k + len(part)
    out.append(chunks.end([traj]))
    lines = b"".join(out).decode().split("\n\n")
    assert lines[-2:] == ["data: [DONE]", ""]
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_a_half_written_tool_call_finishes_as_vllms_server_says_stop_whole_and_tool_calls_streamed():
    """vLLM's server answers a turn whose tool call is cut off (or whose second call is broken) with
    finish reason "stop" and the raw text as content when not streamed, and with "tool_calls" once
    its streaming parser sent a tool-call delta (`vllm/entrypoints/openai/chat_completion/serving.py`,
    `tools_streamed`): this server answers both ways as vLLM's does, from vLLM's own parser."""
    chat = ChatRenderer(build_tiny())
    parsers = ChatParsers(chat.tokenizer, "hermes", None)
    second_broken = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><tool_call>{"name": }'
    for text in ('<tool_call>{"name": "add", "arguments": {"a": 1', second_broken):
        ids = [*chat.encode(text), EOS_ID]
        traj = Trajectory(request_id="r", prompt_id="p", prompt_token_ids=[5, 6], token_ids=ids,
                          logprobs=[0.0] * len(ids), finish_reason="stop", policy_epochs=[(0, 0)])  # fmt: skip
        data = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
        whole = api.chat_response(api.chat(data, chat, None, parsers), [traj], "tiny", chat, parsers)["choices"][0]
        chunks = streamed_chunks(api.chat({**data, "stream": True}, chat, None, parsers), traj, chat, parsers, 1)
        tools_streamed = any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == ("tool_calls" if tools_streamed else "stop")
        assert tools_streamed  # hermes streams the call's name before its arguments are whole
        if text.endswith("1"):  # the cut-off call: vLLM's non-streaming parse gives up, the text stays content
            assert whole["finish_reason"] == "stop" and whole["message"]["content"] == text


async def test_an_episodes_action_carries_the_tool_calls_vllms_parser_reads_and_the_calculator_answers_them():
    from rollout.episodes.chat import chat_renderer
    from rollout.episodes.examples import Calculator
    from rollout.episodes.loop import _action

    chat = chat_renderer(build_tiny(), "hermes", "qwen3")
    text = (
        "<think>use the tool</think>Let me see. "
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call>'
    )
    ids = [*chat.encode(text), EOS_ID]
    action = _action(
        Trajectory(request_id="r", prompt_id="p", prompt_token_ids=[5], token_ids=ids, finish_reason="stop"), chat, 0
    )
    assert action.text == text and action.reasoning == "use the tool" and action.content == "Let me see. "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in action.tool_calls] == [
        ("calculator", {"expression": "1 + 2"})
    ]
    assert (await Calculator().step(action)).observation == {"role": "tool", "content": "3"}
    plain = _action(
        Trajectory(request_id="r", prompt_id="p", token_ids=[*chat.encode("2+2"), EOS_ID], finish_reason="stop"),
        chat_renderer(build_tiny()),
        1,
    )
    assert plain.content == plain.text == "2+2" and plain.tool_calls == [] and plain.reasoning is None


def test_a_parser_the_tokenizer_cannot_serve_is_refused_naming_the_key():
    from rollout.episodes.chat import chat_parsers

    with pytest.raises(InvalidConfigError, match=r"serve\.tool_parser: .*llama3_json.*python_tag"):
        chat_parsers(ChatRenderer(build_tiny()), "llama3_json", None)
    assert chat_parsers(ChatRenderer(build_tiny()), "none", None) is None
