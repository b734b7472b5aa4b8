"""The shm weight-transfer backend without engines: vLLM's factories build both sides, a trainer
sends through its ring to two workers (plain torch modules, in threads of this process) through a
small client with vLLM's four calls. The same workers serve a gloo learner too. Bytes arrive exact
through a ring far smaller than the model (tensors cut across slots, the ring wrapping round many
times), staged until finish_weight_update; the ring is no file in /dev/shm and is unmapped when both sides shut down;
a round the workers refuse fails at once; a source that disagrees with its metadata ends the
workers' round at once and the next round works; a worker gone is dropped; a learner killed
mid-transfer and a learner that never sends fail each worker's finish, naming the chunk and its
tensors, the model untouched.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from policies.gloo_transfer import GlooTrainerInitInfo, GlooWeightTransferEngine, StateDictSource
from policies.shm import mapped
from policies.shm_transfer import ALIGN, ShmInitInfo, ShmTrainerInitInfo, ShmUpdateInfo, ShmWeightTransferEngine, layout
from tests.support.transfer_doubles import Client, Module, reload


class GlooWorker(GlooWeightTransferEngine):
    _reload = reload


class Worker(ShmWeightTransferEngine):
    gloo_cls = GlooWorker
    _reload = reload


def worker(weights) -> Worker:
    cfg = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0), model_config=None
    )
    return Worker(types.SimpleNamespace(backend="shm"), cfg, torch.device("cpu"), Module(weights))


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed.weight": torch.randn(64, 32, generator=g),  # 8192 bytes: across several slots
        "model.layers.0.w": torch.randn(31, 31, generator=g).to(
            torch.bfloat16
        ),  # 1922 bytes: the next starts at 64 x k
        "model.layers.0.b": torch.randn(3, generator=g),
        "model.norm.weight": torch.randn(32, generator=g),
    }


def setup(timeout_s: float = 30.0, slot_bytes: int = 1000, slots: int = 2, client: Client | None = None):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    w0 = weights(0)
    client = client or Client([worker(w0) for _ in range(2)])
    source = StateDictSource(w0)
    init = ShmTrainerInitInfo(world_size=3, rank=0, slot_bytes=slot_bytes, slots=slots, timeout_s=timeout_s)
    return WeightTransferTrainerFactory.trainer_init(init, client=client, source=source), client, source


def info_of(w: dict[str, torch.Tensor], round: int = 1) -> ShmUpdateInfo:
    return ShmUpdateInfo(
        list(w), [str(v.dtype).removeprefix("torch.") for v in w.values()], [list(v.shape) for v in w.values()], round
    )


def ring_mappings() -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if "memfd:rollout-shm" in line]


def test_layout_aligns_every_tensor_and_both_sides_cut_alike():
    tensors, total = layout(info_of(weights(0)))
    assert [t[3] % ALIGN for t in tensors] == [0] * 4
    assert [t[4] for t in tensors] == [8192, 1922, 12, 128]
    assert total == tensors[-1][3] + tensors[-1][4] and tensors[2][3] == 8192 + 1984


def test_the_trainer_sends_exact_bytes_to_every_worker_round_after_round():
    """A 2-slot ring of 1000 bytes carries ~10 kB: every tensor but the small ones crosses slots,
    and the ring wraps round 5 times per round. The ring is no /dev/shm file."""
    gc.collect()  # rings of earlier tests' workers, in garbage cycles, are unmapped first
    before = mapped({os.getpid()})
    trainer, client, source = setup()
    for wk in client.workers:
        wk.join.wait()  # each worker maps the ring in its join's thread, once handed the file
    assert (
        len(ring_mappings()) == 3 and mapped({os.getpid()}) == before
    )  # the learner's and each worker's mapping, no name
    for seed in (1, 2, 3):
        w = weights(seed)
        source.update(w)
        trainer.send_weights()
        for wk in client.workers:
            assert wk.model.loaded == list(w) and all(torch.equal(wk.model.w[k], v) for k, v in w.items())
    trainer.shutdown()
    for wk in client.workers:
        wk.shutdown()
    gc.collect()
    assert ring_mappings() == []  # unmapped on both sides: nothing of it is left


def test_engines_started_with_shm_serve_a_gloo_learner_too_and_back():
    """A learner off the node (or NeMo RL's init_collective) joins with gloo's init info: the same
    workers receive through gloo's engine; a learner on the node then joins with shm's again."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    shm_trainer, client, source = setup()
    w = {
        k: v for k, v in weights(1).items() if k != "model.layers.0.w"
    }  # gloo's buckets do not align a float32 after its 1922 bytes
    gloo_trainer = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(world_size=3, rank=0, bucket_bytes=3000, timeout_s=30),
        client=client,
        source=StateDictSource(w),
    )
    gloo_trainer.send_weights()
    for wk in client.workers:
        assert wk.gloo.pg is not None and wk.sock is None and all(torch.equal(wk.model.w[k], v) for k, v in w.items())
    w = weights(2)
    shm_trainer, _, source = setup(client=client)
    source.update(w)
    shm_trainer.send_weights()
    for wk in client.workers:
        assert wk.gloo.pg is None and wk.sock is not None and all(torch.equal(wk.model.w[k], v) for k, v in w.items())
    shm_trainer.shutdown()
    gloo_trainer.shutdown()


