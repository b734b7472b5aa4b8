"""`rollout serve` in several front-end processes (`serve.api_servers`) over one backend, with fake
engines (the backend, its zmq calls, the servers and the processes are the real ones).

Two front ends in this process, each over its own `RemoteBackend` to one `DeskService`, show that
whichever front end takes a request, what must be one stays one: a conversation's turns continue
one session on one engine, an episode collects turns served by both and is rewarded through either,
`/abort_requests` on one reaches a request on the other, a client gone from one aborts its engine
request, errors cross in their own shape, /metrics counts every front end's requests. Then real
processes: `engine.serve()` with `serve.api_servers=2`, one killed and started again, all gone
with the engine or with the driver's process."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import openai
import pytest

from rollout.engine import RolloutEngine
from rollout.errors import InvalidConfigError
from rollout.serve import Backend, Server, frontends
from rollout.serve.frontends import DeskService, RemoteBackend
from rollout.serve.prepare import served_chat
from tests.support.fakes import FakePool
from tests.support.serving import serve_cfg

TIMEOUT = 60
ROOT = Path(__file__).resolve().parents[1]


@contextlib.asynccontextmanager
async def two_front_ends(*overrides: str) -> AsyncIterator[tuple[RolloutEngine, FakePool, list[httpx.AsyncClient]]]:
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(serve_cfg(*overrides), pool=pool) as engine:
            chat = served_chat(engine.model_path, engine.cfg.model.max_model_len)
            service = DeskService(Backend(engine, chat.end_of_turn), lambda index, pid: None)
            service.start()
            servers, clients = [], []
            for _ in range(2):
                backend = RemoteBackend(service.address)
                server = Server(backend, engine.cfg, chat)
                await server.start(engine._tg, port=0)
                servers.append(server)
                clients.append(httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT))
            try:
                yield engine, pool, clients
            finally:
                for client in clients:
                    await client.aclose()
                for server in servers:
                    await server.stop()
                service.close()


def user(text: str) -> dict:
    return {"role": "user", "content": text}


async def test_a_conversation_and_an_episode_served_by_two_front_ends_are_one():
    async with two_front_ends() as (engine, pool, (a, b)):
        messages, turns = [user("first")], []
        for k, front in enumerate((a, b, a)):  # each turn through the other front end
            r = await front.post(
                "/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "episode_id": "ep"}
            )
            assert r.status_code == 200, r.text
            m = r.json()["choices"][0]["message"]
            turns.append(m)
            messages = [*messages, m, user(f"turn {k}")]
        for x, y in zip(turns, turns[1:]):
            before = x["prompt_token_ids"] + x["generation_token_ids"]
            assert y["prompt_token_ids"][: len(before)] == before
        assert len({t["rollout"]["engine_id"] for t in turns}) == 1  # one session: one engine, one cache salt
        assert len({r.cache_salt for e in pool.engines for r in e.requests}) == 1
        done = await b.post("/v1/episodes/ep/reward", json={"reward": 0.5})
        assert done.status_code == 200 and done.json()["turns"] == 3, done.text
        (episode,) = (await engine.next_group()).trajectories
        assert episode.reward == 0.5 and [t.token_ids for t in episode.turns] == [
            t["generation_token_ids"] for t in turns
        ]
        again = await a.post("/v1/episodes/ep/reward", json={"reward": 1})  # a retry, through the other front end
        assert again.status_code == 200 and again.json() == done.json()  # rewarded once, wherever: the first answer
        metrics = (await b.get("/metrics")).text
        assert 'rollout_http_requests_total{path="/v1/chat/completions",status="200"} 3.0' in metrics


async def test_a_stream_through_a_front_end_process_gets_its_tokens_as_the_engine_makes_them():
    """Streamed through a front end's backend (a socket to the driver): the first token's chunk arrives
    while the engine holds the rest, then the rest, the same answer as not streamed."""
    async with two_front_ends() as (engine, pool, (a, b)):
        body = {"messages": [user("s")], "max_tokens": 4, "return_token_ids": True}
        whole = (await b.post("/v1/chat/completions", json=body)).json()["choices"][0]
        gates = [e.block() for e in pool.engines]
        chunks = []
        async with a.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    if chunks[-1]["choices"][0].get("token_ids") and len(chunks) == 2:
                        assert sum(e.finished for e in pool.engines) == 1  # the first token, the engine holding
                        for gate in gates:
                            gate.set()
        ids = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
        assert ids == whole["message"]["generation_token_ids"] and len(chunks) >= 3
        assert chunks[-1]["choices"][0]["delta"]["policy_epoch"] == whole["message"]["policy_epoch"]


async def test_abort_on_one_front_end_and_a_client_gone_from_the_other_reach_the_engines():
    async with two_front_ends() as (engine, pool, (a, b)):
        gates = [e.block() for e in pool.engines]
        answers: dict[str, httpx.Response] = {}

        async def call(rid: str) -> None:
            body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3}, "request_id": rid}
            answers[rid] = await a.post("/inference/v1/generate", json=body)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, "x")
            while sum(e.inflight for e in pool.engines) < 1:
                await anyio.sleep(0.01)
            assert (await b.post("/abort_requests", json={"request_ids": ["x"]})).json() == {
                "status": "aborted",
                "aborted": 1,
            }
        assert (
            answers["x"].status_code == 499
            and answers["x"].json()["error"]["message"] == "aborted by POST /abort_requests"
        )
        async with anyio.create_task_group() as tg:  # a client of `b` goes away while the engine holds its request
            tg.start_soon(lambda: b.post("/v1/chat/completions", json={"messages": [user("x")]}))
            while sum(len(e.requests) for e in pool.engines) < 2:  # it reached an engine
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        while sum(e.cancelled for e in pool.engines) < 2:  # both engine requests aborted
            await anyio.sleep(0.01)
        for g in gates:
            g.set()


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        (
            "/v1/chat/completions",
            {"messages": [user("x")], "top_k": 2**40},
            400,
            "top_k",
        ),  # the engine's InvalidPromptError
        ("/v1/chat/completions", {"messages": [user("x")], "seed": 2**70}, 400, "seed"),  # no int msgpack carries
        (
            "/inference/v1/generate",
            {"token_ids": [5], "sampling_params": {"top_k": -(2**64)}},
            400,
            "sampling_params.top_k",
        ),
        ("/v1/episodes/none/reward", {"reward": 1}, 404, None),  # the backend's ApiError
        ("/v1/episodes/none/reward", {"reward": "high"}, 400, "reward"),
        ("/update_weight_version", {}, 400, "new_version"),
        ("/start_weight_update", {}, 409, None),  # out of order (no init); the backend's `start`, not the proxy's own
        ("/finish_weight_update", {}, 409, None),
        ("/v1/episodes/none/reward", {"reward": 2**70}, 400, None),  # values no msgpack carries, wherever they sit
        ("/init_weight_transfer_engine", {"init_info": {"x": [2**64]}}, 400, None),
    ],
)
async def test_errors_cross_from_the_desk_in_their_own_shape(path, body, status, param):
    async with two_front_ends() as (engine, pool, (a, b)):
        r = await b.post(path, json=body)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text


async def test_pause_through_one_front_end_is_seen_through_the_other():
    async with two_front_ends() as (engine, pool, (a, b)):
        assert (await a.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
        assert (await b.get("/is_paused")).json() == {"is_paused": True}
        assert (await b.post("/resume")).json() == {"status": "resumed"}
        assert (await a.get("/is_paused")).json() == {"is_paused": False}


async def test_the_engine_busy_crosses_as_429_with_retry_after():
    async with two_front_ends("queue.max_groups=1") as (engine, pool, (a, b)):
        for episode in ("e1", "e2"):
            await a.post(
                "/v1/chat/completions", json={"messages": [user(episode)], "max_tokens": 2, "episode_id": episode}
            )
        assert (await b.post("/v1/episodes/e1/reward", json={"reward": 1})).status_code == 200
        full = await b.post("/v1/episodes/e2/reward", json={"reward": 1})
        assert full.status_code == 429 and full.headers["retry-after"] == "1", full.text


async def test_api_servers_processes_serve_one_engine_and_one_restarts_when_killed():
    with anyio.fail_after(TIMEOUT * 3):
        async with RolloutEngine(serve_cfg("serve.api_servers=2", "serve.api_key=k3y"), pool=FakePool(2)) as engine:
            front = await engine.serve(port=0)
            pids = dict(front.pids)
            assert sorted(pids) == [0, 1] and len(set(pids.values())) == 2 and os.getpid() not in pids.values()
            async with httpx.AsyncClient(base_url=front.url, timeout=TIMEOUT) as http:  # the key, in every process
                assert (await http.get("/v1/models")).status_code == 401
                assert (await http.get("/v1/models", headers={"Authorization": "Bearer k3y"})).json()["data"][0][
                    "id"
                ] == "tiny"
            async with openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="k3y", max_retries=0) as client:

                async def ask(i: int) -> str:
                    r = await client.chat.completions.create(model="tiny", messages=[user(f"q{i}")], max_tokens=3)
                    return r.choices[0].finish_reason

                answers: list[str] = []

                async def keep(i: int) -> None:
                    answers.append(await ask(i))

                async with anyio.create_task_group() as tg:  # at once: both processes take connections
                    for i in range(32):
                        tg.start_soon(keep, i)
                assert len(answers) == 32 and all(r in ("stop", "length") for r in answers)
                os.kill(pids[1], signal.SIGKILL)
                while front.pids.get(1) in (None, pids[1]):  # started again, and serving
                    await anyio.sleep(0.05)
                results = [await ask(i) for i in range(8)]
                assert all(r in ("stop", "length") for r in results)
        assert all(proc.poll() is not None for proc in front.procs)  # stopped with the engine


async def test_a_front_end_that_cannot_start_fails_serve_naming_it_and_the_engine_serves_on(monkeypatch):
    monkeypatch.setattr(frontends.sys, "executable", "/bin/false")  # each front end exits at once
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(serve_cfg("serve.api_servers=2"), pool=FakePool(2)) as engine:
            with pytest.raises(RuntimeError, match=r"front-end process \d exited with code 1 before serving"):
                await engine.serve(port=0)
            groups = await engine.submit([[5, 6, 7]], train=False).result()
            assert groups[0].trajectories and all(t.ok for t in groups[0].trajectories)


def test_front_ends_exit_when_the_driver_is_killed(tmp_path):
    """The driver SIGKILLed (no chance to stop anything): its front ends see the pipe end and exit."""
    script = tmp_path / "driver.py"
    script.write_text(
        "import anyio, os, sys\n"
        "from tests.support.fakes import FakePool\n"
        "from tests.support.serving import serve_cfg\n"
        "from rollout.engine import RolloutEngine\n"
        "async def main():\n"
        "    async with RolloutEngine(serve_cfg('serve.api_servers=2'), pool=FakePool(2)) as engine:\n"
        "        front = await engine.serve(port=0)\n"
        "        print(*front.pids.values(), flush=True)\n"
        "        await anyio.sleep_forever()\n"
        "anyio.run(main)\n"
    )
    driver = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2, "the driver did not start its front ends"
    finally:
        driver.kill()
        driver.wait()
    for pid in pids:  # each front end's exit, awaited through a pidfd (they are not our children)
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:  # gone already
            continue
        try:
            assert select.select([fd], [], [], TIMEOUT)[0], f"front end {pid} still runs after the driver was killed"
        finally:
            os.close(fd)


def test_a_remote_desk_answers_to_every_desk_call_and_hides_none():
    """Each call the backend serves is a call over the socket: no name of the proxy's own shadows one."""
    assert frontends.CALLS | {"record"} <= {
        name for name in dir(Backend) if not name.startswith("_")
    }  # "ready": the service's
    assert not [name for name in vars(RemoteBackend) if not name.startswith("_")]


def test_api_servers_out_of_range_names_the_key():
    for bad in ("0", "65", "-1"):
        with pytest.raises(InvalidConfigError, match="serve.api_servers"):
            serve_cfg(f"serve.api_servers={bad}")
