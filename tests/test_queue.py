"""The trajectory queue: bounded slots, hand-off order, end of stream, fatal errors."""

from __future__ import annotations

import anyio
import pytest
from anyio import wait_all_tasks_blocked

from rollout.errors import EngineDeadError
from rollout.handout.queue import TrajectoryQueue
from rollout.types import Group, Prompt

TIMEOUT = 5  # seconds; only reached when a test is about to fail


def group(pid: str) -> Group:
    return Group(prompt_id=pid, prompt=Prompt(id=pid))


async def test_ready_first_hands_out_in_finishing_order():
    q = TrajectoryQueue(max_groups=3)
    with anyio.fail_after(TIMEOUT):
        seqs = [await q.reserve() for _ in range(3)]
        assert seqs == [0, 1, 2]
        assert q.in_flight == 3 and len(q) == 0
        for pid, seq in (("b", 1), ("a", 0), ("c", 2)):  # finishing order, not admission order
            q.put(group(pid), seq)
        assert q.in_flight == 0 and len(q) == 3
        assert [(await q.get()).prompt_id for _ in range(3)] == ["b", "a", "c"]
        assert await q.get() is None


async def test_in_order_holds_a_finished_group_until_the_earlier_ones():
    q = TrajectoryQueue(max_groups=4, in_order=True)
    got: list[str] = []
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                await q.reserve()

            async def consumer():
                while (g := await q.get()) is not None:
                    got.append(g.prompt_id)

            tg.start_soon(consumer)
            q.put(group("g2"), 2)
            q.put(group("g1"), 1)
            await wait_all_tasks_blocked()
            assert got == [] and len(q) == 0  # g0 still running
            q.put(group("g0"), 0)
            await wait_all_tasks_blocked()
            assert got == ["g0", "g1", "g2"]
            q.put(group("g3"), 3)
    assert got == ["g0", "g1", "g2", "g3"]


async def test_put_without_reserve_is_a_bug():
    q = TrajectoryQueue(max_groups=1)
    with pytest.raises(AssertionError, match="put without reserve"):
        q.put(group("a"), 0)


async def test_full_queue_blocks_reserve_until_a_get():
    q = TrajectoryQueue(max_groups=2)
    reserved = anyio.Event()
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await q.reserve()
            await q.reserve()
            q.put(group("a"), 0)  # finished groups still hold their slot until taken
            q.put(group("b"), 1)

            async def third():
                await q.reserve()
                reserved.set()

            tg.start_soon(third)
            await wait_all_tasks_blocked()
            assert not reserved.is_set()
            assert q.in_flight == 0
            assert (await q.get()).prompt_id == "a"  # frees one slot
            await reserved.wait()
            assert q.in_flight == 1 and len(q) == 1


async def test_get_returns_none_when_idle():
    q = TrajectoryQueue(max_groups=1)
    assert q.idle
    with anyio.fail_after(TIMEOUT):
        assert await q.get() is None


async def test_get_waits_while_a_group_is_running():
    q = TrajectoryQueue(max_groups=2)
    got: list = []
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await q.reserve()
            assert not q.idle

            async def consumer():
                got.append(await q.get())
                got.append(await q.get())

            tg.start_soon(consumer)
            await wait_all_tasks_blocked()
            assert got == []  # running group: no end of stream yet
            q.put(group("a"), 0)
    assert [g.prompt_id if g else None for g in got] == ["a", None]


async def test_producers_keep_the_stream_open():
    q = TrajectoryQueue(max_groups=2)
    got: list = []
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            q.producer_started()
            q.producer_started()
            assert not q.idle

            async def consumer():
                got.append(await q.get())

            tg.start_soon(consumer)
            await wait_all_tasks_blocked()
            q.producer_done()
            await wait_all_tasks_blocked()
            assert got == []  # one source is still being read
            q.producer_done()
    assert got == [None]
    assert q.idle


async def test_fail_makes_waiting_and_later_gets_raise():
    q = TrajectoryQueue(max_groups=2)
    q.producer_started()  # keeps get waiting
    errors: list[BaseException] = []
    boom = EngineDeadError("every engine is dead")
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:

            async def consumer():
                try:
                    await q.get()
                except EngineDeadError as e:
                    errors.append(e)

            tg.start_soon(consumer)
            await wait_all_tasks_blocked()
            q.fail(boom)
        assert errors == [boom]
        with pytest.raises(EngineDeadError, match="every engine is dead"):
            await q.get()


async def test_fail_after_queued_groups_hands_them_out_first():
    q = TrajectoryQueue(max_groups=2)
    with anyio.fail_after(TIMEOUT):
        await q.reserve()
        q.put(group("a"), 0)
        q.fail(EngineDeadError("dead"))
        assert (await q.get()).prompt_id == "a"
        with pytest.raises(EngineDeadError):
            await q.get()
