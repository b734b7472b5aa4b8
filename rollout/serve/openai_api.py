"""The OpenAI-compatible API's wire format: requests checked into prompts, results into responses.

Owns: reading a request body (`chat`, `completion`, `generate`, `tokenize`) into a `Call` (the
exact prompt token ids, sampling overrides, session and episode ids, what to return), with a
400 `ApiError` naming the offending field for anything malformed; and building the response
bodies, including what NeMo Gym and Megatron-RL read on every message (`prompt_token_ids`,
`generation_token_ids`, `generation_log_probs`, `policy_epoch`, `kv_cache_epoch`,
`num_evictions`), our exact records under `rollout`, and vLLM's conventions
(`return_tokens_as_token_ids`, `return_token_ids`). Multi-turn prefix guarantee: an assistant
message that carries `prompt_token_ids` + `generation_token_ids` (or `required_prefix_token_ids`)
replaces the re-rendered conversation up to it, so a turn's prompt starts with exactly the ids
the turn before ran. Unknown fields are ignored. The text returned is what vLLM's server returns:
a stop string, and a stop id's text, are cut from it (`visible_text`); the token ids keep every
token. `n` choices on completions and generate are the samples of one group. Tool calls and
reasoning are vLLM's parsers' (`serve.tool_parser`, `serve.reasoning_parser`, `rollout.episodes.chat.Parsers`):
`message.tool_calls`, `message.reasoning` (and `reasoning_content`, its older name), finish reason
"tool_calls", each as vLLM's chat server makes them (streamed: `rollout.serve.sse`).
Does not own: HTTP, auth, limits, decoding bodies (`rollout.serve.server`, `rollout.serve.auth`,
`rollout.serve.bodies`),
rendering (`rollout.episodes.chat`).
"""

from __future__ import annotations

import math
import re
import time
import uuid
from typing import Any

import msgspec

from rollout.episodes.chat import ChatRenderer, Parsers
from rollout.learner.export import to_megatron
from rollout.types import INT32_MAX, Trajectory

ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error in OpenAI's shape: HTTP status, message, the parameter it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class Call(msgspec.Struct):
    """One request, ready for the engine."""

    prompt_ids: list[int]
    sampling: dict[str, Any]
    session: str | None = None
    episode: str | None = None
    logprobs: bool = False
    prefix: int = 0  # leading ids taken as an earlier turn ran them (a spliced assistant message)
    as_token_ids: bool = False  # return_tokens_as_token_ids
    return_token_ids: bool = False
    parse: Any = None  # what the parsers read of the request (`Parsers.request`); None: no parsers
    stream: bool = False
    usage: bool = False  # streamed: `stream_options.include_usage`
    ids_param: str = "messages"  # the field the prompt's ids came from, named by errors about them
    where: str = ""  # where sampling fields sit: "" (top level) or "sampling_params."
    stop: list[str] = msgspec.field(default_factory=list)  # effective stop strings and ids (the server fills them)
    stop_ids: list[int] = msgspec.field(default_factory=list)

    def param_of(self, message: str) -> str:
        """The request field an engine check's message (`InvalidPromptError`) is about."""
        if (m := re.search(r"sampling\.(\w+)", message)) is not None:
            return self.where + m.group(1)
        return "max_tokens" if "+ max_tokens" in message else self.ids_param


def chat(
    data: dict[str, Any], renderer: ChatRenderer | None, session: str | None, parsers: Parsers | None = None
) -> Call:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: required, a non-empty list of messages", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}].role: expected one of {', '.join(ROLES)}", f"messages[{i}].role")
        content = m.get("content", "")
        if not isinstance(content, (str, list, type(None))) or (
            isinstance(content, list)
            and not all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content)
        ):
            raise ApiError(
                400, f"messages[{i}].content: expected a string or a list of parts with text", f"messages[{i}].content"
            )
    if _n(data, "") != 1:  # a conversation's turn continues one session: one sample
        raise ApiError(
            400, "n: only n=1 is served on chat (a turn continues one conversation; /v1/completions serves n)", "n"
        )
    tools = data.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "tools: expected a list", "tools")
    ids, prefix = prompt_ids(messages, tools, data.get("required_prefix_token_ids"), _need(renderer))
    parse = None
    if parsers is not None:
        try:
            parse = parsers.request(data)
        except ValueError as e:  # vLLM's request model refuses a field the parsers read
            raise ApiError(400, str(e), str(e).split(":")[0]) from e
    return Call(ids, sampling(data), session, _str(data, "episode_id"), bool(data.get("logprobs")), prefix,
                bool(data.get("return_tokens_as_token_ids")), bool(data.get("return_token_ids")), parse,
                streamed(data)[0])  # fmt: skip


