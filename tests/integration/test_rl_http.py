"""vLLM's RL routes on a real `rollout serve` (2 real CPU engines of the tiny model in Ray actors,
its HTTP server on loopback), driven as a learner written for vLLM's server drives vLLM: vLLM's own
`HTTPVLLMWeightSyncClient` under vLLM's `WeightTransferTrainerFactory` (our gloo trainer engine),
unmodified, between vLLM's `/pause` and `/resume`.

- Each round: chat requests in flight, `/pause` (vLLM's default mode, abort; then keep), a chat
  request sent while paused, the full update round over HTTP (`trainer.send_weights()`: start,
  update with the gloo bytes, finish), `/resume`. The request sent while paused runs entirely on
  the new epoch; the ones in flight keep exact, non-decreasing epochs; every later one carries the
  new epoch. What loaded is the learner's bytes: greedy tokens and logprobs equal those of the
  same weights pushed through the object store.
- An engine killed while the learner holds `/pause` restarts paused, and the `/resume` resumes it.
- `/is_paused`, `/weight_info`, `/get_world_size` and the round's calls answer with vLLM's
  response bodies (`vllm/entrypoints/rl/online/api_router.py`); ours add `epoch`.
- A learner's mistakes cost its call, never the engines: an init naming a rendezvous nobody
  serves is answered at once and the engines keep generating while their rendezvous runs (its
  failure costs the learner its next round, named with the address), a round that leaves
  `lm_head.weight` out is refused at its update call before any engine stages a byte, a learner
  SIGKILLed mid-transfer costs its round (called off, every engine on the epoch before); chats
  are answered meanwhile, no engine restarts, and a correct learner's round goes on.
Nothing here waits on a clock or on engine load: each wait is on an HTTP answer or a finished
task, and each has a timeout that fails the test with what it was waiting for.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
import requests
from safetensors.torch import load_file

from policies.gloo_transfer import GlooTrainerInitInfo, StateDictSource
from rollout import RolloutEngine
from tests.support.engines import held, integration_config
from tests.support.oracle_runs import kill, random_weights

TIMEOUT = 120  # seconds for any one HTTP call or wait; only reached when the test is about to fail
LONG = {"max_tokens": 48, "min_tokens": 48, "temperature": 0.8}  # in flight across the update
GREEDY = {"max_tokens": 12, "temperature": 0.0}


@pytest.fixture(scope="module")
async def served(pools) -> AsyncIterator[tuple[RolloutEngine, Any]]:
    """One start of the engines and their server for both tests (an engine start is the slow part),
    with the restart test's health checks every 0.5 s and restarts after 0.5 s. The restart test
    runs first: the update test then drives an engine that was killed and restarted."""
    cfg = integration_config("engines.count=2", "weight_sync.timeout_s=20",
                             "engines.health_interval_s=0.5", "engines.restart_backoff_s=0.5")  # fmt: skip
    async for engine in held(lambda: pools.engine(cfg)):
        yield engine, await engine.serve(port=0)


@contextlib.asynccontextmanager
async def client(server: Any) -> AsyncIterator[tuple[httpx.AsyncClient, list[asyncio.Task]]]:
    """A client, and a list for the test's request tasks: those still running when the test fails
    are cancelled before the client closes."""
    async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as http:
        tasks: list[asyncio.Task] = []
        try:
            yield http, tasks
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def within(what: str, awaitable: Any) -> Any:
    """`awaitable`'s result, or a failure naming `what` after TIMEOUT seconds (never a hang)."""
    try:
        return await asyncio.wait_for(awaitable, TIMEOUT)
    except TimeoutError:
        raise AssertionError(f"no answer within {TIMEOUT} s: {what}") from None


async def ok(what: str, call: Any) -> dict:
    r = await within(what, call)
    assert r.status_code == 200, (what, r.status_code, r.text)
    return r.json()


async def chat(http: httpx.AsyncClient, model: str, text: str, sampling: dict) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": text}], **sampling}
    return (await ok(f"chat {text!r}", http.post("/v1/chat/completions", json=body)))["choices"][0]["message"]


def epochs(message: dict) -> list[int]:
    """The epoch of each generated token, from the message's `rollout.policy_epochs` runs."""
    runs, n = message["rollout"]["policy_epochs"], len(message["generation_token_ids"])
    return [e for k, (start, e) in enumerate(runs) for _ in range(start, runs[k + 1][0] if k + 1 < len(runs) else n)]


