"""The updates that do not wait, against real engines: `update_weights(wait=False)` (Ray's object
store) and vLLM's trainer API over `weight_sync_client(wait=False)` with our gloo trainer's
`hand_off`, taking turns while 2 engines stream, each landing inside running requests (the same
harness as test_weights.py's oracle test; that the calls return before any engine loads is
tests/test_weight_transfer.py's). Every token's epoch is exact: the float32 oracle replays every
logprob within 1e-3.
"""

from __future__ import annotations

import asyncio
import itertools

import anyio
import msgspec
from safetensors.torch import load_file

from policies.oracle import Oracle, compare
from policies.processing import Processing
from rollout import RolloutEngine
from tests.support.engines import integration_config
from tests.support.oracle_runs import MAX_TOKENS, MIN_TOKENS, SAMPLING, SMALL_KV, UPDATES, prompts, run_with_updates


async def handed_off_trainer(engine: RolloutEngine, weights: dict) -> tuple[object, object]:
    """vLLM's trainer factory builds our gloo trainer with `hand_off`, over a client that does not wait."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from policies.gloo_transfer import GlooTrainerInitInfo, StateDictSource

    client, source = engine.weight_sync_client(wait=False), StateDictSource(weights)
    init = GlooTrainerInitInfo(world_size=1 + client.world_size(), rank=0, timeout_s=600, hand_off=True)
    trainer = await anyio.to_thread.run_sync(
        lambda: WeightTransferTrainerFactory.trainer_init(init, client=client, source=source)
    )
    return trainer, source


async def test_updates_that_do_not_wait_keep_every_epoch_exact(pools):
    cfg = integration_config(
        "weight_sync.mode=keep", "engines.count=2", "engines.max_inflight_per_engine=16", SMALL_KV, *SAMPLING
    )
    async with pools.engine(cfg) as engine:  # the oracle test's keep engines
        start = engine.epoch
        weights = {start: load_file(f"{engine.model_path}/model.safetensors")}
        trainer, source = await handed_off_trainer(engine, weights[start])
        calls = itertools.count()
        returned: list[int] = []

        async def update(w: dict) -> int:
            if next(calls) % 2:
                epoch = await engine.update_weights(w, wait=False)
            else:
                source.update(w)
                await anyio.to_thread.run_sync(trainer.send_weights)
                epoch = engine._updates.allocated  # the round's epoch: its finish runs on the trainer's thread
            returned.append(epoch)
            return epoch

        batch = prompts(32, seed=11)
        trajectories = await run_with_updates(
            engine, [batch[8 * k : 8 * (k + 1)] for k in range(UPDATES + 1)], update, weights
        )
        await anyio.to_thread.run_sync(trainer.settle)
        assert await engine.weights_loaded() == start + UPDATES
        await anyio.to_thread.run_sync(trainer.shutdown)
        updates = list(engine.weight_updates)  # this run's (the shared engines' hand-back updates once more)
    epochs = [start + k for k in range(UPDATES + 1)]
    assert [u.epoch for u in updates] == epochs[1:] and not any(u.failed for u in updates)
    assert returned == epochs[1:]
    assert {e for t in trajectories for e in t.token_epochs()} == set(epochs)
    assert sum(len(t.policy_epochs) > 1 for t in trajectories) >= 8
    oracle = Oracle(engine.model_path, weights)
    processed = Processing.of(
        msgspec.structs.replace(engine.cfg.sampling, max_tokens=MAX_TOKENS, min_tokens=MIN_TOKENS), stop_ids=[2]
    )
    report = await asyncio.to_thread(compare, oracle, trajectories, 1e-3, 20, processed)
    assert report.tokens == sum(len(t.token_ids) for t in trajectories)
    assert report.ok, msgspec.json.encode(report).decode()[:2000]