def test_bytes_are_staged_while_the_model_serves_and_loaded_only_at_finish():
    """vLLM's update_weights starts the drain and returns before any byte is sent (the engine
    core is free to keep generating); the bytes land in the staging buffer, and the model changes
    only in finish_weight_update (the engine's pause)."""
    trainer, client, source = setup()
    w = weights(1)
    source.update(w)
    trainer.round += 1
    client.start_weight_update()
    client.update_weights(vars(info_of(w, trainer.round)))  # returns at once: nothing was sent yet
    trainer._send(info_of(w, trainer.round))  # returns once every worker has every chunk staged
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
        trainer.send_weights()  # nothing was sent: it cannot wait out the 300 s
    client.refuse = None
    trainer.send_weights()  # and the ring still works
    trainer.shutdown()


class Lying(StateDictSource):
    """Its metadata declares one shape, its iteration yields another for `name`."""

    def __init__(self, w, name):
        super().__init__(w)
        self.name = name

    def __iter__(self):
        for k, v in super().__iter__():
            yield k, (v[:1] if k == self.name else v)


def test_a_source_that_disagrees_with_its_metadata_ends_the_round_everywhere_at_once():
    """The learner refuses the tensor naming it, after some chunks went out; every worker's round
    ends at once (not at its 300 s timeout), the model untouched; the next round works."""
    trainer, client, _ = setup(timeout_s=300)
    w = weights(1)
    trainer.source = Lying(w, "model.layers.0.b")
    with pytest.raises(
        RuntimeError, match=r"shm transfer: chunk \d+/\d+: the learner ended the round.*the model is unchanged"
    ):
        with pytest.raises(
            ValueError, match=r"WeightSource yielded 'model.layers.0.b' torch.float32 \[1\], metadata\(\) declared"
        ):
            trainer.send_weights()
        client.finish_weight_update()
    for wk in client.workers:
        assert wk.model.loaded == [] and all(not t.any() for t in wk.model.w.values())
    trainer.source = StateDictSource(w)
    trainer.send_weights()
    for wk in client.workers:
        assert all(torch.equal(wk.model.w[k], v) for k, v in w.items())
    trainer.shutdown()


def test_a_settle_finds_a_round_the_learner_ended_and_a_discard_drops_a_drain_in_flight():
    """The engine's settle before its finish: a round the learner ended raises naming the chunk,
    the model untouched, nothing left pending. A round called off while the bytes still come: the
    discard ends the drain (the socket closes: the learner inits again), loading nothing."""
    trainer, client, _ = setup(timeout_s=300)
    trainer.source = Lying(weights(1), "model.layers.0.b")
    with pytest.raises(ValueError, match="model.layers.0.b"):
        trainer.send_weights()
    for wk in client.workers:
        with pytest.raises(RuntimeError, match=r"chunk \d+/\d+: the learner ended the round.*the model is unchanged"):
            wk.update_weights({"settle": True})
        assert wk.pending is None and wk.model.loaded == []
    wk = client.workers[0]
    wk.start_weight_update()
    wk.update_weights(dataclasses.asdict(info_of(weights(2), round=trainer.round + 1)))  # nothing will come
    wk.update_weights({"discard": True})
    wk.finish_weight_update()
    assert wk.pending is None and wk.sock is None and wk.model.loaded == []
    assert all(not t.any() for t in wk.model.w.values())
    trainer.shutdown()


