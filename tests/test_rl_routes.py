"""vLLM's RL routes on `rollout serve` over fake engines whose model workers run the real gloo
worker engine: vLLM's own `HTTPVLLMWeightSyncClient` and trainer factory drive a round over HTTP;
each route's shape; calls out of order; the API key. Real engines: tests/integration/test_rl_http.py."""

from __future__ import annotations

import anyio
import httpx
import msgspec
import pytest
import torch

from rollout.engine import RolloutEngine
from tests.support.fakes import FakeEngine, FakePool
from tests.support.rl_serving import STATE, TIMEOUT, http_trainer, rl_cfg, served

ROUTES = [
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("GET", "/is_paused"),
    ("POST", "/abort_requests"),
    ("POST", "/init_weight_transfer_engine"),
    ("POST", "/shutdown_weight_transfer_engine"),
    ("POST", "/start_weight_update"),
    ("POST", "/update_weights"),
    ("POST", "/finish_weight_update"),
    ("POST", "/update_weight_version"),
    ("GET", "/weight_info"),
    ("GET", "/get_world_size"),
]


@pytest.fixture
def cfg(tmp_path):
    return rl_cfg(tmp_path)


async def until(what: str, predicate) -> None:
    """Until `predicate()` holds (re-checked as the engine's tasks run); fails naming `what`."""
    try:
        with anyio.fail_after(TIMEOUT):
            while not predicate():
                await anyio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"not within {TIMEOUT} s: {what}") from None


async def crash(engine, pool, i: int) -> None:
    """Engine `i` dies (as the health watch reports a dead engine); waits for its restart to be
    done: back in rotation, or parked out of it until the next update."""
    old = pool.engines[i]
    engine._scheduler.runner.mark_dead(i, f"engine {i}: killed by the test")
    await until(f"engine {i} restarted", lambda: pool.engines[i] is not old and (
        engine._scheduler.runner.loads[i].healthy or i in engine._updates._parked))  # fmt: skip


def conflict(r: httpx.Response, call: str) -> None:
    """vLLM's error shape, 409, naming the call."""
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == 409 and err["type"] == "Conflict" and call in err["message"], err


FRONT_ENDS = pytest.mark.parametrize("api_servers", [1, 2], ids=["in-process", "2-front-end-processes"])