def prompt_ids(messages: list[dict[str, Any]], tools: Any, required: Any, chat: ChatRenderer) -> tuple[list[int], int]:
    """The conversation's token ids, and how many lead it unrendered: the last assistant message
    carrying its ids (or `required_prefix_token_ids`) is taken as it was run, and only what
    follows it is rendered."""
    messages = [_plain(m) for m in messages]
    last = max(
        (i for i, m in enumerate(messages) if m["role"] == "assistant" and "generation_token_ids" in m), default=None
    )
    prefix: list[int] | None = None
    if last is not None:
        m = messages[last]
        prefix = _ids(m.get("prompt_token_ids"), f"messages[{last}].prompt_token_ids") + _ids(
            m.get("generation_token_ids"), f"messages[{last}].generation_token_ids"
        )
    if required is not None:
        prefix = _ids(required, "required_prefix_token_ids")
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    try:
        if prefix is None:
            return chat.render([_clean(m) for m in messages], tools), 0
        rest = [_clean(m) for m in messages[last + 1 :]]
        if prefix[-1:] != [chat.end_of_turn]:
            prefix = prefix + [chat.end_of_turn]  # the turn before ended without closing itself
        return prefix + chat.append(rest, tools), len(prefix)
    except ApiError:
        raise
    except Exception as e:  # the template's own refusal (jinja2 raises what it likes): the client's messages
        raise ApiError(
            400, f"messages: the chat template cannot render them: {type(e).__name__}: {e}", "messages"
        ) from e


def completion(data: dict[str, Any], renderer: ChatRenderer | None) -> Call:
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        try:
            ids = _need(renderer).encode(prompt)
        except ApiError as e:  # over the context before tokenizing (`server_io.ServedChat`)
            e.param = "prompt"
            raise
    elif isinstance(prompt, list) and prompt:
        ids = _ids(prompt, "prompt")
    else:
        raise ApiError(400, "prompt: required, a non-empty string or list of token ids", "prompt")
    return Call(ids, {**sampling(data), "n": _n(data, "")}, logprobs=data.get("logprobs") is not None,
                return_token_ids=bool(data.get("return_token_ids")), ids_param="prompt")  # fmt: skip


def generate(data: dict[str, Any]) -> Call:
    """vLLM's token-in/token-out `POST /inference/v1/generate` (as prime-rl's verifiers call it)."""
    ids = _ids(data.get("token_ids"), "token_ids")
    params = data.get("sampling_params", {})
    if not isinstance(params, dict):
        raise ApiError(400, "sampling_params: expected an object", "sampling_params")
    return Call(ids, {**sampling(params, "sampling_params."), "n": _n(params, "sampling_params.")}, logprobs=True,
                as_token_ids=True, return_token_ids=True, ids_param="token_ids", where="sampling_params.")  # fmt: skip


def sampling(data: dict[str, Any], where: str = "") -> dict[str, Any]:
    """Sampling overrides from OpenAI's names, checked here (the engine re-checks the rest)."""
    out: dict[str, Any] = {"n": 1}
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
    for key, value, kind in (("max_tokens", max_tokens, int), ("temperature", data.get("temperature"), float),
                             ("top_p", data.get("top_p"), float), ("top_k", data.get("top_k"), int),
                             ("min_tokens", data.get("min_tokens"), int), ("seed", data.get("seed"), int)):  # fmt: skip
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (kind is int and not isinstance(value, int))
        ):
            raise ApiError(
                400, f"{where}{key}: expected {'an integer' if kind is int else 'a number'}, got {value!r}", where + key
            )
        if kind is float and not math.isfinite(value):
            raise ApiError(400, f"{where}{key}: expected a finite number, got {value!r}", where + key)
        if (
            kind is int and not -(2**63) <= value < 2**63
        ):  # what msgpack carries (to a front end's backend, to the engines)
            raise ApiError(400, f"{where}{key}: expected an integer in [-2^63, 2^63), got {value!r}", where + key)
        out[key] = value
    if out.get("top_k") == -1:
        out["top_k"] = 0
    stop = data.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ApiError(400, f"{where}stop: expected a string or a list of non-empty strings", where + "stop")
        out["stop"] = stop
    if (stop_ids := data.get("stop_token_ids")) is not None:
        out["stop_token_ids"] = _ids(stop_ids, where + "stop_token_ids")
    return out