def learner(url: str, weights: dict) -> tuple[Any, StateDictSource]:
    """A learner written for vLLM's server: vLLM's HTTP client and trainer factory, as they come."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    world = httpx.get(f"{url}/get_world_size", timeout=TIMEOUT).json()["world_size"]
    client, source = HTTPVLLMWeightSyncClient(url, timeout=TIMEOUT), StateDictSource(weights)
    init = GlooTrainerInitInfo(world_size=1 + world, rank=0, timeout_s=60)
    return WeightTransferTrainerFactory.trainer_init(init, client=client, source=source), source


async def test_a_real_engine_restarted_while_the_learner_holds_pause_comes_back_paused(served):
    engine, server = served
    async with client(server) as (http, tasks):
        runner = engine._scheduler.runner
        r = await within("POST /pause", http.post("/pause", params={"mode": "keep"}))
        assert r.json() == {"status": "paused"}
        old = runner.engines[1]
        await within("killing engine 1", kill(old, "actor"))

        async def back() -> None:  # a state the restart sets, polled; the wait is bounded by within()
            while runner.engines[1] is old or not runner.loads[1].healthy:
                await asyncio.sleep(0.1)

        await within("engine 1 restarted and back in rotation", back())
        assert await within("engine 1's vLLM is_paused", runner.engines[1].call("is_paused")) is True
        sent = asyncio.ensure_future(chat(http, server.model, "sent while paused", GREEDY))
        tasks.append(sent)
        r = await within("POST /resume", http.post("/resume"))
        assert r.json() == {"status": "resumed"}
        assert [await within("is_paused", e.call("is_paused")) for e in runner.engines] == [False, False]
        assert (await within("the request sent while paused", sent))["generation_token_ids"]


async def test_vllms_http_client_updates_a_real_rollout_serve_between_pause_and_resume(served):
    engine, server = served
    async with client(server) as (http, tasks):
        get = lambda path, **kw: ok(f"GET {path}", http.get(path, **kw))  # noqa: E731
        post = lambda path, **kw: ok(f"POST {path}", http.post(path, **kw))  # noqa: E731
        assert await get("/get_world_size") == {"world_size": 2}  # 2 engines x 1 model worker
        assert await get("/get_world_size", params={"include_dp": "false"}) == {"world_size": 1}
        assert await get("/is_paused") == {"is_paused": False}
        s = engine.epoch  # the shared engines' epoch: this test's rounds make s + 1, s + 2, s + 3
        assert await get("/weight_info") == {"weight_version": str(s), "epoch": s}
        base = load_file(f"{engine.model_path}/model.safetensors")
        t, source = await within("trainer_init over HTTP", anyio.to_thread.run_sync(learner, server.url, base))

        for epoch, mode in ((s + 1, None), (s + 2, "keep")):  # None: vLLM's default, abort
            weights = random_weights(base, seed=40 + epoch)
            flying = [asyncio.ensure_future(chat(http, server.model, f"in flight {epoch}.{i}", LONG)) for i in range(2)]
            tasks += flying
            assert await post("/pause", params={"mode": mode} if mode else {}) == {"status": "paused"}
            assert await get("/is_paused") == {"is_paused": True}
            paused = asyncio.ensure_future(chat(http, server.model, f"sent while paused {epoch}", LONG))
            tasks.append(paused)
            source.update(weights)
            await within(f"send_weights, round {epoch}", anyio.to_thread.run_sync(t.send_weights))
            assert engine.epoch == epoch and engine.weight_updates[-1].failed == []
            assert await get("/is_paused") == {"is_paused": True}, "the update's own resume leaves the learner's pause"
            assert not paused.done(), "a request ran while the learner held /pause"
            assert await get("/weight_info") == {"weight_version": str(epoch), "epoch": epoch}
            assert await post("/resume") == {"status": "resumed"}
            assert await get("/is_paused") == {"is_paused": False}
            assert epochs(await within("the request sent while paused", paused)) == [epoch] * LONG["max_tokens"]
            for m in await within("the requests in flight", asyncio.gather(*flying)):
                e = epochs(m)
                assert len(e) == LONG["max_tokens"] and e == sorted(e) and set(e) <= {epoch - 1, epoch}, e
            after = await chat(http, server.model, f"after {epoch}", LONG)
            assert epochs(after) == [epoch] * LONG["max_tokens"] and after["policy_epoch"] == [[[0, epoch]]]

        label = await post("/update_weight_version", json={"new_version": "step-2"})
        assert label == {"success": True, "new_version": "step-2", "epoch": s + 2}
        assert await get("/weight_info") == {"weight_version": "step-2", "epoch": s + 2}
        via_http = await chat(http, server.model, "greedy", GREEDY)
        assert await within("update_weights through the object store", engine.update_weights(weights)) == s + 3
        via_store = await chat(http, server.model, "greedy", GREEDY)
        same = ("generation_token_ids", "generation_log_probs")
        assert [via_http[k] for k in same] == [via_store[k] for k in same], "the learner's bytes loaded exactly"
        assert set(epochs(via_http)) == {s + 2} and set(epochs(via_store)) == {s + 3}
        assert await post("/shutdown_weight_transfer_engine") == {"message": "Weight transfer shut down"}
        await anyio.to_thread.run_sync(t.shutdown)


NOWHERE = {"master_address": "127.0.0.1", "master_port": 9, "rank_offset": 1, "world_size": 3}  # nobody serves it


async def a_correct_round(engine: RolloutEngine, server: Any, seed: int) -> None:
    """A correct learner's init and round over HTTP: the engines serve the next epoch."""
    s, base = engine.epoch, load_file(f"{engine.model_path}/model.safetensors")
    t, source = await within("trainer_init over HTTP", anyio.to_thread.run_sync(learner, server.url, base))
    source.update(random_weights(base, seed=seed))
    await within("the correct learner's round", anyio.to_thread.run_sync(t.send_weights))
    # the next epoch, past any a called-off round allocated (an allocated epoch is never used again)
    assert engine.epoch > s and engine.weight_updates[-1].failed == []
    await anyio.to_thread.run_sync(t.shutdown)


