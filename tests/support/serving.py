"""`rollout serve` over fake engines: its config and a served engine with the clients that talk to
it (the real `openai` client and httpx)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import httpx
import openai

from rollout.config import Config, load_config
from rollout.engine import RolloutEngine
from tests.support.fakes import FakePool

TIMEOUT = 10  # seconds: an HTTP client's; a served engine's whole life gets 3 times that


def serve_cfg(*overrides: str) -> Config:
    """The tiny model (its real tokenizer and chat template), 2 engines, 6 tokens a sample, then `overrides`."""
    return load_config(None, ["model.path=tiny", "sampling.max_tokens=6", "engines.count=2", "model.max_model_len=256",
                              "logging.level=error", *overrides])  # fmt: skip


class Served:
    """A served engine, its server, its fake pool, and two clients of it: `client` (openai) and `http` (httpx)."""

    def __init__(self, engine, server, pool):
        self.engine, self.server, self.pool = engine, server, pool
        self.client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key or "none", max_retries=0)
        self.http = httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT)


@contextlib.asynccontextmanager
async def served(*overrides: str, api_key: str | None = None, pool: FakePool | None = None) -> AsyncIterator[Served]:
    """`engine.serve()` on `serve_cfg(*overrides)` over `pool` (2 fake engines by default), its
    clients closed on the way out."""
    p = pool or FakePool(2)
    with anyio.fail_after(TIMEOUT * 3):
        async with RolloutEngine(serve_cfg(*overrides), pool=p) as engine:
            server = await engine.serve(port=0, api_key=api_key)
            s = Served(engine, server, p)
            try:
                yield s
            finally:
                await s.http.aclose()
                await s.client.close()
