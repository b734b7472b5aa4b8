"""The Python blocks of README.md and docs/guides/*.md run, in the order they appear, each
document's blocks in one namespace and on one event loop (top-level `await` and `async with` work,
as in a notebook). Sybil finds the blocks (visible fences and `<!-- invisible-code-block: python
-->` comments, which set up or finish what a visible block leaves to the reader); a failing block
names its file and line, and the line inside it that raised (`tests.support.docs_blocks`).

Blocks that need only the API run here on fake engines (`tests.support.fakes.FakePool` stands in
for the Ray/vLLM pool `RolloutEngine` starts) with the embedded tiny model's tokenizer and weights.
The reader's own objects a block leaves undefined come from `reader_objects`: `prompts`, `model`
(the tiny model's parameters), `optimizer`, `policy_loss`, `learner_logprobs`, the trackers
`wandb`, `mlflow` and `writer`, and the reward function `my_task.rewards:score`.

A block that follows the comment `<!-- docs-test: real-engines -->` is not run here: it needs a
server on real engines or vLLM's weight transfer into them, and
tests/integration/test_docs_blocks.py runs it on the integration tier's shared engines.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from sybil import Example

from tests.support.docs_blocks import REAL_ENGINES, ROOT, BlockFailed, blocks, compiled, failure, tiny_learner, where
from tests.support.fakes import FakePool

TIMEOUT = 60  # seconds a block may run on fake engines; only reached when it is about to fail


def run_block(example: Example) -> None:
    """Run one block as a notebook cell would: top-level await allowed, on the document's loop."""
    try:
        result = eval(compiled(example), example.namespace)
        if inspect.iscoroutine(result):
            example.namespace["__loop__"].run_until_complete(asyncio.wait_for(result, TIMEOUT))
    except Exception as e:
        raise failure(example, e) from e


BLOCKS = [pytest.param(example, id=where(example)) for example, need in blocks(run_block) if need != REAL_ENGINES]


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

    async def start_fakes(cfg: Any, model_path: str) -> FakePool:
        return FakePool(cfg.engines.count)

    rewards = types.ModuleType("my_task.rewards")
    rewards.score = score  # type: ignore[attr-defined]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("rollout.engine.start_pool", start_fakes)
        mp.setitem(sys.modules, "my_task", types.ModuleType("my_task"))
        mp.setitem(sys.modules, "my_task.rewards", rewards)
        mp.chdir(ROOT)
        model = tiny_learner()
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
    """A block runs once per process, after its document's blocks before it: where pytest-xdist
    sent those to another worker, they run here first, as this block's setup."""
    namespace = example.namespace
    if "__loop__" not in namespace:
        held = Held()
        namespace.update(reader_objects, __loop__=asyncio.new_event_loop(), hold=held.hold, release=held.release)
    outcomes: dict[int, str | None] = namespace.setdefault("__outcomes__", {})  # line -> failure, or None
    for block in [b.values[0] for b in BLOCKS if b.values[0].path == example.path]:
        if block.line > example.line or block.line in outcomes:
            continue
        try:
            block.evaluate()
            outcomes[block.line] = None
        except BlockFailed as e:
            outcomes[block.line] = str(e)
    if failed := outcomes[example.line]:
        pytest.fail(failed, pytrace=False)