def chat_response(
    call: Call, trajs: list[Trajectory], model: str, chat: ChatRenderer | None, parsers: Parsers | None = None
) -> dict[str, Any]:
    (traj,) = trajs  # chat serves n=1
    text = visible_text(chat, traj.token_ids, traj.finish_reason, call.stop, call.stop_ids)
    parsed = {"reasoning": None, "content": text, "tool_calls": []}
    if parsers is not None and call.parse is not None and chat is not None:
        parsed = parsers.parse(call.parse, text, list(traj.token_ids), list(traj.prompt_token_ids))
    message: dict[str, Any] = {"role": "assistant", "content": parsed["content"], "reasoning": parsed["reasoning"],
                               "reasoning_content": parsed["reasoning"], **token_fields(traj)}  # fmt: skip
    if parsed["tool_calls"]:
        message["tool_calls"] = parsed["tool_calls"]
    choice: dict[str, Any] = {"index": 0, "message": message,
                              "finish_reason": "tool_calls" if parsed["tool_calls"] else finish(traj),
                              "logprobs": {"content": logprob_items(traj, call.as_token_ids, chat)}
                                          if call.logprobs else None}  # fmt: skip
    body = _envelope("chat.completion", model, trajs, [choice])
    if call.return_token_ids:
        body["prompt_token_ids"] = list(traj.prompt_token_ids)
        choice["token_ids"] = list(traj.token_ids)
    return body


def completion_response(call: Call, trajs: list[Trajectory], model: str, chat: ChatRenderer | None) -> dict[str, Any]:
    choices = []
    for i, traj in enumerate(trajs):
        choice: dict[str, Any] = {
            "index": i, "text": visible_text(chat, traj.token_ids, traj.finish_reason, call.stop, call.stop_ids),
            "finish_reason": finish(traj), "logprobs": None, **token_fields(traj),
        }  # fmt: skip
        if call.logprobs:
            choice["logprobs"] = {
                "tokens": [f"token_id:{t}" for t in traj.token_ids],
                "token_logprobs": list(traj.logprobs),
            }
        if call.return_token_ids:
            choice["token_ids"] = list(traj.token_ids)
        choices.append(choice)
    body = _envelope("text_completion", model, trajs, choices)
    if call.return_token_ids:
        body["prompt_token_ids"] = list(trajs[0].prompt_token_ids)
    return body


def visible_text(
    chat: ChatRenderer | None, ids: list[int], finish_reason: str, stop: list[str], stop_ids: list[int]
) -> str:
    """The text vLLM's server returns for a sample's ids (`include_stop_str_in_output` false): a
    turn ended by a stop id leaves that token's text out; one ended by a stop string ends before
    the stop string its last token completed (the earliest ending, the first listed on a tie, as
    vLLM's `check_stop_strings` picks), whatever else that token holds cut with it."""
    if chat is None:
        return ""
    if finish_reason != "stop" or not ids:
        return chat.decode(ids)
    if ids[-1] in stop_ids:
        return chat.decode(ids[:-1])
    text = chat.decode(ids)
    if not stop:
        return text
    before = len(chat.decode(ids[:-1]))  # the text the last token added starts here
    best: tuple[int, int] | None = None  # (end, start) of the stop string the last token completed
    for s in stop:
        at = text.find(s, max(0, before - len(s) + 1))
        if at != -1 and (best is None or at + len(s) < best[0]):
            best = (at + len(s), at)
    return text if best is None else text[: best[1]]


