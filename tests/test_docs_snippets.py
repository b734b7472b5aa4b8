"""The Python blocks of README.md and docs/guides/*.md run, in the order they appear, each
document's blocks in one namespace and on one event loop (top-level `await` and `async with` work,
as in a notebook). Sybil finds the blocks (visible fences and `<!-- invisible-code-block: python
-->` comments, which set up or finish what a visible block leaves to the reader); a failing block
names its file and line, and the line inside it that raised.

Blocks that need only the API run here on fake engines (`tests.support.fakes.FakePool` stands in
for the Ray/vLLM pool `RolloutEngine` starts) with the embedded tiny model's tokenizer and weights.
The reader's own objects a block leaves undefined come from `reader_objects`: `prompts`, `model`
(the tiny model's parameters), `optimizer`, `policy_loss`, `learner_logprobs`, the trackers
`wandb`, `mlflow` and `writer`, and the reward function `my_task.rewards:score`.

A block that needs real engines follows the comment `<!-- docs-test: real-engines -->`; it gets
the `real_engines` mark and is skipped in the unit tier (the integration tier runs such blocks on
its engines).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import sys
import traceback
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from sybil import Example, Region, Sybil
from sybil.parsers.markdown import CodeBlockParser
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer

from tests.support.fakes import FakePool

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
TIMEOUT = 60  # seconds a block may run on fake engines; only reached when it is about to fail
REAL_ENGINES = "real-engines"


class BlockFailed(Exception):
    """A docs block raised; the message names the document's file and line."""


def run_block(example: Example) -> None:
    """Run one block as a notebook cell would: top-level await allowed, on the document's loop."""
    source = "\n" * (example.line + example.parsed.line_offset) + example.parsed  # tracebacks: the doc's lines
    where = f"{Path(example.path).relative_to(ROOT)}:{example.line}"
    try:
        code = compile(source, example.path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
        result = eval(code, example.namespace)
        if inspect.iscoroutine(result):
            example.namespace["__loop__"].run_until_complete(asyncio.wait_for(result, TIMEOUT))
    except Exception as e:
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == example.path]
        at = f", line {lines[-1]}" if lines else ""
        raise BlockFailed(f"the block at {where} fails{at}: {type(e).__name__}: {e}") from e


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


SYBIL = Sybil(parsers=[CodeBlockParser(language="python", evaluator=run_block), DocsTestParser()])


def _blocks() -> Iterator[Any]:
    for path in DOCUMENTS:
        need = None
        for example in SYBIL.parse(path).examples():
            if example.region.evaluator is None:
                need = example.parsed
                continue
            marks = []
            if need == REAL_ENGINES:
                marks = [pytest.mark.real_engines, pytest.mark.skip(reason="needs real engines: the integration tier")]
            yield pytest.param(example, id=f"{path.relative_to(ROOT)}:{example.line}", marks=marks)
            need = None


BLOCKS = list(_blocks())


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


def learner_logprobs(model: torch.nn.Module, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """Stands in for the learner's forward pass: the behaviour logprobs, with a gradient to `model`."""
    anchor = sum(p.float().sum() for p in model.parameters() if p.requires_grad) * 0.0
    return t["logprobs"].float() + anchor


def policy_loss(model: torch.nn.Module, t: dict[str, torch.Tensor]) -> torch.Tensor:
    return -(learner_logprobs(model, t) * t["loss_mask"]).sum() / t["loss_mask"].sum().clamp(min=1)


def score(prompt: Any, trajectory: Any) -> float:
    return float(len(trajectory.token_ids) % 2)


class Held:
    """Async context managers a document keeps open across its blocks (`engine = await
    hold(RolloutEngine(...))` ... `await release(engine)`): each is entered and exited by one task
    of the document's loop, as anyio's cancel scopes require."""

    def __init__(self) -> None:
        self._open: dict[int, tuple[asyncio.Event, asyncio.Task]] = {}

    async def hold(self, cm: Any) -> Any:
        entered: asyncio.Future = asyncio.get_running_loop().create_future()
        done = asyncio.Event()

        async def keep() -> None:
            try:
                async with cm as value:
                    entered.set_result(value)
                    await done.wait()
            except BaseException as e:
                if not entered.done():
                    entered.set_exception(e)
                raise

        task = asyncio.create_task(keep())
        value = await entered
        self._open[id(value)] = (done, task)
        return value

    async def release(self, value: Any) -> None:
        done, task = self._open.pop(id(value))
        done.set()
        await task


class Tracker:
    """`wandb`, `mlflow` or a TensorBoard `SummaryWriter`, as far as the docs call them: it keeps what
    it is given, which must be numbers."""

    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []

    def log(self, figures: dict[str, float], step: int | None = None) -> None:
        assert all(isinstance(v, (int, float)) for v in figures.values()), figures
        self.logged.append(figures)

    log_metrics = log

    def add_scalar(self, name: str, value: float, step: int | None = None) -> None:
        self.log({name: value}, step)


@pytest.fixture(scope="module")
def reader_objects() -> Iterator[dict[str, Any]]:
    """What a block leaves to its reader, and engines that are fakes: `RolloutEngine` (and the
    facades over it) start a `FakePool` instead of Ray/vLLM engines; relative paths resolve from
    the repository root."""
    from policies.tiny import resolve_model_path

    model_dir = resolve_model_path("tiny", 0)
    state = load_file(str(next(model_dir.glob("*.safetensors"))))

    async def start_fakes(cfg: Any, model_path: str) -> FakePool:
        return FakePool(cfg.engines.count)

    rewards = types.ModuleType("my_task.rewards")
    rewards.score = score  # type: ignore[attr-defined]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("rollout.engine.start_pool", start_fakes)
        mp.setitem(sys.modules, "my_task", types.ModuleType("my_task"))
        mp.setitem(sys.modules, "my_task.rewards", rewards)
        mp.chdir(ROOT)
        model = Learner(state)
        yield {
            "prompts": [[5 + i, 6 + i, 7 + i] for i in range(8)],  # one batch of 8 groups
            "model": model,
            "optimizer": torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
            "policy_loss": policy_loss,
            "learner_logprobs": learner_logprobs,
            "wandb": Tracker(),
            "mlflow": Tracker(),
            "writer": Tracker(),
        }
    for example in BLOCKS:
        loop = example.values[0].namespace.pop("__loop__", None)
        if loop is not None:
            loop.close()


@pytest.mark.parametrize("example", BLOCKS)
def test_the_docs_block_runs(example: Example, reader_objects: dict[str, Any]) -> None:
    namespace = example.namespace
    if "__loop__" not in namespace:
        held = Held()
        namespace.update(reader_objects, __loop__=asyncio.new_event_loop(), hold=held.hold, release=held.release)
    failed = None
    try:
        example.evaluate()
    except BlockFailed as e:
        failed = str(e)
    if failed:
        pytest.fail(failed, pytrace=False)
