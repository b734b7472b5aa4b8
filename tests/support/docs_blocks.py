"""The Python blocks of README.md and docs/guides/*.md as tests see them: found by Sybil (visible
fences and `<!-- invisible-code-block: python -->` comments), each with what it needs
(`<!-- docs-test: real-engines -->` before it), compiled so that a traceback names the document's
own lines, and a failure that names the file, the block's line and the line inside it that raised.
The unit tier (tests/test_docs_snippets.py) runs the blocks on fake engines; the integration tier
(tests/integration/test_docs_blocks.py) runs the real-engines blocks on its shared engines.
"""

from __future__ import annotations

import ast
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import CodeType
from typing import Any

import torch
from safetensors.torch import load_file
from sybil import Example, Region, Sybil
from sybil.parsers.markdown import CodeBlockParser
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
REAL_ENGINES = "real-engines"


class BlockFailed(Exception):
    """A docs block raised; the message names the document's file and line."""


def compiled(example: Example) -> CodeType:
    """The block as a notebook cell: top-level `await` and `async with` allowed (evaluating it then
    gives a coroutine); its lines are the document's, so tracebacks point into the document."""
    source = "\n" * (example.line + example.parsed.line_offset) + example.parsed
    return compile(source, example.path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)


def where(example: Example) -> str:
    return f"{Path(example.path).relative_to(ROOT)}:{example.line}"


def failure(example: Example, e: BaseException) -> BlockFailed:
    """What `e`, raised by the block, is reported as: the block's file and line, the line that raised."""
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == example.path]
    at = f", line {lines[-1]}" if lines else ""
    return BlockFailed(f"the block at {where(example)} fails{at}: {type(e).__name__}: {e}")


class DocsTestParser:
    """`<!-- docs-test: real-engines -->`: what the next block needs, as a region of its own."""

    def __init__(self) -> None:
        self.lexer = DirectiveInHTMLCommentLexer("docs-test", arguments=r"[\w-]+")

    def __call__(self, document: Any) -> Iterator[Region]:
        for lexed in self.lexer(document):
            need = lexed.lexemes["arguments"].strip()
            if need != REAL_ENGINES:
                raise ValueError(f"{document.path}: docs-test: unknown need {need!r} (known: {REAL_ENGINES})")
            yield Region(lexed.start, lexed.end, need, None)


def blocks(evaluator: Callable[[Example], Any]) -> Iterator[tuple[Example, str | None]]:
    """Every Python block of the documents, in order, with what it needs (None, or `REAL_ENGINES`);
    `example.evaluate()` calls `evaluator`. One namespace per document, shared by its blocks."""
    sybil = Sybil(parsers=[CodeBlockParser(language="python", evaluator=evaluator), DocsTestParser()])
    for path in DOCUMENTS:
        need = None
        for example in sybil.parse(path).examples():
            if example.region.evaluator is None:
                need = example.parsed
                continue
            yield example, need
            need = None


class Learner(torch.nn.Module):
    """A learner's model as far as the docs use it: the tiny model's parameters by their HF names."""

    def __init__(self, state: dict[str, torch.Tensor]):
        super().__init__()
        for name, tensor in state.items():
            owner: torch.nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=tensor.is_floating_point()))


def tiny_learner() -> Learner:
    """The reader's `model`: the embedded tiny model's weights as a learner holds them."""
    from rollout.tiny import resolve_model_path

    model_dir = resolve_model_path("tiny", 0)
    return Learner(load_file(str(next(model_dir.glob("*.safetensors")))))
