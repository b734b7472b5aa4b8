"""What vLLM's tool-call and reasoning parsers are tested with, with and without engines: one tool
(`add`), the arguments a call of it carries, and what a model writes in each parser's own format."""

from __future__ import annotations

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
ARGS = {"a": 1, "b": 2}
# (tool parser, reasoning parser, what the model writes): each parser's own format
CASES = [
    ("hermes", None, 'Adding. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'),
    ("llama3_json", None, '{"name": "add", "parameters": {"a": 1, "b": 2}}'),
    (
        "qwen3_xml",
        None,
        "Adding.<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>",
    ),
    (None, "qwen3", "<think>1 + 2, é</think>It is 3."),
    ("hermes", "qwen3", '<think>call add</think><tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'),
]
