"""The gloo weight-transfer backend without engines: vLLM's factories build both sides, a trainer
sends to two workers (plain torch modules, in threads of this process) through a small client
with vLLM's four calls. Bytes arrive exact, in buckets, staged until finish_weight_update; a round
the workers refuse fails at once in the trainer; a trainer gone mid-transfer and a trainer that
never sends fail each worker's finish within its timeout, naming the bucket and its tensors, the
model untouched; a round handed off (`hand_off`) returns before the bytes go out.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch

from policies.gloo_transfer import GlooTrainerInitInfo, GlooWeightTransferEngine, StateDictSource, buckets
from tests.support.transfer_doubles import Client, Module, reload


class Worker(GlooWeightTransferEngine):
    _reload = reload


def worker(rank: int, weights) -> Worker:
    cfg = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0), model_config=None
    )
    return Worker(types.SimpleNamespace(backend="gloo"), cfg, torch.device("cpu"), Module(weights))


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.w": torch.randn(32, 32, generator=g).to(torch.bfloat16),
        "model.layers.0.b": torch.randn(32, generator=g),
        "model.norm.weight": torch.randn(32, generator=g),
    }


def setup(timeout_s: float = 30.0, bucket_bytes: int = 3000, **info):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    w0 = weights(0)
    client = Client([worker(r, w0) for r in range(2)])
    source = StateDictSource(w0)
    init = GlooTrainerInitInfo(world_size=3, rank=0, bucket_bytes=bucket_bytes, timeout_s=timeout_s, **info)
    return WeightTransferTrainerFactory.trainer_init(init, client=client, source=source), client, source


def test_buckets_cut_alike_and_keep_large_tensors_whole():
    cut = buckets(["a", "b", "c"], ["float32", "bfloat16", "float32"], [[10], [1000], [3]], 100)
    assert [[n for n, *_ in b] for b in cut] == [["a"], ["b"], ["c"]]
    assert [sum(x[3] for x in b) for b in cut] == [40, 2000, 12]


def test_the_trainer_sends_exact_bytes_to_every_worker_round_after_round():
    trainer, client, source = setup()
    for seed in (1, 2):
        w = weights(seed)
        source.update(w)
        trainer.send_weights()
        for wk in client.workers:
            assert wk.model.loaded == list(w) and all(torch.equal(wk.model.w[k], v) for k, v in w.items())
    trainer.shutdown()


def test_tensors_of_odd_byte_sizes_and_mixed_dtypes_share_a_bucket():
    """bf16 [31, 31] is 1922 bytes: a float32 right after it in the staging buffer would sit at an
    offset vLLM's load cannot view as float32 (storage_offset must be divisible by 4)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    g = torch.Generator().manual_seed(3)
    w = {
        "a": torch.randn(31, 31, generator=g).to(torch.bfloat16),
        "b": torch.randn(7, generator=g),
        "c": torch.randn(3, generator=g).double(),
    }
    client = Client([worker(r, w) for r in range(2)])
    source = StateDictSource(w)
    trainer = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(world_size=3, rank=0, bucket_bytes=1 << 20, timeout_s=30), client=client, source=source
    )
    trainer.send_weights()
    for wk in client.workers:
        assert wk.model.loaded == list(w) and all(torch.equal(wk.model.w[k], v) for k, v in w.items())
    trainer.shutdown()


def test_bytes_are_staged_while_the_model_serves_and_loaded_only_at_finish():
    """vLLM's update_weights posts the receives and returns before any byte is sent (the engine
    core is free to keep generating); the bytes land in a staging buffer, and the model changes
    only in finish_weight_update (the engine's pause)."""
    from policies.gloo_transfer import GlooUpdateInfo, send

    trainer, client, source = setup(timeout_s=3)
    w = weights(1)
    source.update(w)
    info = GlooUpdateInfo(
        list(w), [str(v.dtype).removeprefix("torch.") for v in w.values()], [list(v.shape) for v in w.values()], 1
    )
    client.start_weight_update()
    client.update_weights(vars(info))  # returns at once: nothing was sent yet
    send(trainer.pgs, iter(w.items()), info, trainer.info.bucket_bytes)
    for wk in client.workers:
        assert wk.model.loaded == [] and not any(torch.equal(wk.model.w[k], v) for k, v in w.items())
    client.finish_weight_update()
    for wk in client.workers:
        assert wk.model.loaded == list(w) and all(torch.equal(wk.model.w[k], v) for k, v in w.items())
    trainer.shutdown()


def test_a_refused_round_fails_in_the_trainer_at_once():
    trainer, client, source = setup(timeout_s=300)
    client.refuse = "unknown model.extra.weight"
    with pytest.raises(ValueError, match="unknown model.extra.weight"):
        trainer.send_weights()  # no broadcast was started: it cannot wait out the 300 s
    client.refuse = None
    trainer.send_weights()  # and the group still works
    trainer.shutdown()


