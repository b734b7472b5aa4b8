"""Tool calls in a model's text, as the OpenAI API returns them (`serve.tool_parser`).

- `hermes` (Qwen, Hermes, many others): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks; the text outside them is the message content.
- `json`: the whole turn is one JSON object `{"name": ..., "arguments": {...}}` (or a list of them),
  as the embedded tiny model's chat template writes `tool_calls`.
- `none`: never a tool call.
A block that is not valid JSON, or has no string `name`, is left in the content as text: the client
sees what the model wrote. Arguments are returned as a JSON string, as the API specifies.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
PARSERS = ("hermes", "json", "none")


def parse_tool_calls(text: str, parser: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls in OpenAI's shape) of a model's turn."""
    if parser == "none" or not text:
        return text, []
    if parser == "json":
        calls = _calls(_loads(text.strip()))
        return (None, calls) if calls else (text, [])
    calls, kept, last = [], [], 0
    for m in _BLOCK.finditer(text):
        found = _calls(_loads(m.group(1)))
        if not found:
            continue
        kept.append(text[last : m.start()])
        calls.extend(found)
        last = m.end()
    if not calls:
        return text, []
    content = "".join(kept + [text[last:]]).strip()
    return content or None, calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _calls(value: Any) -> list[dict[str, Any]]:
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        args = item.get("arguments", item.get("parameters", {}))
        out.append({
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": item["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
        })  # fmt: skip
    return out
