"""The serving state next to the engine (`rollout.serve.backend`), through the OpenAI-compatible server
over fake engines: a conversation's turns are one session on one engine, served turns become an
episode for the learner, a request whose client went away is aborted on its engine, served episodes
are a stream the learner iterates until serving stops, a retried reward POST hands in one group.
Over several front-end processes: tests/test_frontends.py."""

from __future__ import annotations

from urllib.parse import urlsplit

import anyio

from rollout.types import Prompt
from tests.support.serving import served

IDLE_S = 6  # longer than uvicorn's own keep-alive (5 s), shorter than clients' longest (Go's 90 s)


async def test_three_turns_are_token_contiguous_and_stay_on_one_engine():
    async with served() as s:
        messages = [{"role": "user", "content": "first"}]
        turns = []
        for k in range(3):
            r = await s.client.chat.completions.create(model="tiny", messages=messages, max_tokens=5)
            m = r.choices[0].message.model_dump()
            turns.append(m)
            messages = [*messages, m, {"role": "user", "content": f"turn {k}"}]  # the assistant message, ids and all
        for a, b in zip(turns, turns[1:]):
            before = a["prompt_token_ids"] + a["generation_token_ids"]
            assert b["prompt_token_ids"][: len(before)] == before
        assert len({t["rollout"]["engine_id"] for t in turns}) == 1
        requests = [r for e in s.pool.engines for r in e.requests]
        assert len({r.cache_salt for r in requests}) == 1 and requests[0].cache_salt.startswith("s:")


async def test_a_client_that_disconnects_aborts_its_engine_request():
    async with served() as s:
        gates = [e.block() for e in s.pool.engines]
        async with anyio.create_task_group() as tg:  # the engines hold the request: it is never answered
            tg.start_soon(
                lambda: s.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            )
            while not any(e.inflight for e in s.pool.engines):  # it reached an engine
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()  # then the client goes: its connection closes
        while sum(e.cancelled for e in s.pool.engines) < 1 or s.server.inflight:  # aborted, and the handler is done
            await anyio.sleep(0.01)
        for g in gates:
            g.set()


async def test_served_turns_become_an_episode_for_the_learner():
    async with served() as s:
        messages = [{"role": "user", "content": "solve"}]
        for k in range(2):
            r = await s.client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=4, extra_body={"episode_id": "ep7"}
            )
            messages = [*messages, r.choices[0].message.model_dump(), {"role": "tool", "content": f"result {k}"}]
        done = (await s.http.post("/v1/episodes/ep7/reward", json={"reward": 0.5})).json()
        assert done["turns"] == 2 and done["reward"] == 0.5
        group = await s.engine.next_group()
        (ep,) = group.trajectories
        assert group.prompt_id == "ep7" and ep.reward == 0.5 and len(ep.turns) == 2
        assert sum(ep.loss_mask) == sum(len(t.token_ids) for t in ep.turns) and 0 in ep.loss_mask


async def open_episode(s, episode: str) -> None:
    await s.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": episode}], max_tokens=2, extra_body={"episode_id": episode}
    )


async def test_groups_wait_for_served_episodes_and_end_once_serving_stops():
    async with served() as s:
        s.engine.feed([Prompt(token_ids=[5, 6], id="fed")])
        send, taken = anyio.create_memory_object_stream[str](8)

        async def learner() -> None:
            async with send:
                async for group in s.engine.groups():
                    await send.send(group.prompt_id)

        async with anyio.create_task_group() as tg, taken:
            tg.start_soon(learner)
            assert await taken.receive() == "fed"  # the fed prompt is done: the stream goes on
            for episode in ("a", "b"):
                await open_episode(s, episode)
                assert (await s.http.post(f"/v1/episodes/{episode}/reward", json={"reward": 1})).status_code == 200
                assert await taken.receive() == episode
            await s.engine.stop_serving()
            assert [g async for g in taken] == []  # then it ends


