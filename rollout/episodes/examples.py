"""Example environments for multi-turn episodes (`env: "rollout.episodes.examples:Calculator"`).

- `Calculator`: a tool-call environment. A tool call `calculator(expression="3 * (4 + 5)")`, as
  vLLM's parser (`serve.tool_parser`) reads it in the turn (`Action.tool_calls`; hermes:
  `<tool_call>{"name": "calculator", "arguments": {"expression": ...}}</tool_call>`), or a turn that
  is the JSON object `{"tool": "calculator", "expression": ...}`, gets the result back as a `tool` message;
  a final answer `{"answer": 27}` ends the episode with reward 1 if it equals the prompt's
  `metadata["answer"]`, else 0; anything else (not JSON, an unknown tool, a bad expression) gets
  an error message back, so the model can try again, until `episode.max_turns`.
- `ReasoningGym`: a procedural task with a verifier from the `reasoning-gym` package (the `envs`
  extra): `reset` asks the dataset's question (entry `metadata["index"]`, else one derived from
  the prompt id), each turn is an answer scored by the dataset's own verifier; a wrong one gets
  "Incorrect, try again." until `attempts` answers were given. Reward: the verifier's score.
- `Observations`: fixed token-id observations, the multi-turn benchmark's workload.
- `Digits`: the learnable toy task of `benchmarks/async_grpo.py --turns N`: reward is the fraction of
  digit tokens the model emits over `turns` turns, each observation a fixed "more" message.
Random tiny weights will not solve the first two; the loop, masks and epochs are what they test.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import operator
from typing import Any

from rollout.episodes.env import Action, Step
from rollout.types import Prompt

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Mod: operator.mod}  # fmt: skip


def evaluate(expression: str) -> float:
    """Arithmetic on numbers only (+ - * / ** % and parentheses). Raises ValueError."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ZeroDivisionError, OverflowError) as e:
        raise ValueError(str(e)) from e
    return value


class Calculator:
    """A calculator tool and a graded final answer (module docstring)."""

    def __init__(self, tolerance: float = 1e-6):
        self.tolerance = tolerance
        self.target: float | None = None

    async def reset(self, prompt: Prompt) -> dict[str, str]:
        self.target = prompt.metadata.get("answer")
        return {"role": "system", "content": 'Tools: calculator. Call: {"tool": "calculator", "expression": "..."}. '
                                             'Answer: {"answer": <number>}.'}  # fmt: skip

    async def step(self, action: Action) -> Step:
        if action.tool_calls:  # read by vLLM's tool parser
            fn = action.tool_calls[0]["function"]
            try:
                args = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                args = None
            if not isinstance(args, dict):
                return Step({"role": "tool", "content": "error: the arguments are not a JSON object"}, 0.0, False)
            call = {**args, "tool": fn["name"]}
            return self._calculate(call)
        try:
            call = json.loads(action.text)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return Step({"role": "tool", "content": "error: not a JSON tool call or answer"}, 0.0, False)
        if not isinstance(call, dict):
            return Step({"role": "tool", "content": "error: expected a JSON object"}, 0.0, False)
        if "answer" in call:
            ok = self.target is not None and _close(call["answer"], self.target, self.tolerance)
            return Step(None, 1.0 if ok else 0.0, True)
        return self._calculate(call)

    def _calculate(self, call: dict[str, Any]) -> Step:
        if call.get("tool") != "calculator":
            return Step({"role": "tool", "content": f"error: unknown tool {call.get('tool')!r}"}, 0.0, False)
        try:
            result = evaluate(str(call.get("expression", "")))
        except ValueError as e:
            return Step({"role": "tool", "content": f"error: {e}"}, 0.0, False)
        return Step({"role": "tool", "content": f"{result:g}"}, 0.0, False)


def _close(value: Any, target: Any, tolerance: float) -> bool:
    try:
        return math.isclose(float(value), float(target), rel_tol=tolerance, abs_tol=tolerance)
    except (TypeError, ValueError):
        return False


class ReasoningGym:
    """A `reasoning-gym` dataset as a multi-attempt task (module docstring)."""

    def __init__(
        self, dataset: str = "basic_arithmetic", seed: int = 0, size: int = 1000, attempts: int = 3, **config: Any
    ):
        import reasoning_gym  # the `envs` extra

        self.data = reasoning_gym.create_dataset(dataset, seed=seed, size=size, **config)
        self.attempts = attempts
        self.entry: dict[str, Any] = {}
        self.tries = 0

    def reset(self, prompt: Prompt) -> str:
        index = prompt.metadata.get("index")
        if not isinstance(index, int):
            index = int.from_bytes(hashlib.blake2b(prompt.id.encode(), digest_size=4).digest(), "little")
        self.entry = self.data[index % len(self.data)]
        self.tries = 0
        return self.entry["question"]

    def step(self, action: Action) -> Step:
        self.tries += 1
        score = float(self.data.score_answer(answer=action.text.strip(), entry=self.entry))
        if score >= 1.0 or self.tries >= self.attempts:
            return Step(None, score, True)
        return Step("Incorrect, try again.", score, False)


class Digits:
    """Reward = digit tokens / tokens generated over `turns` turns (byte tokenizer: ids 52..61)."""

    DIGITS = range(4 + ord("0"), 4 + ord("9") + 1)

    def __init__(self, turns: int = 2, message: str = "more"):
        self.turns, self.message = turns, message
        self.count = self.total = 0

    async def reset(self, prompt: Prompt) -> None:
        self.count = self.total = 0

    async def step(self, action: Action) -> Step:
        self.count += sum(t in self.DIGITS for t in action.token_ids)
        self.total += max(len(action.token_ids), 1)
        done = action.turn + 1 >= self.turns
        return Step(None if done else self.message, self.count / self.total if done else 0.0, done)


class Observations:
    """The multi-turn benchmark's environment (`configs/multiturn.yaml`): `turns` model turns,
    each answered by `tokens` token ids that depend only on the prompt and the turn, so every side
    of `rollout bench` plays the same episodes whatever the model says."""

    def __init__(self, turns: int = 4, tokens: int = 64):
        self.turns, self.tokens = turns, tokens
        self.seed = 0

    async def reset(self, prompt: Prompt) -> None:
        self.seed = int.from_bytes(hashlib.blake2b(prompt.id.encode(), digest_size=4).digest(), "little")

    async def step(self, action: Action) -> Step:
        done = action.turn + 1 >= self.turns
        ids = [4 + (self.seed + 31 * action.turn + 7 * i) % 250 for i in range(self.tokens)]
        return Step(None if done else ids, 0.0, done)