def test_a_round_the_learner_gave_up_without_finish_leaves_the_next_round_working():
    """A learner whose send failed does not call finish_weight_update (vLLM's trainers do not):
    its next round starts clean, nothing of the failed one loaded."""
    trainer, client, _ = setup(timeout_s=300)
    trainer.source = Lying(weights(1), "model.norm.weight")
    with pytest.raises(ValueError, match="model.norm.weight"):
        trainer.send_weights()
    w = weights(2)
    trainer.source = StateDictSource(w)
    trainer.send_weights()
    for wk in client.workers:
        assert wk.model.loaded == list(w) and all(torch.equal(wk.model.w[k], v) for k, v in w.items())
    trainer.shutdown()


def test_a_worker_gone_is_dropped_and_the_others_get_every_byte():
    trainer, client, source = setup()
    w = weights(1)
    source.update(w)
    client.start_weight_update()
    client.update_weights(vars(info_of(w, trainer.round + 1)))
    gone, kept = client.workers
    gone.shutdown()  # its socket closes mid-round (its engine's own call fails and leaves rotation)
    trainer.round += 1
    trainer._send(info_of(w, trainer.round))
    kept.finish_weight_update()
    assert list(trainer.workers) == [2] and all(torch.equal(kept.model.w[k], v) for k, v in w.items())
    trainer.shutdown()


LEARNER = """
import json, os, sys, torch
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from policies.shm_transfer import ShmTrainerInitInfo
from policies.gloo_transfer import GlooTrainerInitInfo, GlooWeightTransferEngine, StateDictSource

class Client:
    def init_weight_transfer_engine(self, info):
        print(json.dumps(info), flush=True)  # the test's worker joins with it
    def start_weight_update(self): pass
    def update_weights(self, info): pass
    def finish_weight_update(self, weight_version=None): pass

class Dies(StateDictSource):
    def __iter__(self):
        it = super().__iter__()
        yield next(it)  # the first tensor (8192 bytes) fills and sends chunks 1-8 of 1000 bytes
        os._exit(1)

w = {"model.embed.weight": torch.ones(64, 32), "model.norm.weight": torch.ones(32)}
init = ShmTrainerInitInfo(world_size=2, rank=0, slot_bytes=1000, slots=4, timeout_s=600)
t = WeightTransferTrainerFactory.trainer_init(init, client=Client(), source=Dies(w))
t.send_weights()
"""


def test_a_learner_killed_mid_transfer_fails_the_worker_naming_the_chunk():
    """The learner's process dies after sending 8 chunks: the worker stages those, then fails
    at the ninth, naming it and its tensors, because the socket closed (nothing waits the 600 s
    timeout out); the model is untouched and the ring's memory is gone with the last mapping."""
    child = subprocess.Popen([sys.executable, "-c", LEARNER], stdout=subprocess.PIPE, text=True)
    info = json.loads(child.stdout.readline())
    w = {"model.embed.weight": torch.zeros(64, 32), "model.norm.weight": torch.zeros(32)}
    wk = worker(w)
    wk.init_transfer_engine(ShmInitInfo(**info))
    wk.start_weight_update()
    wk.update_weights(vars(info_of(w)))
    gone = (
        r"shm transfer: chunk 9/9 \(model.embed.weight, model.norm.weight\): "
        r"the learner is gone \(Connection.*; the model is unchanged"
    )
    with pytest.raises(RuntimeError, match=gone):
        wk.finish_weight_update()
    assert wk.model.loaded == [] and all(not t.any() for t in wk.model.w.values())
    assert child.wait(30) == 1
    wk.shutdown()
    gc.collect()
    assert ring_mappings() == []


