"""`RolloutEngine` runs on fake engines (no vLLM, no Ray): a bounded engine, prompts, a consumer that
says when it would wait forever, and a wait until nothing can run (`settled`). Their config comes
from the `make_cfg` fixture (`tests.support.fixtures`)."""

from __future__ import annotations

from contextlib import asynccontextmanager

import anyio
from anyio import wait_all_tasks_blocked

from rollout.config import Config
from rollout.engine import RolloutEngine
from rollout.types import Group, Prompt
from tests.support.fakes import FakePool

TIMEOUT = 5  # seconds; only reached when a test is about to fail


class Deadlock(AssertionError):
    """The consumer waits for a group while every task is blocked: nothing can ever wake it."""


@asynccontextmanager
async def rollout(cfg: Config, pool: FakePool, **kwargs):
    """`RolloutEngine` on fakes, bounded: a test that would hang fails with TimeoutError instead."""
    with anyio.fail_after(TIMEOUT):
        async with RolloutEngine(cfg, pool=pool, **kwargs) as engine:
            yield engine


def prompts(count: int, length: int = 3) -> list[Prompt]:
    return [Prompt(token_ids=[10 + i] * length, id=f"q{i}") for i in range(count)]


async def all_groups(engine: RolloutEngine) -> list[Group]:
    """Every group `engine.groups()` hands out; raises Deadlock instead of hanging forever."""
    out: list[Group] = []
    errors: list[BaseException] = []
    done = anyio.Event()

    async def consume() -> None:
        try:
            async for group in engine.groups():
                out.append(group)
        except Exception as e:
            errors.append(e)
        finally:
            done.set()

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await settled()
            stuck = not done.is_set()
            if stuck:
                tg.cancel_scope.cancel()
    if stuck:
        raise Deadlock(f"groups() waits forever after {len(out)} groups: {[(g.prompt_id, g.error) for g in out]}")
    if errors:
        raise errors[0]
    return out


async def settled() -> None:
    """Until every task is blocked and the loop callbacks they left have run (anyio's
    `wait_all_tasks_blocked` sees tasks only): the lobby looks at freed room on the loop's next turn
    (`Lobby._freed`), that look may start a group, whose results free room again. The fakes have no
    timers, so once settled nothing runs until the test acts."""
    for _ in range(5):
        await wait_all_tasks_blocked()
        await anyio.lowlevel.checkpoint()  # the callbacks pending on the loop run before this task resumes
    await wait_all_tasks_blocked()


def total_requests(pool: FakePool) -> int:
    return sum(len(e.requests) for e in pool.engines)
