"""The weight plane when things go wrong: engines that cannot join, fail or hang mid-load, a learner
that disconnects mid-transfer, engines restarted after a plane epoch. Without vLLM or Ray: fake
engines whose workers run the real `PlaneReceiver`; the learner of the disconnect test is a real
separate process, killed while its transfer is under way."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import signal
import threading

import anyio
import pytest
import torch

from rollout.engine import RolloutEngine
from rollout.errors import WeightSyncError
from rollout.types import Prompt
from tests.fakes import FakePool
from tests.test_plane import STATE, TIMEOUT, cfg, changed  # noqa: F401 -- cfg is a fixture

BACKENDS = ["gloo", "shm"]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_engine_that_cannot_join_changes_nothing(cfg, backend):  # noqa: F811
    pool = FakePool(2)
    pool.engines[1].plane.fail_join = True
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool) as engine:
            plane = await engine.weight_plane(backend=backend, bucket_bytes=200)
            with pytest.raises(WeightSyncError, match="engine 1: RuntimeError: cannot join the plane") as e:
                await plane.send(changed(1))
            assert "no engine changed" in str(e.value) and e.value.failed == [1]
            assert engine.epoch == 0 and all(not eng.commits and not eng.staged for eng in pool.engines)
            pool.engines[1].plane.fail_join = False
            assert await plane.send(changed(2)) == 1  # nothing was loaded: the number was never allocated


async def test_an_engine_found_dead_at_the_join_leaves_rotation_and_the_next_round_goes_on(cfg):  # noqa: F811
    """The round's ticket named it, so the round is off; it is out of rotation and restarts at once
    (no health report needed), and the learner's next send reaches every engine."""
    fast = cfg.__class__(**{**_fields(cfg), "engines": _engines(cfg, 2, restart_backoff_s=0.0, health_interval_s=60)})
    pool = FakePool(2)
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(fast, pool=pool) as engine:
            plane = await engine.weight_plane(backend="gloo", bucket_bytes=200)
            await pool.engines[1].kill()
            with pytest.raises(WeightSyncError, match="engine 1: EngineDeadError.*no engine changed"):
                await plane.send(changed(1))
            while not engine._scheduler.runner.loads[1].healthy:
                await anyio.sleep(0.01)  # the restart runs in the background
            assert pool.restarts == [1] and await plane.send(changed(2)) == 1
            assert [e.commits for e in pool.engines] == [[1], [1]]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_engine_failing_mid_load_leaves_rotation_and_the_others_serve(cfg, backend):  # noqa: F811
    pool = FakePool(3)
    pool.engines[1].plane.fail_after = 2  # raises with two tensors loaded: its weights are torn
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg.__class__(**{**_fields(cfg), "engines": _engines(cfg, 3)}), pool=pool) as engine:
            plane = await engine.weight_plane(backend=backend, bucket_bytes=200)
            with pytest.raises(WeightSyncError, match="engine 1: .*failed loading") as e:
                await plane.send(changed(1))
            assert e.value.failed == [1] and engine.epoch == 1
            for i in (0, 2):
                assert all(torch.equal(pool.engines[i].plane.loaded[n], t) for n, t in changed(1).items())
            engine.feed([Prompt(token_ids=[5, 6], id="after")])
            group = await engine.next_group()
            assert group.ok and {t.engine_id for t in group.trajectories} <= {0, 2}  # engine 1 is out
            assert await plane.send(changed(2)) == 2  # a new epoch; 1 is never reused


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_hung_engine_is_named_and_dropped_and_the_others_serve(cfg, backend):  # noqa: F811
    pool = FakePool(2)
    pool.engines[0].plane.hold = threading.Event()  # its load stops after one tensor and never goes on
    pool.engines[0].plane.got_first = threading.Event()
    short = cfg.__class__(**{**_fields(cfg), "weight_sync": cfg.weight_sync.__class__(timeout_s=3.0)})
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(short, pool=pool) as engine:  # the learner gives up on engine 0 after 0.5 s
            plane = await engine.weight_plane(backend=backend, bucket_bytes=200, timeout_s=0.5)
            with pytest.raises(WeightSyncError, match="engine 0: no answer within weight_sync.timeout_s") as e:
                await plane.send(changed(1))
            pool.engines[0].plane.hold.set()
            assert e.value.failed == [0] and engine.epoch == 1
            assert all(torch.equal(pool.engines[1].plane.loaded[n], t) for n, t in changed(1).items())