def streamed(data: dict[str, Any]) -> tuple[bool, bool]:
    """(`stream`, `stream_options.include_usage`) of a request, checked."""
    stream, options = data.get("stream", False), data.get("stream_options")
    if not isinstance(stream, bool) and stream is not None:
        raise ApiError(400, "stream: expected true or false", "stream")
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        raise ApiError(400, "stream_options: expected an object", "stream_options")
    if options and not stream:  # as vLLM's server refuses it
        raise ApiError(400, "stream_options: only with stream: true", "stream_options")
    usage = options.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise ApiError(400, "stream_options.include_usage: expected true or false", "stream_options.include_usage")
    return bool(stream), bool(usage)


def generate_response(trajs: list[Trajectory], request_id: str) -> dict[str, Any]:
    choices = []
    for i, traj in enumerate(trajs):
        items = [{"token": f"token_id:{t}", "logprob": lp} for t, lp in zip(traj.token_ids, traj.logprobs)]
        choices.append({"index": i, "token_ids": list(traj.token_ids), "finish_reason": finish(traj),
                        "logprobs": {"content": items}, **token_fields(traj)})  # fmt: skip
    return {"request_id": request_id, "prompt_token_ids": list(trajs[0].prompt_token_ids), "choices": choices}


def token_fields(traj: Trajectory) -> dict[str, Any]:
    """What NeMo Gym / Megatron-RL read on every generation, and our exact records."""
    m = to_megatron(traj)
    return {
        "prompt_token_ids": list(traj.prompt_token_ids),
        "generation_token_ids": list(traj.token_ids),
        "generation_log_probs": list(traj.logprobs),
        "policy_epoch": [[[s, e] for s, e in m["policy_epoch"]]],
        "kv_cache_epoch": [[[s, e] for s, e in m["kv_cache_epoch"]]],
        "num_evictions": [m["num_evictions"]],
        "rollout": {
            "policy_epochs": [list(r) for r in traj.policy_epochs],
            "kv_epochs": [list(r) for r in traj.kv_epochs],
            "kv_recomputes": [list(r) for r in traj.kv_recomputes],
            "kv_reused": traj.kv_reused,
            "engine_id": traj.engine_id,
        },  # fmt: skip
    }


def logprob_items(traj: Trajectory, as_ids: bool, chat: ChatRenderer | None) -> list[dict[str, Any]]:
    out = []
    for t, lp in zip(traj.token_ids, traj.logprobs):
        token = f"token_id:{t}" if as_ids or chat is None else chat.tokenizer.decode([t])
        out.append(
            {"token": token, "logprob": lp, "bytes": None if as_ids else list(token.encode()), "top_logprobs": []}
        )
    return out


def finish(traj: Trajectory) -> str:
    return "length" if traj.finish_reason == "length" else "stop"


def _envelope(kind: str, model: str, trajs: list[Trajectory], choices: list[dict[str, Any]]) -> dict[str, Any]:
    p, g = len(trajs[0].prompt_token_ids), sum(len(t.token_ids) for t in trajs)
    return {"id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}}  # fmt: skip


def _n(data: dict[str, Any], where: str) -> int:
    n = data.get("n", 1)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ApiError(400, f"{where}n: expected an integer >= 1, got {n!r}", where + "n")
    return n


def _need(renderer: ChatRenderer | None) -> ChatRenderer:
    if renderer is None:
        raise ApiError(400, "the model has no chat template: use /inference/v1/generate with token ids")
    return renderer


def _ids(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(type(x) is int and 0 <= x <= INT32_MAX for x in value):
        raise ApiError(400, f"{where}: expected a non-empty list of token ids (integers in [0, 2^31))", where)
    return list(value)


def _str(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"{key}: expected a string", key)
    return value


def _plain(m: dict[str, Any]) -> dict[str, Any]:
    """A message with list-of-parts content flattened to text."""
    content = m.get("content")
    if isinstance(content, list):
        m = {**m, "content": "".join(p.get("text", "") for p in content if isinstance(p, dict))}
    return m


def _clean(m: dict[str, Any]) -> dict[str, Any]:
    """What the chat template renders of a message: our token fields dropped, tool calls kept."""
    keep = {k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "tool_call_id", "name")}
    if keep["role"] == "developer":  # OpenAI's newer name for system
        keep["role"] = "system"
    keep.setdefault("content", "")
    if keep["content"] is None:
        keep["content"] = ""
    return keep