def test_a_learner_that_never_sends_fails_the_worker_at_its_timeout():
    trainer, client, source = setup(timeout_s=1.0)
    wk = client.workers[0]
    wk.update_weights(vars(info_of(weights(0))))
    with pytest.raises(
        RuntimeError,
        match=r"shm transfer: chunk 1/\d+ \(model.embed.weight\): TimeoutError: timed out; the model is unchanged",
    ):
        wk.finish_weight_update()
    trainer.shutdown()


def test_an_init_whose_learner_never_answers_returns_at_once_and_the_round_names_the_address():
    """The learner's socket takes the connection but never hands over the ring (a learner stuck,
    or gone with its socket left). The worker's init, run on a thread standing for vLLM's engine
    core, returns while the join still runs, and the core runs its next call (a generation
    step) meanwhile; the round's calls return without waiting, and once the join gave up at its
    timeout_s the round's first check raises naming the address; a correct learner's init then
    joins and its round loads."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0rollout-shm-test-silent")
    listener.listen(4)  # never accepts: a connect lands in its backlog and waits
    w0 = weights(0)
    client = Client([worker(w0) for _ in range(2)])
    wk, core = client.workers[0], ThreadPoolExecutor(1)  # the engine core runs one call at a time
    silent = ShmInitInfo(address="rollout-shm-test-silent", rank_offset=1, world_size=3, slots=2, slot_bytes=1000,
                         timeout_s=3.0)  # fmt: skip
    core.submit(wk.init_transfer_engine, silent).result(timeout=60)
    assert core.submit(lambda: "a step").result(timeout=60) == "a step"
    assert not wk.join.done(), "the step ran while the join was still running"
    wk.start_weight_update()
    wk.update_weights(vars(info_of(w0)))  # returns at once: the drain waits for the join in its own thread
    wk.join.thread.join(60)  # the join gives up at its timeout_s
    with pytest.raises(
        RuntimeError, match=r"could not join the learner at rollout-shm-test-silent within timeout_s=3: .*unchanged"
    ):
        wk.update_weights({"joined": True})
    assert wk.sock is None and wk.pending is None and wk.model.loaded == []
    listener.close()
    trainer, _, source = setup(client=client)
    w = weights(1)
    source.update(w)
    trainer.send_weights()
    for wk in client.workers:
        assert wk.model.loaded == list(w) and all(torch.equal(wk.model.w[k], v) for k, v in w.items())
    trainer.shutdown()
    core.shutdown()


# -- through rollout's client (`RolloutEngine.weight_sync_client()`) over fake engines whose model
# workers run the real shm worker engine -------------------------------------------------------

STATE = {
    "embed.weight": torch.randn(40, 30),
    "layers.0.weight": torch.randn(30, 30).to(torch.bfloat16),
    "norm.weight": torch.ones(30, dtype=torch.bfloat16),
}


class PoolModel(torch.nn.Module):
    """What vLLM's layerwise reload does, in short: loads are held until the update finishes."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: dict[str, torch.Tensor] = {}
        self.pending: dict[str, torch.Tensor] = {}

    def load_weights(self, pairs) -> None:
        for name, t in pairs:
            self.pending[name] = t.clone()


class PoolWorker(ShmWeightTransferEngine):
    def _reload(self, pairs) -> None:
        self.model.load_weights(pairs)
        self.model.loaded, self.model.pending = {**self.model.loaded, **self.model.pending}, {}


@pytest.fixture
def pool_cfg(tmp_path, monkeypatch):
    import msgspec
    from safetensors.torch import save_file

    import tests.support.fakes
    from rollout.config import load_config

    vllm = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0), model_config=None
    )
    monkeypatch.setattr(
        tests.support.fakes,
        "transfer_worker",
        lambda i: PoolWorker(types.SimpleNamespace(backend="shm"), vllm, torch.device("cpu"), PoolModel()),
    )
    (tmp_path / "config.json").write_text('{"vocab_size": 260}')
    save_file(STATE, str(tmp_path / "model.safetensors"))
    cfg = load_config(
        None,
        [
            "engines.count=2",
            "logging.level=error",
            "weight_sync.timeout_s=5",
            "engines.restart_backoff_s=0",
            "engines.vllm={weight_transfer_config: {backend: shm}}",
        ],
    )
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=str(tmp_path)))