def full_round(model_path: str) -> dict:
    """The update info of a round naming every tensor of the model, as vLLM's trainer sends it."""
    base = load_file(f"{model_path}/model.safetensors")
    return {"names": list(base), "dtype_names": [str(v.dtype).removeprefix("torch.") for v in base.values()],
            "shapes": [list(v.shape) for v in base.values()]}  # fmt: skip


async def test_an_init_naming_a_rendezvous_nobody_serves_leaves_the_engines_generating(served):
    """vLLM's init runs inside each engine core: ours answers at once (200: the engines took the
    info, before their rendezvous is known), each worker's rendezvous running in a thread of its
    own, and the chat sent with it is answered. The learner's next round fails at its finish
    (whose settle waits for the rendezvous, within weight_sync.timeout_s), naming the address
    and the cap, with no engine loading, every engine in rotation on the epoch before; no
    engine restarts, and a correct learner's init and round succeed."""
    engine, server = served
    runner = engine._scheduler.runner
    before, s = list(runner.engines), engine.epoch
    async with client(server) as (http, tasks):
        post = lambda path, **kw: within(f"POST {path}", http.post(path, **kw))  # noqa: E731
        bad = asyncio.ensure_future(post("/init_weight_transfer_engine", json={"init_info": NOWHERE}))
        meanwhile = asyncio.ensure_future(chat(http, server.model, "sent with the bad init", GREEDY))
        tasks += [bad, meanwhile]
        r = await bad
        assert r.status_code == 200, r.text  # answered before the rendezvous is known
        assert (await within("the chat sent with the bad init", meanwhile))["generation_token_ids"]
        assert (await post("/start_weight_update")).status_code == 200
        r = await post("/update_weights", json={"update_info": full_round(engine.model_path)})
        assert r.status_code == 200, r.text  # the engines take the round: no byte can come
        r = await post("/finish_weight_update")
        assert r.status_code >= 400 and "could not join the learner's group at 127.0.0.1:9" in r.text, r.text
        assert "capped at weight_sync.timeout_s=20" in r.text and f"every engine serves epoch {s}" in r.text, r.text
        assert engine.epoch == s and all(load.healthy for load in runner.loads)
        assert (await chat(http, server.model, "after the bad init", GREEDY))["generation_token_ids"]
        await a_correct_round(engine, server, seed=60)
        assert all(a is b for a, b in zip(runner.engines, before)), "an engine restarted"