async def test_batches_wait_for_served_episodes():
    async with served() as s:
        async with anyio.create_task_group() as tg:
            batch = anyio.Event()

            async def learner() -> None:
                (got,) = [b async for b in s.engine.batches(groups=2)]
                assert [g.prompt_id for g in got.groups] == ["a", "b"]
                batch.set()

            tg.start_soon(learner)
            for episode in ("a", "b"):
                await open_episode(s, episode)
                assert (await s.http.post(f"/v1/episodes/{episode}/reward", json={"reward": 1})).status_code == 200
            await s.engine.stop_serving()
        assert batch.is_set()


async def test_a_retried_reward_gets_the_first_outcome_and_hands_in_one_group():
    async with served() as s:
        await open_episode(s, "ep")
        first = await s.http.post("/v1/episodes/ep/reward", json={"reward": 0.5})
        again = await s.http.post("/v1/episodes/ep/reward", json={"reward": 0.5})
        assert first.status_code == again.status_code == 200 and again.json() == first.json(), again.text
        assert (await s.engine.next_group()).prompt_id == "ep"
        await s.engine.stop_serving()
        assert await s.engine.next_group() is None  # one group, not two


class HeldHandIn:
    """The served engine with every delivery held until `release` is set (a slow durable log)."""

    def __init__(self, engine):
        self.engine, self.reached, self.release = engine, anyio.Event(), anyio.Event()

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    async def deliver(self, group) -> None:
        self.reached.set()
        await self.release.wait()
        await self.engine.deliver(group)


async def test_a_reward_retried_after_its_connection_dropped_hands_in_once():
    async with served() as s:
        await open_episode(s, "ep")
        s.server.backend.engine = held = HeldHandIn(s.engine)
        async with anyio.create_task_group() as tg:  # the first POST's connection drops mid-delivery
            tg.start_soon(lambda: s.http.post("/v1/episodes/ep/reward", json={"reward": 1}))
            await held.reached.wait()
            tg.cancel_scope.cancel()
        retried = []

        async def retry() -> None:  # while the first still hands in, or after: the same answer
            retried.append(await s.http.post("/v1/episodes/ep/reward", json={"reward": 1}))

        async with anyio.create_task_group() as tg:
            tg.start_soon(retry)
            held.release.set()
        (answer,) = retried
        assert answer.status_code == 200 and answer.json()["turns"] == 1, answer.text
        assert (await s.engine.next_group()).prompt_id == "ep"
        await s.engine.stop_serving()
        assert await s.engine.next_group() is None


async def exchange(conn, request: bytes) -> int:
    """Send `request` on `conn` and read its whole response; its status. Raises when the server
    closed the connection (anyio's EndOfStream, BrokenResourceError)."""
    await conn.send(request)
    data = b""
    while b"\r\n\r\n" not in data:
        data += await conn.receive()
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(
        next(v for k, v in (h.split(b":", 1) for h in head.split(b"\r\n")[1:]) if k.lower() == b"content-length")
    )
    while len(body) < length:
        body += await conn.receive()
    return int(head.split()[1])


async def test_many_rewards_answered_429_are_retried_on_connections_kept_alive():
    """Clients keep idle connections for seconds (httpx and the OpenAI SDK 5 s, aiohttp 15 s, Go 90 s):
    a server that closes them first races each retry sent on one, which then gets a reset."""
    async with served("queue.max_groups=1") as s:
        await open_episode(s, "full")
        assert (await s.http.post("/v1/episodes/full/reward", json={"reward": 1})).status_code == 200
        url = urlsplit(s.server.url)
        agents = 16
        for i in range(agents):
            await open_episode(s, f"a{i}")
        statuses: list[int] = []

        async def agent(i: int) -> None:
            body = b'{"reward": 1}'
            head = f"POST /v1/episodes/a{i}/reward HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Length: {len(body)}"
            request = f"{head}\r\nContent-Type: application/json\r\n\r\n".encode() + body
            async with await anyio.connect_tcp(url.hostname, url.port) as conn:
                statuses.append(await exchange(conn, request))
                await anyio.sleep(IDLE_S)  # the agent's backoff: its connection idle meanwhile
                statuses.append(await exchange(conn, request))

        async with anyio.create_task_group() as tg:
            for i in range(agents):
                tg.start_soon(agent, i)
        assert statuses == [429] * 2 * agents