def test_a_handed_off_round_returns_with_the_weights_copied_and_raises_its_error_once():
    """`hand_off`: send_weights returns once every worker receives and the learner's tensors are
    copied (the learner may change its own at once); the bytes and finish_weight_update come from
    the trainer's thread, and what fails there raises in the next call, which changes nothing."""
    trainer, client, source = setup(hand_off=True)
    finish, gate = client.finish_weight_update, threading.Event()

    def held(weight_version=None):
        gate.wait(30)
        finish()

    client.finish_weight_update = held
    w, sent = weights(1), weights(1)
    source.update(w)
    trainer.send_weights()
    assert not any(wk.model.loaded for wk in client.workers)  # the learner did not wait for the load
    for v in w.values():
        v.zero_()  # the learner's next step changes its tensors: what was handed off is a copy
    gate.set()
    trainer.settle()
    for wk in client.workers:
        assert wk.model.loaded == list(sent) and all(torch.equal(wk.model.w[k], v) for k, v in sent.items())

    def fails(weight_version=None):
        raise RuntimeError("engine 1 failed to load")

    client.finish_weight_update = fails
    source.update(weights(2))
    trainer.send_weights()  # returns: the failure comes later
    started = []
    client.start_weight_update = lambda: started.append(1)
    with pytest.raises(RuntimeError, match="engine 1 failed to load"):
        trainer.send_weights()
    assert started == []  # raised before this round began
    trainer.settle()  # raised once
    del client.start_weight_update
    client.finish_weight_update = finish
    source.update(weights(3))
    trainer.send_weights()
    trainer.shutdown()  # waits for the handed-off round
    assert all(torch.equal(wk.model.w[k], v) for wk in client.workers for k, v in weights(3).items())


TRAINER = """
import os, sys, torch
from policies.gloo_transfer import broadcast, pair_group, tcp_store
pg = pair_group(tcp_store("127.0.0.1", int(sys.argv[1]), 30.0), "t", 1, 30.0, trainer=True)
broadcast(pg, torch.zeros(int(sys.argv[2]), dtype=torch.uint8)).wait()  # the first bucket, then the process dies
os._exit(1)
"""


def test_a_learner_gone_mid_transfer_fails_the_worker_naming_the_bucket():
    """The learner's process dies after its first bucket: the worker fails at the second, naming
    it and its tensors, because the socket closed (nothing waits the timeout out)."""
    import subprocess
    import sys

    import torch.distributed as dist

    from policies.gloo_transfer import GlooInitInfo

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)  # stands for the learner's
    w = weights(0)
    names = list(w)
    cut = buckets(
        names, [str(v.dtype).removeprefix("torch.") for v in w.values()], [list(v.shape) for v in w.values()], 3000
    )
    assert len(cut) >= 2
    child = subprocess.Popen([sys.executable, "-c", TRAINER, str(store.port), str(sum(x[3] for x in cut[0]))])
    wk = worker(0, w)
    wk.init_transfer_engine(
        GlooInitInfo(
            master_address="127.0.0.1",
            master_port=store.port,
            rank_offset=1,
            world_size=2,
            session="t",
            bucket_bytes=3000,
            timeout_s=600.0,
        )
    )
    wk.start_weight_update()
    info = {
        "names": names,
        "dtype_names": [str(v.dtype).removeprefix("torch.") for v in w.values()],
        "shapes": [list(v.shape) for v in w.values()],
    }
    wk.update_weights(info)  # posts the receives
    # The closed socket ends it (a read error), not the timeout: nothing waits it out. The timeout
    # is long so that a slow start of the learner's process on a busy machine fails nothing.
    gone = (
        r"gloo transfer: bucket 2/\d+ \(model.layers.0.w.*: RuntimeError: "
        r".*(Read error|Connection reset|Connection closed).*the model is unchanged"
    )
    with pytest.raises(RuntimeError, match=gone):
        wk.finish_weight_update()
    assert wk.model.loaded == [] and all(
        not t.any() for t in wk.model.w.values()
    )  # nothing of the torn round was loaded
    assert child.wait(30) == 1
    wk.shutdown()


def test_a_transfer_that_hangs_fails_the_worker_at_its_timeout():
    """A learner that joined but never sends: the worker gives up after the group's timeout."""
    import time

    from policies.gloo_transfer import GlooInitInfo, pair_group, tcp_store

    w = weights(0)
    wk = worker(0, w)
    host: list = []
    t = threading.Thread(
        target=lambda: host.append(
            pair_group(tcp_store("127.0.0.1", port, 3.0, master=True), "h", 1, 3.0, trainer=True)
        )
    )
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    t.start()
    wk.init_transfer_engine(
        GlooInitInfo(
            master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, session="h", timeout_s=3.0
        )
    )
    t.join()
    t0 = time.monotonic()
    wk.update_weights({"names": list(w), "dtype_names": [str(v.dtype).removeprefix("torch.") for v in w.values()],
                       "shapes": [list(v.shape) for v in w.values()]})  # fmt: skip
    with pytest.raises(RuntimeError, match=r"gloo transfer: bucket 1/1 \(model.embed.weight .. model.norm.weight\)"):
        wk.finish_weight_update()
    assert 2 < time.monotonic() - t0 < 20
    wk.shutdown()


