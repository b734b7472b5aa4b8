"""The serving state next to the engine (`rollout.serve.desk`), through the OpenAI-compatible server
over fake engines: a conversation's turns are one session on one engine, served turns become an
episode for the learner, a request whose client went away is aborted on its engine. Over several
front-end processes: tests/test_frontends.py."""

from __future__ import annotations

import anyio

from tests.support.serving import served


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
        again = await s.http.post("/v1/episodes/ep7/reward", json={"reward": 1})
        assert again.status_code == 404
