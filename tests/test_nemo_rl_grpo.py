"""`RolloutGeneration` as NeMo RL's GRPO loop drives it, without vLLM or Ray: prompts near the context
limit, the dtype of `output_ids`, the hooks the loop calls every step, and weight refit through
vLLM's weight-transfer calls (`init_collective`, `prepare_refit_info`, `update_weights_from_collective`)
in the order `grpo.py` makes them, the trainer being a gloo `GlooCollective` in another thread."""

from __future__ import annotations

import threading

import pytest
import torch

from rollout.errors import InvalidWeightsError
from rollout.types import Prompt
from tests.support.fakes import FakePool, fake_token
from tests.support.generation import MAX_TOKENS, WEIGHTS, batch, wrapped


async def test_a_prompt_near_the_context_limit_generates_what_fits(generation_cfg):
    """max_model_len is 64 and max_tokens 5: 61 prompt tokens leave room for 3 (finish reason
    length, truncated); 64 or more leave none, and the row comes back as it went in, as NeMo RL's
    vLLM workers return it. The rest of the batch is generated as usual."""
    pool = FakePool(2)
    rows = [[5], [6] * 61, [7] * 64, [8] * 70]
    async with wrapped(generation_cfg, pool) as gen:
        out = await gen.agenerate(batch(rows))
    assert out["generation_lengths"].tolist() == [MAX_TOKENS, 3, 0, 0]
    assert out["truncated"].tolist() == [True, True, False, False]
    assert out["unpadded_sequence_lengths"].tolist() == [1 + MAX_TOKENS, 64, 64, 70]
    assert out["output_ids"][1, 61:64].tolist() == [fake_token([6] * 61, 0, i) for i in range(3)]
    assert out["output_ids"][3, :70].tolist() == [8] * 70 and out["logprobs"][2:].abs().sum() == 0
    sent = {len(r.token_ids): r.sampling.max_tokens for e in pool.engines for r in e.requests}
    assert sent == {1: MAX_TOKENS, 61: 3}  # rows without room never reach an engine


async def test_output_ids_keep_the_dtype_of_input_ids(generation_cfg):
    async with wrapped(generation_cfg, FakePool(2)) as gen:
        data = batch([[5, 6], [7]])
        out = await gen.agenerate({**data, "input_ids": data["input_ids"].to(torch.int32)})
        assert out["output_ids"].dtype == torch.int32
        async for _, one in gen.generate_async({**data, "input_ids": data["input_ids"].to(torch.int32)}):
            assert one["output_ids"].dtype == torch.int32


async def test_the_hooks_grpo_calls_every_step_mean_something(generation_cfg):
    pool = FakePool(2)
    async with wrapped(generation_cfg, pool) as gen:
        assert gen.blocks_training() is False and gen.wake_carries_weight_updates() is False
        await gen.aclear_logger_metrics()
        await gen.agenerate(batch([[5], [6]]))
        metrics = await gen.aget_logger_metrics()
        assert metrics["rollout/trajectories"] == 2 and metrics["rollout/tokens"] == 2 * MAX_TOKENS
        assert (await gen.aget_logger_metrics())["rollout/trajectories"] == 2  # reading does not clear
        await gen.aclear_logger_metrics()
        assert (await gen.aget_logger_metrics())["rollout/trajectories"] == 0
        gen.engine.feed([Prompt(token_ids=[9], id="learner")])  # the engine's own window is another one
        assert (await gen.engine.metrics())["rollout/trajectories"] >= 2
        assert await gen.ainvalidate_kv_cache() is True and [e.prefix_cache_resets for e in pool.engines] == [1, 1]
        await pool.engines[0].kill()
        assert await gen.ainvalidate_kv_cache() is False


def test_refit_through_vllms_transfer_calls_as_grpo_makes_them(generation_cfg):
    """grpo.py: the trainer's and the generation's init_collective futures are awaited together;
    then prepare_refit_info(policy.prepare_refit_info()); each step the trainer's broadcast futures
    and update_weights_from_collective()'s, then `all(results)`. The trainer's rank 0 is the gloo
    backend's `GlooCollective`; the fake engines' workers run the real gloo worker engine."""
    import socket

    from rollout.weights.trainer import GlooCollective

    new = {k: v + 1 for k, v in WEIGHTS.items()}
    info = {k: (tuple(v.shape), v.dtype) for k, v in new.items()}
    pool = FakePool(2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with RolloutGenerationOwned(generation_cfg, pool) as gen:
        trainer: list[GlooCollective] = []  # the policy's init_collective: rank 0 hosts the store
        joining = threading.Thread(
            target=lambda: trainer.append(
                GlooCollective("127.0.0.1", port, 1 + 2, rank=0, train_world_size=1, timeout_s=10)
            )
        )
        joining.start()
        assert gen.init_collective("127.0.0.1", port, 1 + 2, train_world_size=1) == []
        joining.join(10)
        with pytest.raises(InvalidWeightsError, match="missing"):
            gen.prepare_refit_info({})
        gen.prepare_refit_info(info)
        for step in (1, 2):
            broadcast = threading.Thread(
                target=trainer[0].broadcast, args=(new,)
            )  # policy.broadcast_weights_for_collective()
            broadcast.start()
            results = gen.update_weights_from_collective()
            broadcast.join(10)
            assert results == [True] and gen.engine.epoch == step
        for e in pool.engines:
            assert all(torch.equal(e.worker.model.loaded[n], t) for n, t in new.items())
        trainer[0].shutdown()


class RolloutGenerationOwned:
    """A RolloutGeneration that starts (and stops) its engine over a fake pool, as NeMo RL's do."""

    def __init__(self, cfg, pool):
        from rollout.nemo_rl import RolloutGeneration

        self.gen = RolloutGeneration(cfg, pool=pool)

    def __enter__(self):
        return self.gen

    def __exit__(self, *exc):
        self.gen.shutdown()
