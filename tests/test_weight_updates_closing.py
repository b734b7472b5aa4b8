"""An engine that closes with a weight update in flight (`rollout.weights.updates`): the update ends
with EngineClosedError, nothing is restarted, the pool is shut down (fake engines: the race is the
driver's, not vLLM's)."""

from __future__ import annotations

import anyio
import pytest

from rollout.engine import RolloutEngine
from rollout.errors import EngineClosedError, EngineDeadError
from tests.support.fakes import FakeEngine, FakePool
from tests.support.model import STATE


class DyingEngine(FakeEngine):
    """As a Ray engine is at shutdown: a load in flight fails once its actor is gone."""

    async def commit_weights(self, epoch: int) -> dict[str, float]:
        if self.commit_gate is not None:
            await self.commit_gate.wait()
        if self.dead:
            raise EngineDeadError(f"engine {self.engine_id} was shut down")
        return await super().commit_weights(epoch)


class Pool(FakePool):
    async def shutdown(self) -> None:
        for e in self.engines:
            e.dead = True
            if e.commit_gate is not None:
                e.commit_gate.set()
        await super().shutdown()


@pytest.mark.parametrize("phase", ["loading", "waiting for the lock"])
async def test_an_update_in_flight_when_the_engine_closes_gets_engine_closed_error(make_cfg, phase):
    pool = Pool([DyingEngine(0), DyingEngine(1)])
    for e in pool.engines:
        e.commit_gate = anyio.Event()  # the load hangs until the pool shuts down
    errors: list[BaseException] = []

    async def update(engine: RolloutEngine) -> None:
        try:
            await engine.update_weights(STATE)
        except BaseException as e:
            errors.append(e)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            async with RolloutEngine(make_cfg("engines.max_restarts=3"), pool=pool) as engine:  # restarts allowed
                tg.start_soon(update, engine)
                if phase == "waiting for the lock":
                    tg.start_soon(update, engine)
                while not all(e.staged for e in pool.engines):
                    await anyio.sleep(0)  # the fakes' own state: the first update is loading
    assert len(errors) == (2 if phase == "waiting for the lock" else 1)
    assert all(isinstance(e, EngineClosedError) for e in errors), errors
    assert "shut down" in str(errors[0]) and pool.shutdown_calls == 1 and pool.restarts == []


async def test_a_closed_engine_answers_engine_closed_error_not_its_old_actors(make_cfg):
    """The first engine of a process, once closed, must not reach its actors: after a second engine
    started Ray again, its handles would answer Ray's "Can't find actor"."""
    async with RolloutEngine(make_cfg(), pool=Pool([DyingEngine(0)])) as engine:
        assert len(await engine.stats()) == 1
    for call in (engine.stats, engine.metrics, lambda: engine.update_weights(STATE)):
        with pytest.raises(EngineClosedError, match="shut down"):
            await call()
