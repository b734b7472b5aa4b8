"""The docs blocks that need real engines (`<!-- docs-test: real-engines -->`, found as
tests/test_docs_snippets.py finds every block: `tests.support.docs_blocks`) run here, on the module's
shared engines of the default kind, their text exactly as readers see it.

Each runs in a worker thread, as a script would (the OpenAI client and vLLM's trainer block), with
the names it leaves to its reader:
- `openai`: the SDK, whose `OpenAI(base_url=..., api_key=...)` is the real client sent to this
  module's server (`engine.serve(port=0, api_key="KEY")`) instead of the host and port the block
  names; the key is the block's own, which the server checks.
- `engine`: the module's engine; `weight_sync_client()`, which the docs call on the engine's loop,
  runs there.
- `model`: the tiny model's parameters, as a learner holds them; `messages`: one user turn.
"""

from __future__ import annotations

import asyncio
import inspect
import types
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.from_thread
import openai
import pytest
from sybil import Example

from rollout import RolloutEngine
from tests.support.docs_blocks import REAL_ENGINES, BlockFailed, blocks, compiled, failure, tiny_learner, where

TIMEOUT = 300  # seconds an HTTP request of a block may take; only reached when it is about to fail


def run_in_thread(example: Example) -> None:
    """Run one block in a worker thread of the test's loop; a top-level await runs on that loop."""
    try:
        result = eval(compiled(example), example.namespace)
        if inspect.iscoroutine(result):
            anyio.from_thread.run(asyncio.wait_for, result, TIMEOUT)
    except Exception as e:
        raise failure(example, e) from e


BLOCKS = [
    pytest.param(example, id=where(example), marks=pytest.mark.real_engines)
    for example, need in blocks(run_in_thread)
    if need == REAL_ENGINES
]


class OpenAIModule(types.ModuleType):
    """`openai` as the served blocks use it: `OpenAI(...)` talks to `url`, whatever host the block names."""

    def __init__(self, url: str):
        super().__init__("openai")
        self.url = url
        self.clients: list[openai.OpenAI] = []

    def OpenAI(self, *, base_url: str, api_key: str, **kwargs: Any) -> openai.OpenAI:  # noqa: N802 -- the SDK's name
        client = openai.OpenAI(
            base_url=self.url + urlsplit(base_url).path, api_key=api_key, max_retries=0, timeout=TIMEOUT, **kwargs
        )
        self.clients.append(client)
        return client

    def __getattr__(self, name: str) -> Any:
        return getattr(openai, name)


class OnLoop:
    """The engine as a block in a worker thread sees it: what the docs call on the engine's loop runs there."""

    def __init__(self, engine: RolloutEngine):
        self._engine = engine

    def weight_sync_client(self) -> Any:
        return anyio.from_thread.run_sync(self._engine.weight_sync_client)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


@pytest.fixture(scope="module")
async def served(engine: RolloutEngine) -> Any:
    return await engine.serve(port=0, api_key="KEY")


@pytest.fixture
def reader_objects(engine: RolloutEngine, served: Any) -> Iterator[dict[str, Any]]:
    module = OpenAIModule(served.url)
    yield {
        "openai": module,
        "engine": OnLoop(engine),
        "model": tiny_learner(),
        "messages": [{"role": "user", "content": "hi"}],
    }
    for client in module.clients:
        client.close()


@pytest.mark.parametrize("example", BLOCKS)
async def test_the_docs_block_runs_on_real_engines(example: Example, reader_objects: dict[str, Any]) -> None:
    example.namespace.update(reader_objects)
    failed = None
    try:
        await anyio.to_thread.run_sync(example.evaluate)
    except BlockFailed as e:
        failed = str(e)
    finally:
        if (trainer := example.namespace.pop("trainer", None)) is not None:  # vLLM's trainer: its gloo group
            await anyio.to_thread.run_sync(trainer.shutdown)
    if failed:
        pytest.fail(failed, pytrace=False)