@FRONT_ENDS
async def test_vllms_http_client_drives_a_round_between_pause_and_resume(cfg, api_servers):
    async with served(cfg, api_servers=api_servers) as (engine, server, pool, http):
        assert (await http.get("/get_world_size")).json() == {"world_size": 2}
        for no in ("false", "0", "off", "No"):  # as FastAPI reads vLLM's bool query
            assert (await http.get("/get_world_size", params={"include_dp": no})).json() == {"world_size": 1}
        assert (await http.get("/get_world_size", params={"include_dp": "yes"})).json() == {"world_size": 2}
        assert (await http.get("/weight_info")).json() == {"weight_version": "0", "epoch": 0}
        assert (await http.get("/is_paused")).json() == {"is_paused": False}
        assert (await http.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
        assert (await http.get("/is_paused")).json() == {"is_paused": True}
        new = {n: t + 1 for n, t in STATE.items()}
        t, source = await anyio.to_thread.run_sync(http_trainer, server.url, STATE)
        source.update(new)
        await anyio.to_thread.run_sync(t.send_weights)  # start, update (gloo bytes), finish: over HTTP
        assert engine.epoch == 1 and [e.commits for e in pool.engines] == [[1], [1]]
        assert all(torch.equal(e.worker.model.loaded[n], v) for e in pool.engines for n, v in new.items())
        assert (await http.post("/resume")).json() == {"status": "resumed"}
        assert (await http.get("/is_paused")).json() == {"is_paused": False}
        assert [e.pauses for e in pool.engines] == [["keep", "resume"]] * 2
        assert (await http.get("/weight_info")).json() == {"weight_version": "1", "epoch": 1}
        r = await http.post("/update_weight_version", json={"new_version": "step-1"})
        assert r.json() == {"success": True, "new_version": "step-1", "epoch": 1}
        assert (await http.get("/weight_info")).json() == {"weight_version": "step-1", "epoch": 1}
        traj = (await engine.submit(["hi"], train=False).result())[0].trajectories[0]
        assert set(traj.token_epochs()) == {1}  # tokens after the round carry its epoch
        assert (await http.post("/shutdown_weight_transfer_engine")).json() == {"message": "Weight transfer shut down"}
        conflict(await http.post("/start_weight_update"), "before init_weight_transfer_engine")
        t.shutdown()


@FRONT_ENDS
async def test_calls_out_of_order_answer_409_naming_the_call_and_the_epoch_stays(cfg, api_servers):
    async with served(cfg, api_servers=api_servers) as (engine, server, pool, http):
        conflict(await http.post("/finish_weight_update"), "finish_weight_update called without start_weight_update")
        conflict(
            await http.post("/update_weights", json={"update_info": {"names": []}}),
            "update_weights called without start_weight_update",
        )
        conflict(
            await http.post("/start_weight_update"), "start_weight_update called before init_weight_transfer_engine"
        )
        t, source = await anyio.to_thread.run_sync(http_trainer, server.url, STATE)
        assert (await http.post("/start_weight_update")).json() == {"message": "Weight update started"}
        conflict(await http.post("/start_weight_update"), "start_weight_update called while a weight update is active")
        conflict(
            await http.post("/init_weight_transfer_engine", json={"init_info": {}}),
            "init_weight_transfer_engine called during",
        )
        r = await http.post(
            "/finish_weight_update", json={"weight_version": "nothing-sent"}
        )  # ends the round, nothing loaded
        assert r.json() == {"message": "Weight update finished", "epoch": 0}
        assert engine.epoch == 0 and [e.commits for e in pool.engines] == [[], []]
        assert (await http.get("/weight_info")).json() == {"weight_version": "0", "epoch": 0}  # no label: no new epoch
        t.shutdown()


@pytest.mark.parametrize(("method", "path", "body", "param"), [
    ("POST", "/pause?mode=sleep", None, "mode"),
    ("GET", "/get_world_size?include_dp=maybe", None, "include_dp"),
    ("POST", "/init_weight_transfer_engine", {"init": {}}, "init_info"),
    ("POST", "/update_weights", {"update_info": 3}, "update_info"),
    ("POST", "/update_weight_version", {"new_version": 2}, "new_version"),
    ("POST", "/finish_weight_update", {"weight_version": ["v"]}, "weight_version"),
    ("POST", "/abort_requests", {"request_ids": "r1"}, "request_ids"),
])  # fmt: skip
async def test_a_bad_body_or_query_answers_400_naming_the_field(cfg, method, path, body, param):
    async with served(cfg) as (engine, server, pool, http):
        r = await http.request(method, path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == 400, err
        assert engine.epoch == 0 and all(e.pauses == [] for e in pool.engines)


async def test_without_the_key_every_rl_route_answers_401(cfg):
    async with served(cfg, api_key="sekrit") as (engine, server, pool, http):
        for method, path in ROUTES:
            r = await http.request(method, path, json={})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, r.text)
            r = await http.request(method, path, json={}, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401, path
        assert all(e.pauses == [] for e in pool.engines) and engine.epoch == 0
        r = await http.get("/is_paused", headers={"Authorization": "Bearer sekrit"})
        assert r.json() == {"is_paused": False}


async def test_abort_requests_ends_the_named_http_requests_with_499(cfg):
    async with served(cfg) as (engine, server, pool, http):
        gates = [e.block() for e in pool.engines]
        async with anyio.create_task_group() as tg:
            answers: dict[str, httpx.Response] = {}

            async def call(rid: str) -> None:  # "a" by the body's request_id, "b" by X-Request-Id
                body = {
                    "token_ids": [5, 6, 7],
                    "sampling_params": {"max_tokens": 3},
                    **({"request_id": rid} if rid == "a" else {}),
                }
                answers[rid] = await http.post(
                    "/inference/v1/generate", json=body, headers={"X-Request-Id": rid} if rid == "b" else {}
                )

            for rid in ("a", "b"):
                tg.start_soon(call, rid)
            while len(server.backend.running) < 2:
                await anyio.sleep(0.01)
            assert (await http.post("/abort_requests", json={"request_ids": ["a"]})).json() == {
                "status": "aborted",
                "aborted": 1,
            }
            while "a" not in answers:
                await anyio.sleep(0.01)
            assert (await http.post("/abort_requests")).json() == {"status": "aborted", "aborted": 1}  # none named: all
        assert answers["a"].status_code == answers["b"].status_code == 499
        assert answers["a"].json()["error"]["message"] == "aborted by POST /abort_requests"
        assert sum(e.cancelled for e in pool.engines) == 2 and not server.backend.running
        for g in gates:
            g.set()


async def test_an_engine_restarted_while_the_learner_holds_pause_comes_back_paused(cfg):
    """The learner's /pause holds until its /resume: an engine restarted meanwhile is paused before
    it takes a request, and the /resume resumes it with the others."""
    async with served(cfg) as (engine, server, pool, http):
        assert (await http.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
        await crash(engine, pool, 1)
        assert engine._scheduler.runner.loads[1].healthy and pool.engines[1].pauses == ["keep"]
        assert (await http.post("/resume")).json() == {"status": "resumed"}
        assert [e.pauses for e in pool.engines] == [["keep", "resume"]] * 2
        await crash(engine, pool, 0)  # after the /resume: not paused
        assert pool.engines[0].pauses == [] and (await http.get("/is_paused")).json() == {"is_paused": False}


async def test_an_engine_restarted_after_an_http_round_waits_out_of_rotation_for_the_next(cfg):
    """After a round of vLLM's trainer API the epoch's bytes live only in the learner: an engine
    restarted then waits out of rotation (paused, if the learner holds /pause), takes no request,
    and rejoins at the learner's next round, which must init its group again."""
    async with served(cfg) as (engine, server, pool, http):
        t, source = await anyio.to_thread.run_sync(http_trainer, server.url, STATE)
        source.update({n: v + 1 for n, v in STATE.items()})
        await anyio.to_thread.run_sync(t.send_weights)
        assert engine.epoch == 1
        assert (await http.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
        await crash(engine, pool, 1)
        parked = pool.engines[1]
        assert not engine._scheduler.runner.loads[1].healthy and parked.pauses == ["keep"] and parked.commits == []
        assert (await http.post("/resume")).json() == {"status": "resumed"}
        assert parked.pauses == ["keep", "resume"]  # the learner's /resume reaches it too
        groups = await engine.submit(["a", "b", "c", "d"], train=False).result()
        assert {t.engine_id for g in groups for t in g.trajectories} == {0} and parked.requests == []
        assert {e for g in groups for t in g.trajectories for e in t.token_epochs()} == {1}
        r = await http.post("/start_weight_update")  # its new workers are not in the learner's group
        assert (
            r.status_code == 500
            and "engines [1] restarted or left since init_weight_transfer_engine" in r.json()["error"]["message"]
        )
        t.shutdown()
        t, source = await anyio.to_thread.run_sync(http_trainer, server.url, {n: v + 2 for n, v in STATE.items()})
        await anyio.to_thread.run_sync(t.send_weights)
        assert engine.epoch == 2 and parked.commits == [2] and engine._scheduler.runner.loads[1].healthy
        assert all(torch.equal(parked.worker.model.loaded[n], v + 2) for n, v in STATE.items())
        groups = await engine.submit(["e", "f", "g", "h"], train=False).result()
        assert {e for g in groups for t in g.trajectories for e in t.token_epochs()} == {2}
        t.shutdown()


async def test_weights_that_do_not_fit_answer_400_naming_the_tensor_and_change_no_engine(cfg):
    async with served(cfg) as (engine, server, pool, http):
        t, source = await anyio.to_thread.run_sync(http_trainer, server.url, STATE)
        assert (await http.post("/start_weight_update")).status_code == 200
        info = {"names": ["norm.weight", "extra.weight"], "dtype_names": ["float32", "float32"], "shapes": [[3], [1]]}
        r = await http.post("/update_weights", json={"update_info": info})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (
            err["code"] == 400
            and "norm.weight: float32 [3], model has bfloat16 [30]; unknown extra.weight" in err["message"]
        ), err
        assert "no engine changed" in err["message"] and engine.epoch == 0
        assert not any(e.commits or e.worker.model.pending for e in pool.engines)
        conflict(
            await http.post("/finish_weight_update"),
            "finish_weight_update called without start_weight_update; the epoch stays 0",
        )
        source.update({n: v + 1 for n, v in STATE.items()})
        await anyio.to_thread.run_sync(t.send_weights)  # the round ended; the next goes through
        assert engine.epoch == 1
        t.shutdown()


async def test_an_engine_failing_answers_500_naming_it_and_the_others_serve(cfg):
    import requests

    async with served(cfg) as (engine, server, pool, http):
        t, source = await anyio.to_thread.run_sync(http_trainer, server.url, STATE)
        pool.engines[1].fail_commit = True
        source.update({n: v + 1 for n, v in STATE.items()})
        with pytest.raises(requests.HTTPError) as e:  # vLLM's client raises for the status
            await anyio.to_thread.run_sync(t.send_weights)
        assert e.value.response.status_code == 500 and e.value.request.path_url == "/finish_weight_update"
        assert (
            "epoch 1: engine 1: RuntimeError: reload failed; out of rotation"
            in e.value.response.json()["error"]["message"]
        )
        assert engine.epoch == 1 and pool.engines[0].commits == [1]
        t.shutdown()


async def test_with_no_engine_alive_the_rl_routes_answer_503(cfg):
    cfg = msgspec.structs.replace(cfg, engines=msgspec.structs.replace(cfg.engines, max_restarts=0))
    async with served(cfg) as (engine, server, pool, http):
        for i in (0, 1):
            engine._scheduler.runner.mark_dead(i, f"engine {i}: killed by the test")
        for method, path in [
            ("POST", "/pause"),
            ("POST", "/resume"),
            ("GET", "/is_paused"),
            ("POST", "/init_weight_transfer_engine"),
            ("GET", "/get_world_size"),
        ]:
            r = await http.request(method, path, json={"init_info": {}} if "init" in path else None)
            assert r.status_code == 503 and "every engine is dead" in r.json()["error"]["message"], (path, r.text)


async def test_vllms_routes_not_served_here_answer_404(cfg):
    async with served(cfg) as (engine, server, pool, http):
        for path in ("/start_draft_weight_update", "/weight_checker"):
            assert (await http.post(path, json={"action": "checksum"})).status_code == 404, path


async def test_a_pause_or_resume_during_a_restart_reaches_the_restarted_engine(cfg):
    """/pause while engine 1 restarts (not in rotation, so not among the engines the route calls):
    it comes back paused. /resume while that pause is still on its way to it: it comes back resumed."""

    class Gated(FakeEngine):
        async def pause_generation(self, mode: str) -> None:
            pausing.set()
            await let_pause.wait()
            await super().pause_generation(mode)

    class Pool(FakePool):
        async def restart(self, i: int) -> FakeEngine:
            restarting.set()
            await let_restart.wait()
            self.restarts.append(i)
            self.engines[i] = Gated(i)
            return self.engines[i]

    restarting, let_restart, pausing, let_pause = anyio.Event(), anyio.Event(), anyio.Event(), anyio.Event()
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=Pool(2)) as engine:
            pool = engine.pool
            server = await engine.serve(port=0)
            async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as http:
                engine._scheduler.runner.mark_dead(1, "engine 1: killed by the test")
                await restarting.wait()
                assert (await http.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
                assert pool.engines[1].pauses == []  # the old engine: not called
                let_restart.set()
                await pausing.wait()  # the restart pauses the new engine; /resume comes before that returns
                assert (await http.post("/resume")).json() == {"status": "resumed"}
                assert pool.engines[0].pauses == ["keep", "resume"]
                let_pause.set()
                await until("engine 1 back in rotation", lambda: engine._scheduler.runner.loads[1].healthy)
                assert pool.engines[1].pauses == ["keep", "resume"] and (await http.get("/is_paused")).json() == {
                    "is_paused": False
                }


async def test_a_version_label_past_its_length_answers_400_and_is_not_kept(cfg):
    """Every /weight_info echoes the current label: a label is at most MAX_VERSION_CHARS characters."""
    from rollout.serve.rl_routes import MAX_VERSION_CHARS

    async with served(cfg) as (engine, server, pool, http):
        for path, field in (("/update_weight_version", "new_version"), ("/finish_weight_update", "weight_version")):
            r = await http.post(path, json={field: "v" * (MAX_VERSION_CHARS + 1)})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == field and f"length <= {MAX_VERSION_CHARS}" in err["message"], err
        assert engine.weight_transfer().versions == {}
        assert (await http.get("/weight_info")).json() == {"weight_version": "0", "epoch": 0}
        r = await http.post("/update_weight_version", json={"new_version": "v" * MAX_VERSION_CHARS})
        assert (
            r.status_code == 200
            and (await http.get("/weight_info")).json()["weight_version"] == "v" * MAX_VERSION_CHARS
        )


async def test_version_labels_are_kept_up_to_a_count_the_oldest_forgotten(cfg):
    """Labels map to epochs (`WeightSyncClient.versions`); a learner labelling every step keeps
    the last MAX_LABELS, and /weight_info names the newest label of the current epoch."""
    from rollout.weights.round import MAX_LABELS

    async with served(cfg) as (engine, server, pool, http):
        for i in range(MAX_LABELS + 5):
            assert (await http.post("/update_weight_version", json={"new_version": f"step-{i}"})).status_code == 200
        versions = engine.weight_transfer().versions
        assert len(versions) == MAX_LABELS and "step-0" not in versions and f"step-{MAX_LABELS + 4}" in versions
        assert (await http.post("/update_weight_version", json={"new_version": "step-10"})).status_code == 200
        assert (await http.get("/weight_info")).json() == {"weight_version": "step-10", "epoch": 0}
