"""The Ray edge without Ray: real `RayEngine` handles (actors/handle.py) over real `VLLMPolicy`
objects on a fake vLLM (`tests.support.fake_vllm`), joined by a local stand-in of a Ray actor handle.

Every group crosses the wire as it does in production: msgpack-encoded `Request`s in batched
submit frames over the real zmq data path (`actors.channel`), msgpack `GroupResult`s back in
results frames; the engine's `serve` call goes through the stand-in. What a real actor handle adds (a
process boundary, pickling of other calls' arguments) is not modelled; what can fail in encoding,
in a call, in a callback, is the real code.
"""

from __future__ import annotations

import asyncio
import inspect
import random
from typing import Any

from actors.channel import Channel
from actors.handle import RayEngine
from policies.vllm_policy import VLLMPolicy
from rollout.config import Config
from tests.support.fake_vllm import FakeVllm
from tests.support.fakes import text_ids


class TextVllm(FakeVllm):
    """The fake vLLM with the tiny model's byte-level tokenizer, so text prompts run too."""

    @staticmethod
    def tokenize(text: str) -> list[int]:
        return text_ids(text)


class LocalActor:
    """What `RayEngine` uses of an actor handle: `actor.method.remote(*args)` -> an awaitable.
    `fail[name]`: that call raises it when made (as `.remote()` does when Ray refuses a call);
    `made`: the names of the calls made, in order (what went through Ray, not the data path)."""

    def __init__(self, target: Any):
        self.target = target
        self.fail: dict[str, BaseException] = {}
        self.made: list[str] = []

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)


class _Method:
    def __init__(self, actor: LocalActor, name: str):
        self.actor, self.name = actor, name

    def remote(self, *args: Any) -> asyncio.Future:
        self.actor.made.append(self.name)
        if (error := self.actor.fail.get(self.name)) is not None:
            raise error
        result = getattr(self.actor.target, self.name)(*args)
        if inspect.isawaitable(result):
            return asyncio.ensure_future(result)
        done = asyncio.get_running_loop().create_future()
        done.set_result(result)
        return done


class WirePool:
    """The `EnginePool` protocol over wire engines. Build it with `await WirePool.start(cfg, n)`."""

    def __init__(self, policies: list[VLLMPolicy]):
        self.policies = policies
        self.actors = [LocalActor(p) for p in policies]
        self.channel = Channel()
        self.engines = [RayEngine(a, i, self.channel) for i, a in enumerate(self.actors)]

    @classmethod
    async def start(cls, cfg: Config, n: int = 1, seed: int = 0) -> WirePool:
        policies = [
            VLLMPolicy(cfg, "", i, frontend=TextVllm(random.Random(seed + i), chunk=4, capacity=64)) for i in range(n)
        ]
        for p in policies:
            await p.ready()
        return cls(policies)

    def share(self, payload: object) -> object:
        return payload

    async def shutdown(self) -> None:
        for engine in self.engines:
            engine.close()
        self.channel.close()
        for p in self.policies:
            p.cancel(list(p._groups))
            p._vllm.shutdown()
