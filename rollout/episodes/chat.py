"""Chat rendering for episodes and the OpenAI server: messages to token ids with the model's own
chat template, appended to a conversation without re-tokenizing what came before.

Owns: `ChatRenderer.render` (a conversation's start, up to the assistant's turn) and
`ChatRenderer.append` (the tokens that add messages after an assistant turn and open the next
one). Turn k+1's prompt is then exactly turn k's prompt + the tokens the model generated + those
tokens: what the learner trains on is what the engine ran. `append` renders a fixed two-message
conversation with and without the new messages and keeps the difference (as verl and SkyRL do);
a template for which that difference is not a clean suffix is refused with the reason.
`chat_parsers`: vLLM's tool-call and reasoning parsers by name (`serve.tool_parser`,
`serve.reasoning_parser`; `rollout.parsers` runs them as vLLM's chat server does), for the
server's replies and episodes' actions.
Does not own: which messages (the environment or the HTTP client says), sampling, engines.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from rollout.errors import InvalidConfigError
from rollout.log import get_logger

_PROBE_USER, _PROBE_REPLY = "x", "y"


class ChatRenderer:
    """The chat template and tokenizer of a model directory (needs `tokenizer.json` there)."""

    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        except Exception as e:
            raise InvalidConfigError(f"model.path: no tokenizer in {model_dir}: {type(e).__name__}: {e}") from e
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidConfigError(f"model.path: the tokenizer in {model_dir} has no chat template")
        self.end_of_turn = self._end_of_turn()
        self.parsers: Parsers | None = None  # vLLM's parsers for episodes' actions (`chat_renderer`)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of a whole conversation, opening the assistant's turn when asked."""
        text = self._text(messages, tools, add_generation_prompt)
        return self.encode(text)

    def append(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids that add `messages` after an assistant turn ended by `end_of_turn` (not included)
        and open the assistant's next turn. Raises ValueError when the template does not render
        them as a plain suffix (it rewrites earlier turns, e.g. drops past reasoning)."""
        base = [{"role": "user", "content": _PROBE_USER}]
        prefix = self._text(base, tools, True) + _PROBE_REPLY + self.tokenizer.decode([self.end_of_turn])
        full = self._text([*base, {"role": "assistant", "content": _PROBE_REPLY}, *messages], tools, True)
        if not full.startswith(prefix):
            raise ValueError("the chat template does not append messages after an assistant turn as a suffix")
        return self.encode(full[len(prefix) :])

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _text(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def _end_of_turn(self) -> int:
        """The special token the template closes an assistant message with (what the model emits to
        end its turn): the first token after the reply in a rendered assistant message."""
        base = [{"role": "user", "content": _PROBE_USER}]
        opened = self._text(base, None, True) + _PROBE_REPLY
        closed = self._text([*base, {"role": "assistant", "content": _PROBE_REPLY}], None, False)
        ids = self.encode(closed[len(opened) :]) if closed.startswith(opened) else []
        if not ids or ids[0] not in set(self.tokenizer.all_special_ids):
            raise InvalidConfigError("model.path: cannot tell which token ends an assistant turn in the chat template")
        return ids[0]


def chat_renderer(path: Any, tool: str | None = None, reasoning: str | None = None) -> ChatRenderer | None:
    """The model's chat template for episodes' text, with vLLM's parsers for its actions (the ones
    `serve.tool_parser` / `serve.reasoning_parser` name), or None when it has none (token ids only).
    Raises InvalidConfigError naming the key for parsers the tokenizer cannot serve."""
    try:
        renderer = ChatRenderer(path)
    except InvalidConfigError as e:
        get_logger(__name__).warning("episodes: no chat template, observations must be token ids", reason=str(e))
        return None
    renderer.parsers = chat_parsers(renderer, tool, reasoning)
    return renderer


class Parsers(Protocol):
    """What the server and episodes call of `rollout.parsers.ChatParsers` (its docstrings say what each does)."""

    tools: bool  # a tool-call parser is set

    def request(self, data: dict[str, Any]) -> Any: ...
    def any_tools(self) -> Any: ...
    def parse(self, request: Any, text: str, token_ids: list[int], prompt_ids: list[int]) -> dict[str, Any]: ...
    def stream(
        self, request: Any, steps: list[list[int]], prompt_ids: list[int], decode: Callable[[list[int]], str]
    ) -> list[dict[str, Any]]: ...


def chat_parsers(renderer: ChatRenderer | None, tool: str | None, reasoning: str | None) -> Parsers | None:
    """vLLM's parsers for the model's tokenizer, or None when neither is set (or there is no chat
    template: no text to parse). Raises InvalidConfigError naming the key when the tokenizer lacks
    what a parser needs (e.g. `llama3_json` looks up `<|python_tag|>`)."""
    from rollout.parsers import NO_PARSER, ChatParsers

    if renderer is None or (tool in NO_PARSER and reasoning in NO_PARSER):
        return None
    try:
        return ChatParsers(renderer.tokenizer, tool, reasoning)
    except ValueError as e:
        raise InvalidConfigError(f"serve.{e}") from e
