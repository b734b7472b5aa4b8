"""vLLM's tool-call and reasoning parsers, by the names vLLM registers, for `rollout serve` and episodes.

Owns: the names (`check_names`, against `vllm.tool_parsers.ToolParserManager` and
`vllm.reasoning.ReasoningParserManager`), and `ChatParsers`: vLLM's own composed `Parser`
(`vllm.parser.ParserManager.get_parser`, as `vllm serve --enable-auto-tool-choice
--tool-call-parser T --reasoning-parser R` builds it), run on a finished turn the way vLLM's
chat server runs it: `parse` as its non-streaming path does (one parser per choice,
`set_prompt_token_ids`, `parse(text, request, enable_auto_tools=True, token_ids)`) and `stream` as
its streaming path does (a fresh parser, `parse_delta` per generated token with the text that
token completes, `finished` on the last). Results come back as plain dicts in OpenAI's shape
(vLLM's `reasoning`, plus `reasoning_content`, the name older clients read).
Imports vLLM inside its functions (the driver's one lookup of vLLM's registries outside the engines).
Does not own: what the server does with them (`rollout.serve.openai_api`), the turn's text (`rollout.episodes.chat`).
Import order: `transformers` before `vllm.tool_parsers` / `vllm.reasoning` in a fresh interpreter
(importing them first hits a circular import inside transformers on this install).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

NO_PARSER = (None, "", "none")  # `serve.tool_parser` / `serve.reasoning_parser` values that mean no parser


def registered() -> tuple[list[str], list[str]]:
    """(tool parser names, reasoning parser names) vLLM registers, sorted."""
    import transformers  # noqa: F401  (import order, module docstring)
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    return sorted(ToolParserManager.list_registered()), sorted(ReasoningParserManager.list_registered())


def check_names(tool: str | None, reasoning: str | None) -> None:
    """Raises ValueError `"tool_parser: ..."` / `"reasoning_parser: ..."` for a name vLLM does not
    register, listing the ones it does."""
    if tool in NO_PARSER and reasoning in NO_PARSER:
        return
    tools, reasonings = registered()
    for key, name, valid in (("tool_parser", tool, tools), ("reasoning_parser", reasoning, reasonings)):
        if name not in NO_PARSER and name not in valid:
            raise ValueError(f"{key}: {name!r} is not a parser vLLM registers; one of: none, {', '.join(valid)}")


class ChatParsers:
    """vLLM's parsers for a tokenizer (module docstring). Raises ValueError naming the key when the
    tokenizer lacks what a parser needs (vLLM's own startup check)."""

    def __init__(self, tokenizer: Any, tool: str | None, reasoning: str | None):
        check_names(tool, reasoning)
        import transformers  # noqa: F401
        from vllm.parser import ParserManager

        self.tokenizer = tokenizer
        tool, reasoning = (None if tool in NO_PARSER else tool), (None if reasoning in NO_PARSER else reasoning)
        try:
            self.parser_cls = ParserManager.get_parser(tool_parser_name=tool, reasoning_parser_name=reasoning,
                                                       enable_auto_tools=True, tokenizer=tokenizer)  # fmt: skip
        except TypeError as e:
            raise ValueError(f"{'tool_parser' if tool else 'reasoning_parser'}: {e}") from e
        self.tools = self.parser_cls is not None and self.parser_cls.tool_parser_cls is not None

    def request(self, data: dict[str, Any]) -> Any:
        """vLLM's `ChatCompletionRequest` for what the parsers read of a client's body (`tools`,
        `tool_choice`, `include_reasoning`). Raises ValueError naming the field vLLM refuses."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.exceptions import VLLMValidationError

        fields = {k: data[k] for k in ("tools", "tool_choice", "include_reasoning") if data.get(k) is not None}
        try:
            return ChatCompletionRequest.model_validate(
                {"model": "", "messages": [{"role": "user", "content": ""}], **fields}
            )
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err.get("loc", ())) or "tools"
            raise ValueError(f"{where}: {err.get('msg', e)}") from e
        except VLLMValidationError as e:  # its own checks across fields (`tool_choice` without `tools`)
            raise ValueError(f"{e.parameter or 'tools'}: {e.args[0] if e.args else e}") from e
        except Exception as e:  # whatever else its validators raise on a client's garbage: still the client's
            raise ValueError(f"tools: vLLM's request model refuses them: {type(e).__name__}: {e}") from e

    def any_tools(self) -> Any:
        """A request that lets the parser read any tool call (`tool_choice` "auto", no tool list: an
        episode's environment says nothing of its tools; vLLM's own validation wants a list with it)."""
        request = self.request({})
        request.tool_choice = "auto"
        return request

    def parse(self, request: Any, text: str, token_ids: list[int], prompt_ids: list[int]) -> dict[str, Any]:
        """{"reasoning", "content", "tool_calls"} of a finished turn, as vLLM's non-streaming chat
        path makes them (tool_calls in OpenAI's shape, [] when none)."""
        from vllm.renderers.chat_utils import make_tool_call_id

        parser = self._parser(request)
        parser.set_prompt_token_ids(prompt_ids)
        reasoning, content, calls = parser.parse(
            text, request, enable_auto_tools=True, model_output_token_ids=token_ids
        )
        if not request.include_reasoning:
            reasoning = None
        tool_calls = [{"id": c.id or make_tool_call_id(), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}}
                      for c in (calls or [])]  # fmt: skip
        return {"reasoning": reasoning, "content": content, "tool_calls": tool_calls}

    def stream(
        self, request: Any, steps: list[list[int]], prompt_ids: list[int], decode: Callable[[list[int]], str]
    ) -> list[dict[str, Any]]:
        """The deltas vLLM's streaming chat path sends for a turn whose tokens came in `steps`
        (one token per step is vLLM's usual stream): `parse_delta` per step with the text it adds
        (a step that ends inside a UTF-8 character waits for the next, as vLLM's detokenizer holds
        it back), `finished` on the last, None deltas dropped; each a dict of vLLM's `DeltaMessage`."""
        streamer = self.streamer(request, prompt_ids)
        out, ids, sent, pending = [], [], "", []
        for k, step in enumerate(steps):
            ids, pending = ids + list(step), pending + list(step)
            last = k == len(steps) - 1
            text = decode(ids)
            if text.endswith("\ufffd") and not last:
                continue
            delta = streamer.feed(text[len(sent) :], pending, last)
            sent, pending = text, []
            if delta is not None:
                out.append(delta)
        return out

    def streamer(self, request: Any, prompt_ids: list[int]) -> ParserStream:
        """One streamed choice's parser (`ParserStream`)."""
        return ParserStream(self._parser(request), request, prompt_ids)

    def _parser(self, request: Any) -> Any:
        """A fresh parser (vLLM's are stateful: one per choice, per stream)."""
        assert self.parser_cls is not None
        return self.parser_cls(self.tokenizer, request.tools, chat_template_kwargs={})


class ParserStream:
    """vLLM's parser over one streamed choice, as its streaming chat path runs it: `feed` the text
    and token ids each step adds (`finished` on the last) and get vLLM's `DeltaMessage` for it as
    a dict (plus `reasoning_content`, the older name of `reasoning`), or None when the parser
    holds it back. `tools`: whether any delta carried a tool call (vLLM then finishes a stopped
    turn with "tool_calls")."""

    def __init__(self, parser: Any, request: Any, prompt_ids: list[int]):
        self.parser, self.request, self.prompt_ids = parser, request, prompt_ids
        self.tools = False

    def feed(self, text: str, token_ids: list[int], finished: bool) -> dict[str, Any] | None:
        delta = self.parser.parse_delta(text, token_ids, self.request, self.prompt_ids, finished=finished)
        if delta is None:
            return None
        out = delta.model_dump(exclude_unset=True, exclude_none=True)
        if out.get("tool_calls"):
            self.tools = True
        if "reasoning" in out:
            out["reasoning_content"] = out["reasoning"]
        return out