def test_an_init_naming_nothing_returns_at_once_and_the_rounds_first_call_names_the_address():
    """Nobody serves the learner's store. The worker's init, run on a thread standing for vLLM's
    engine core, returns while the rendezvous still runs, and the core runs its next call (a
    generation step) meanwhile. The round's calls return without waiting; once the rendezvous
    gave up at its timeout_s, the round's check (`{"joined": true}`, as a settle would)
    raises naming where it looked, nothing joined; a correct learner's init then joins and its
    round loads."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from policies.gloo_transfer import GlooInitInfo

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once closed
    w0 = weights(0)
    workers = [worker(r, w0) for r in range(2)]
    wk, core = workers[0], ThreadPoolExecutor(1)  # the engine core runs one call at a time
    nowhere = GlooInitInfo(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=3, timeout_s=3.0)
    core.submit(wk.init_transfer_engine, nowhere).result(timeout=60)
    assert core.submit(lambda: "a step").result(timeout=60) == "a step"
    assert not wk.join.done(), "the step ran while the rendezvous was still running"
    info = {"names": list(w0), "dtype_names": [str(v.dtype).removeprefix("torch.") for v in w0.values()],
            "shapes": [list(v.shape) for v in w0.values()]}  # fmt: skip
    wk.start_weight_update()
    wk.update_weights(info)  # returns at once: the rendezvous's own thread would post the receives
    wk.join.thread.join(60)  # the rendezvous gives up at its timeout_s
    with pytest.raises(
        RuntimeError, match=rf"could not join the learner's group at 127.0.0.1:{port} within timeout_s=3: .*unchanged"
    ):
        wk.update_weights({"joined": True})
    assert wk.pg is None and wk.store is None and wk.info is None and wk.staged == []
    source = StateDictSource(weights(1))
    init = GlooTrainerInitInfo(world_size=3, rank=0, bucket_bytes=3000, timeout_s=30)
    trainer = WeightTransferTrainerFactory.trainer_init(init, client=Client(workers), source=source)
    trainer.send_weights()
    assert all(torch.equal(wk.model.w[n], v) for wk in workers for n, v in weights(1).items())
    trainer.shutdown()
    core.shutdown()


def test_an_init_replaces_a_rendezvous_still_running():
    """The learner's next init comes while the last one's rendezvous (nobody serves it) still runs:
    it closes it, without waiting for its timeout, and joins; the round loads."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from policies.gloo_transfer import GlooInitInfo

    w0 = weights(0)
    workers = [worker(r, w0) for r in range(2)]
    for k, wk in enumerate(workers):
        wk.init_transfer_engine(GlooInitInfo(master_address="127.0.0.1", master_port=9, rank_offset=1 + k,
                                             world_size=3, timeout_s=600.0))  # fmt: skip
    stale = [wk.join for wk in workers]
    source = StateDictSource(weights(1))
    init = GlooTrainerInitInfo(world_size=3, rank=0, bucket_bytes=3000, timeout_s=30)
    trainer = WeightTransferTrainerFactory.trainer_init(init, client=Client(workers), source=source)
    trainer.send_weights()
    assert all(torch.equal(wk.model.w[n], v) for wk in workers for n, v in weights(1).items())
    for join in stale:
        join.thread.join(60)  # stopped by the new init, far before its 600 s
        assert not join.thread.is_alive() and join.peek() is None
    trainer.shutdown()


def test_a_settle_that_finds_a_bucket_missing_drops_the_round_and_a_discard_drops_it_unloaded():
    """The learner joined but sends nothing: a settle (the engine's, before its finish) fails at the
    group's timeout naming the bucket, with the staging and the group dropped (the learner inits
    again) and the model untouched; a discard of a round whose receives are still posted drops
    both too, loading nothing."""
    from policies.gloo_transfer import GlooInitInfo, pair_group, tcp_store

    w = weights(0)
    info = {"names": list(w), "dtype_names": [str(v.dtype).removeprefix("torch.") for v in w.values()],
            "shapes": [list(v.shape) for v in w.values()]}  # fmt: skip
    for control, match in (("settle", r"gloo transfer: bucket 1/1 \(model.embed.weight .. model.norm.weight\)"),
                           ("discard", None)):  # fmt: skip
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        host: list = []
        t = threading.Thread(
            target=lambda: host.append(
                pair_group(tcp_store("127.0.0.1", port, 3.0, master=True), "h", 1, 3.0, trainer=True)
            )
        )
        t.start()
        wk = worker(0, w)
        wk.init_transfer_engine(GlooInitInfo(master_address="127.0.0.1", master_port=port, rank_offset=1,
                                             world_size=2, session="h", timeout_s=3.0))  # fmt: skip
        t.join()
        wk.start_weight_update()
        wk.update_weights(info)
        if match:
            with pytest.raises(RuntimeError, match=f"{match}.*the model is unchanged"):
                wk.update_weights({control: True})
        else:
            wk.update_weights({control: True})
        assert wk.staged == [] and wk.pg is None and wk.model.loaded == []
        wk.finish_weight_update()  # vLLM's finish of a discarded round: nothing to load
        assert wk.model.loaded == [] and all(not v.any() for v in wk.model.w.values())