@pytest.mark.parametrize(
    "bad, match",
    [
        (
            {**STATE, "norm.weight": torch.ones(3, dtype=torch.bfloat16)},
            r"norm.weight: bfloat16 \[3\], model has bfloat16 \[30\]",
        ),
        ({**STATE, "norm.weight": torch.ones(30)}, r"norm.weight: float32 \[30\], model has bfloat16"),
        ({**STATE, "extra.weight": torch.ones(1)}, "unknown extra.weight"),
    ],
)
async def test_weights_that_do_not_fit_are_refused_before_any_byte_naming_the_tensor(pool_cfg, bad, match):
    import anyio
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from rollout.engine import RolloutEngine
    from rollout.errors import InvalidWeightsError
    from tests.support.fakes import FakePool

    pool = FakePool(2)
    with anyio.fail_after(60):
        async with RolloutEngine(pool_cfg, pool=pool) as engine:
            client, source = engine.weight_sync_client(), StateDictSource(STATE)
            init = ShmTrainerInitInfo(world_size=1 + client.world_size(), rank=0, slot_bytes=1000, timeout_s=300)
            t = await anyio.to_thread.run_sync(
                lambda: WeightTransferTrainerFactory.trainer_init(init, client=client, source=source)
            )
            source.update(bad)
            with pytest.raises(InvalidWeightsError, match=match) as e:
                await anyio.to_thread.run_sync(t.send_weights)  # at once: no worker drains, nothing waits out the 300 s
            assert "no engine changed" in str(e.value)
            assert engine.epoch == 0 and not any(
                e.commits or e.worker.pending or e.worker.model.loaded for e in pool.engines
            )
            good = {n: v + 1 for n, v in STATE.items()}
            source.update(good)
            await anyio.to_thread.run_sync(t.send_weights)
            assert engine.epoch == 1 and all(
                torch.equal(e.worker.model.loaded[n], v) for e in pool.engines for n, v in good.items()
            )
            t.shutdown()


async def test_a_learner_gone_mid_transfer_leaves_every_engine_serving_the_previous_epoch(pool_cfg):
    """The learner goes after its first chunks (its sockets close): every engine's round fails
    (the model untouched); with no learner call within weight_sync.timeout_s the round is called
    off, every engine stays in rotation on the epoch before, and its number is never used again."""
    import anyio
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from rollout.engine import RolloutEngine
    from tests.support.fakes import FakePool

    pool = FakePool(2)
    with anyio.fail_after(60):
        async with RolloutEngine(pool_cfg, pool=pool) as engine:
            client = engine.weight_sync_client()
            init = ShmTrainerInitInfo(world_size=1 + client.world_size(), rank=0, slot_bytes=1000, timeout_s=300)

            class Dies(StateDictSource):
                def __iter__(self):
                    for k, pair in enumerate(super().__iter__()):
                        if k == 1:  # the first tensor (4800 bytes) went out in chunks
                            t.shutdown()
                            raise ConnectionError("learner died")
                        yield pair

            t = await anyio.to_thread.run_sync(
                lambda: WeightTransferTrainerFactory.trainer_init(init, client=client, source=Dies(STATE))
            )
            workers = [e.worker for e in pool.engines]
            with pytest.raises(ConnectionError):
                await anyio.to_thread.run_sync(t.send_weights)
            while engine.weight_transfer().round is not None:
                await anyio.sleep(0.05)  # the round ends on its own (no learner call within weight_sync.timeout_s)
            assert engine.epoch == 0 and not any(e.commits for e in pool.engines) and not pool.restarts
            assert all(load.healthy for load in engine._scheduler.runner.loads)
            assert engine._updates.allocated == 1  # epoch 1 was started: never used again
            assert all(
                w.model.loaded == {} and w.sock is None for w in workers
            )  # nothing loaded; the socket's end was seen