def _learner(port_out, weights, backend):  # a learner process: hosts the plane's store, sends, is killed
    from rollout.plane_sender import PlaneSender

    sender = PlaneSender(port=0, backend=backend, bucket_bytes=200, slots=1, timeout_s=30)
    port_out.put(sender.port)
    sender.send(weights)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_learner_killed_mid_transfer_leaves_no_engine_serving_torn_weights(cfg, backend):  # noqa: F811
    pool = FakePool(2)
    for e in pool.engines:  # each engine's load stops after its first tensor until the learner is dead
        e.plane.got_first, e.plane.hold = threading.Event(), threading.Event()
    ctx = mp.get_context("spawn")
    port = ctx.Queue()
    learner = ctx.Process(target=_learner, args=(port, changed(1), backend), daemon=True)
    learner.start()
    try:
        with anyio.fail_after(TIMEOUT * 2):
            async with RolloutEngine(cfg, pool=pool) as engine:
                plane = await engine.weight_plane(port=await anyio.to_thread.run_sync(port.get, True, 60), local=False)
                async with anyio.create_task_group() as tg:
                    failure: list[BaseException] = []

                    async def update() -> None:
                        try:
                            await plane.update()
                        except WeightSyncError as err:
                            failure.append(err)

                    tg.start_soon(update)
                    for e in pool.engines:
                        await anyio.to_thread.run_sync(e.plane.got_first.wait, 30)
                    os.kill(learner.pid, signal.SIGKILL)  # mid-transfer: the store goes with it
                    await anyio.to_thread.run_sync(learner.join, 30)
                    for e in pool.engines:
                        e.plane.hold.set()
                assert failure and sorted(failure[0].failed) == [0, 1], failure
                assert "every engine failed to load it" in str(failure[0])
                assert engine.epoch == 0 and all(not e.commits for e in pool.engines)
                assert not any(load.healthy for load in engine._scheduler.runner.loads)  # torn: out of rotation
        # A killed learner cannot unlink its shm slots: the engines that found it gone did.
        assert not glob.glob(f"/dev/shm/rollout-plane-*-{learner.pid}-r*"), "the dead learner's slots are left in /dev/shm"
    finally:
        learner.kill()


async def test_an_engine_restarted_after_a_plane_epoch_waits_for_the_next_update(cfg):  # noqa: F811
    """The plane's bytes live only in the learner: a restarted engine must not come back at the
    current epoch with other bytes; it is parked, and the next update loads it and readmits it."""
    pool = FakePool(2)
    fast = cfg.__class__(**{**_fields(cfg), "engines": _engines(cfg, 2, restart_backoff_s=0.0, health_interval_s=0.01)})
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(fast, pool=pool) as engine:
            plane = await engine.weight_plane()
            assert await plane.send(changed(1)) == 1
            await pool.engines[0].kill()
            while not pool.restarts or 0 not in engine._updates._parked:
                await anyio.sleep(0.01)  # the health check and the restart run in the background
            loads = engine._scheduler.runner.loads
            assert not loads[0].healthy and loads[0].restarting and pool.engines[0].commits == []
            assert await plane.send(changed(2)) == 2
            assert loads[0].healthy and pool.engines[0].commits == [2] and not engine._updates._parked
            assert all(torch.equal(pool.engines[0].plane.loaded[n], t) for n, t in changed(2).items())
            await pool.engines[1].kill()  # parked again; this time a state dict through the object store readmits it
            while len(pool.restarts) < 2 or 1 not in engine._updates._parked:
                await anyio.sleep(0.01)
            assert await engine.update_weights(changed(3)) == 3
            assert loads[1].healthy and pool.engines[1].commits == [3] and not engine._updates._parked


def _fields(config):
    return {f: getattr(config, f) for f in config.__struct_fields__}


def _engines(config, count, **changes):
    import msgspec

    return msgspec.structs.replace(config.engines, count=count, **changes)