async def test_a_round_without_lm_head_is_refused_before_staging_and_chats_are_answered(served):
    """The commonest learner bug, a state dict without its (untied here) `lm_head.weight`: vLLM's
    trainer sends start, then update, which answers 400 naming the tensor before any engine starts
    or stages; the chats in flight are answered on the epoch before, no engine restarts, and the
    same learner's next round loads."""
    engine, server = served
    runner = engine._scheduler.runner
    before, s = list(runner.engines), engine.epoch
    async with client(server) as (http, tasks):
        base = load_file(f"{engine.model_path}/model.safetensors")
        t, source = await within("trainer_init over HTTP", anyio.to_thread.run_sync(learner, server.url, base))
        flying = [asyncio.ensure_future(chat(http, server.model, f"in flight {i}", LONG)) for i in range(2)]
        tasks += flying
        source.update({n: v for n, v in random_weights(base, seed=70).items() if n != "lm_head.weight"})
        with pytest.raises(requests.HTTPError) as e:  # vLLM's HTTP client posts with requests
            await within("the round without lm_head.weight", anyio.to_thread.run_sync(t.send_weights))
        r = e.value.response
        assert r.status_code == 400 and "/update_weights" in str(r.url), (r.url, r.text)
        assert "left out lm_head.weight" in r.text and "no engine changed" in r.text, r.text
        assert engine.epoch == s and all(a is b for a, b in zip(runner.engines, before))
        for m in await within("the chats in flight", asyncio.gather(*flying)):
            assert epochs(m) == [s] * LONG["max_tokens"]
        source.update(random_weights(base, seed=71))
        await within("the same learner's next round", anyio.to_thread.run_sync(t.send_weights))
        assert engine.epoch == s + 1 and engine.weight_updates[-1].failed == []
        assert (await chat(http, server.model, "after", GREEDY))["policy_epoch"] == [[[0, s + 1]]]
        assert all(a is b for a, b in zip(runner.engines, before)), "an engine restarted"
        await anyio.to_thread.run_sync(t.shutdown)


# A learner process written for vLLM's server that dies mid-transfer: its source gives the first
# tensor, says so, and blocks; the test SIGKILLs it there (after start and update were answered,
# with the engines receiving its bytes).
DYING_LEARNER = """
import sys, time
import httpx
from safetensors.torch import load_file
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from policies.gloo_transfer import GlooTrainerInitInfo, StateDictSource

url, model = sys.argv[1], sys.argv[2]

class Dying(StateDictSource):
    def __iter__(self):
        for k, (name, tensor) in enumerate(super().__iter__()):
            if k == 1:
                print("MID", flush=True)
                time.sleep(3600)
            yield name, tensor

world = httpx.get(f"{url}/get_world_size", timeout=60).json()["world_size"]
weights = {n: v + 0.01 for n, v in load_file(f"{model}/model.safetensors").items()}
t = WeightTransferTrainerFactory.trainer_init(
    GlooTrainerInitInfo(world_size=1 + world, rank=0, timeout_s=60),
    client=HTTPVLLMWeightSyncClient(url, timeout=60), source=Dying(weights))
t.send_weights()
"""


async def test_a_learner_killed_mid_transfer_costs_its_round_and_chats_are_answered_throughout(served):
    """A learner SIGKILLed with its round's bytes on the way: the chats sent before and after the
    kill are answered on the epoch before, the round is called off (no call of the learner's for
    weight_sync.timeout_s) with every engine in rotation on that epoch, no engine restarts, and a
    correct learner's round loads after it."""
    import subprocess
    import sys

    engine, server = served
    runner = engine._scheduler.runner
    before, s = list(runner.engines), engine.epoch
    proc = subprocess.Popen([sys.executable, "-c", DYING_LEARNER, server.url, engine.model_path],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        async with client(server) as (http, tasks):
            flying = [asyncio.ensure_future(chat(http, server.model, f"in flight {i}", LONG)) for i in range(2)]
            tasks += flying
            line = await within("the learner mid-transfer", anyio.to_thread.run_sync(proc.stdout.readline))
            assert line.strip() == "MID", line
            proc.kill()
            after_kill = asyncio.ensure_future(chat(http, server.model, "after the kill", LONG))
            tasks.append(after_kill)
            for m in await within("the chats around the kill", asyncio.gather(*flying, after_kill)):
                assert epochs(m) == [s] * LONG["max_tokens"]

            async def called_off() -> None:  # no call of the learner's for weight_sync.timeout_s
                while engine.weight_transfer().round is not None:
                    await asyncio.sleep(0.2)

            await within("the round called off", called_off())
            assert engine.epoch == s and all(load.healthy for load in runner.loads)
            await a_correct_round(engine, server, seed=80)
            assert all(a is b for a, b in zip(runner.engines, before)), "an engine restarted"
    finally:
        proc.kill()
        proc.wait()
