"""`policies.weight_loading` against an engine core that runs utility calls only between steps, as
vLLM's does (`EngineCoreProc.run_busy_loop`: the input queue, then a step): what a weight-transfer
round costs a generating engine is how many gaps between steps it waits for."""

from __future__ import annotations

import asyncio
from typing import Any

from policies.vllm_policy import VLLMPolicy
from rollout.config import load_config


class SteppingCore:
    """vLLM's calls queue up; `gap()` answers every call queued so far (one gap between two steps)
    and records which ran together."""

    def __init__(self) -> None:
        self.queued: list[tuple[str, asyncio.Future]] = []
        self.gaps: list[list[str]] = []

    def _call(self, name: str) -> asyncio.Future:
        done = asyncio.get_running_loop().create_future()
        self.queued.append((name, done))
        return done

    async def gap(self) -> None:
        for _ in range(10):  # let callers that are about to send do so (no clock: loop turns)
            await asyncio.sleep(0)
        batch, self.queued = self.queued, []
        self.gaps.append([name for name, _ in batch])
        for _, done in batch:
            done.set_result(None)

    async def start_update(self) -> None:
        await self._call("start_weight_update")

    async def update_weights(self, update_info: Any) -> None:
        await self._call("update_weights")

    async def finish_update(self) -> None:
        await self._call("finish_weight_update")

    async def pause(self, mode: str, clear_cache: bool) -> None:
        await self._call("pause")

    async def resume(self) -> None:
        await self._call("resume")

    async def set_epoch(self, epoch: int) -> None:
        await self._call("set_epoch")

    async def abort(self, ids: list[str]) -> None:
        await self._call("abort")


async def run_round(policy: VLLMPolicy, core: SteppingCore, *calls: tuple[str, tuple]) -> None:
    """The driver's calls in order, each answered once the engine core's gaps let it."""
    for name, args in calls:
        call = asyncio.ensure_future(getattr(policy, name)(*args))
        while not call.done():
            await core.gap()
        call.result()


async def test_a_staged_rounds_start_and_update_wait_for_one_gap_between_steps_not_two() -> None:
    """A staging backend (`gloo`, `shm`: the CPU default) changes nothing at vLLM's start, so its
    start goes out with the transfer: both run in the same gap, and a generating engine's round
    waits for one step there, not two (fails when `start_transfer` awaits vLLM's start itself)."""
    core = SteppingCore()
    policy = VLLMPolicy(load_config(None, ["weight_sync.mode=keep"]), "", 0, frontend=core)
    info = {"names": [], "dtype_names": [], "shapes": []}
    await run_round(policy, core, ("start_transfer", (1,)), ("transfer", (info,)))
    assert [g for g in core.gaps if g] == [["start_weight_update", "update_weights"]]
    # a second update_weights call of the same round (a sharded learner's next rank) sends no start
    await run_round(policy, core, ("transfer", (info,)), ("finish_transfer", (1,)))
    names = [n for g in core.gaps for n in g]
    assert names.count("start_weight_update") == 1 and names.count("update_weights") == 2
    assert names[-1] == "resume" and policy.epoch == 1


async def test_a_staged_round_called_off_before_its_transfer_never_starts_vllms_update() -> None:
    """Another engine could not start: the round is called off (`loaded=False`) before any transfer;
    this engine's vLLM never saw a start, so nothing is sent and the epoch stays."""
    core = SteppingCore()
    policy = VLLMPolicy(load_config(None), "", 0, frontend=core)
    await run_round(policy, core, ("start_transfer", (1,)), ("finish_transfer", (1, False)))
    assert [n for g in core.gaps for n in g] == [] and policy.epoch == 0
    # and the next round starts as usual
    await run_round(policy, core, ("start_transfer", (2,)), ("transfer", ({"names": []},)), ("finish_transfer", (2,)))
    assert [g for g in core.gaps if g][0] == ["start_weight_update", "update_weights"] and policy.epoch == 2


async def test_update_calls_of_one_staged_round_made_together_all_go_out_after_its_start() -> None:
    """A sharded learner's ranks call update_weights side by side: whichever engine call comes
    first sends vLLM's start, and no update overtakes it (a shm worker given an update before
    its start would wait for a drain that the start joins)."""
    core = SteppingCore()
    policy = VLLMPolicy(load_config(None), "", 0, frontend=core)
    await run_round(policy, core, ("start_transfer", (1,)))
    calls = [asyncio.ensure_future(policy.transfer({"names": [f"rank{k}"]})) for k in range(3)]
    while not all(c.done() for c in calls):
        await core.gap()
    for c in calls:
        c.result()
    assert [g for g in core.gaps if g] == [
        ["start_weight_update", "update_weights", "update_weights", "update_weights"]
    ]


class RefusingCore(SteppingCore):
    """vLLM's update_weights raises for a settle whose bytes did not all arrive (as our staging
    backends do; vLLM then ends its update), and records the control infos it got."""

    def __init__(self, missing: bool) -> None:
        super().__init__()
        self.missing, self.controls = missing, []

    async def update_weights(self, update_info: Any) -> None:
        await super().update_weights(update_info)
        if set(update_info) & {"settle", "discard"}:
            self.controls.append(next(iter(update_info)))
            if self.missing and "settle" in update_info:
                raise RuntimeError("gloo transfer: bucket 2/3 (lm_head.weight): closed; the model is unchanged")


async def test_a_staged_round_whose_bytes_did_not_all_arrive_answers_why_and_the_engine_serves_on() -> None:
    """The settle before the finish finds a bucket missing: the engine answers why instead of
    breaking (vLLM ended its update, the model untouched), never paused, still serving its epoch."""
    core = RefusingCore(missing=True)
    policy = VLLMPolicy(load_config(None), "", 0, frontend=core)
    await run_round(policy, core, ("start_transfer", (1,)), ("transfer", ({"names": []},)))
    settle = asyncio.ensure_future(policy.transfer({"settle": True}))
    while not settle.done():
        await core.gap()
    assert "bucket 2/3 (lm_head.weight)" in settle.result() and policy._broken is None
    assert "pause" not in [n for g in core.gaps for n in g] and policy.epoch == 0 and policy._open.is_set()


async def test_a_staged_round_called_off_after_its_transfer_drops_the_bytes_unloaded() -> None:
    """Another engine's bytes did not all arrive: this engine's round is called off (`loaded=False`)
    after its transfer; its backend drops the staging (a discard), vLLM's finish loads nothing,
    no pause, and the epoch stays."""
    core = RefusingCore(missing=False)
    policy = VLLMPolicy(load_config(None), "", 0, frontend=core)
    await run_round(policy, core, ("start_transfer", (1,)), ("transfer", ({"names": []},)),
                    ("transfer", ({"settle": True},)), ("finish_transfer", (1, False)))  # fmt: skip
    names = [n for g in core.gaps for n in g]
    assert core.controls == ["settle", "discard"] and "pause" not in names and "set_epoch" not in names
    assert names.index("update_weights", names.index("start_weight_update") + 2) < names.index("finish_weight_update")
    assert policy.epoch == 0 and policy._broken is None