def test_a_bucket_whose_tensor_changed_since_it_was_declared_aborts_the_stream_naming_it():
    """The learner side: a tensor resized after `send` declared it is caught when its bucket is
    packed; the bucket's header says why, so every engine's worker stops there too."""
    import msgspec

    from policies.transfer import ABORT, Header, RankMeta, Ticket, make_plan
    from rollout.errors import InvalidWeightsError
    from rollout.plane_sender import PlaneSender
    from tests.test_plane import MANIFEST

    sender = PlaneSender(port=0, backend="gloo", timeout_s=5)
    try:
        held, metas = sender._declare(dict(STATE), {})
        plan = make_plan([RankMeta(0, metas)], MANIFEST, 64)
        index = {t.name: i for i, t in enumerate(plan.tensors)}
        held = {index[n]: h for n, h in held.items()}
        held[index["norm.weight"]][2].resize_(31)  # the learner's tensor, after its declaration
        b = next(b for b, bucket in enumerate(plan.buckets) if any(plan.tensors[p.tensor].name == "norm.weight" for p in bucket.pieces))
        with pytest.raises(InvalidWeightsError, match=r"norm.weight changed since it was declared: torch.bfloat16 \[31\], declared bfloat16 \[30\]"):
            sender._pack(1, Ticket(1, plan=plan), b, held, torch.empty(64, dtype=torch.uint8))
        header = msgspec.msgpack.decode(sender.store.get(sender.keys.hdr(1, b)), type=Header)
        assert header.status == ABORT and "norm.weight" in header.reason
    finally:
        STATE["norm.weight"].resize_(30)
        sender.close()


@pytest.mark.parametrize("header, message", [("abort", "the learner aborted the transfer: x.weight is bad"), ("size", "the learner sends 5 bytes, the plan says 12")])
def test_a_worker_refuses_an_aborted_or_missized_bucket_naming_it(tmp_path, header, message):
    """The worker side: each bucket's header is checked before its bytes are used."""
    import msgspec

    from policies.plane_worker import PlaneReceiver, TransferError
    from policies.transfer import (
        ABORT,
        OK,
        EngineEntry,
        Header,
        Keys,
        PlaneStage,
        RankMeta,
        ShardMeta,
        Ticket,
        make_plan,
    )
    from policies.transports import Slots, connect
    from policies.weights import TensorSpec

    store = connect("127.0.0.1", 0, 5, master=True)
    slots = Slots("shm", "t", 0, 1, 64)
    plan = make_plan([RankMeta(0, [ShardMeta("x.weight", "float32", (3,))])], {"x.weight": TensorSpec("float32", (3,))}, 64)
    keys = Keys("test")
    store.set(keys.ticket(1), msgspec.msgpack.encode(Ticket(1, 1, "", "shm", 1, plan, [EngineEntry(0, 1, "e0")], {0: slots.handles}, 5.0)))
    receiver = PlaneReceiver()
    try:
        receiver.stage(PlaneStage("127.0.0.1", store.port, "test", 1, 0, 5.0))
        bad = Header(ABORT, reason="x.weight is bad") if header == "abort" else Header(OK, 5, 0)
        store.set(keys.hdr(1, 0), msgspec.msgpack.encode(bad))
        with pytest.raises(TransferError, match=rf"engine 0: bucket 1/1 \(x.weight\) from learner rank 0: TransferError: {message}"):
            list(receiver.stream(1))
    finally:
        receiver.close()
        slots.close()


async def test_a_drain_longer_than_the_plane_timeout_is_waited_for(cfg):  # noqa: F811
    """In drain mode an engine first waits for its running requests (bounded by their max_tokens):
    the learner waits for it to start receiving without a deadline, so a long drain fails nothing."""
    import msgspec

    drain = msgspec.structs.replace(cfg, weight_sync=msgspec.structs.replace(cfg.weight_sync, mode="drain", timeout_s=0.4))
    pool = FakePool(2)
    for e in pool.engines:
        e.commit_gate = anyio.Event()  # the drain: running requests finishing
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(drain, pool=pool) as engine:
            plane = await engine.weight_plane(timeout_s=0.1)
            async with anyio.create_task_group() as tg:
                tg.start_soon(plane.send, changed(1))
                await anyio.sleep(0.5)  # time must pass beyond the plane's timeout: that is what is tested
                for e in pool.engines:
                    e.commit_gate.set()
            assert engine.epoch == 1 and not engine.weight_updates[-1].failed


def test_a_new_learner_sweeps_the_slots_a_killed_one_left_and_no_live_ones():
    from policies.transports import SLOT_DIR, Slots

    dead = mp.get_context("spawn").Process(target=os.getpid)
    dead.start()
    dead.join()
    orphan = f"{SLOT_DIR}/rollout-plane-rollout-x-{dead.pid}-r0-s0"
    live = f"{SLOT_DIR}/rollout-plane-rollout-y-{os.getpid()}-r0-s9"
    for path in (orphan, live):
        open(path, "wb").close()
    slots = Slots("shm", "rollout-z", 0, 1, 64)
    try:
        assert not os.path.exists(orphan) and os.path.exists(live)
    finally:
        slots.close()
        os.unlink(live)
