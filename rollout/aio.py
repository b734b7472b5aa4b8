"""Asyncio helpers shared by the driver and the engines' implementations."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


async def as_finished(coros: Iterable[Awaitable[T]]) -> AsyncIterator[T]:
    """Run `coros` concurrently; yield each result as it finishes (an exception ends the stream).

    For engine implementations of `generate_group`. Closing or cancelling the stream cancels
    whatever is still running, and waits for it to unwind (vLLM aborts a cancelled request).
    """
    results: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue()

    async def run(coro: Awaitable[T]) -> None:
        try:
            results.put_nowait((await coro, None))
        except Exception as e:
            results.put_nowait((None, e))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # ours (the stream closed): nobody waits for it
                raise
            # Cancelled from within (a library's own abort or timeout): the stream waits for a
            # result that would never come, so it gets an error instead.
            results.put_nowait((None, RuntimeError("a request was cancelled inside the engine")))

    tasks = [asyncio.ensure_future(run(c)) for c in coros]
    try:
        for _ in tasks:
            value, error = await results.get()
            if error is not None:
                raise error
            yield value
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def fan_out(calls: Iterable[Awaitable[T]], per_turn: int = 16) -> list[T | BaseException]:
    """`asyncio.gather(*calls, return_exceptions=True)`, starting at most `per_turn` calls per turn
    of the event loop.

    Starting a Ray actor call costs its caller ~0.2-0.3 ms of CPU: one per engine of 256 started
    in one turn hold the loop for ~60 ms, and every group an engine finishes meanwhile waits behind
    them. Between turns the loop reads its sockets. Cancelled, it cancels the calls it started.
    """
    tasks: list[asyncio.Future[T]] = []
    try:
        for call in calls:  # the next call is made only when it starts (a coroutine made and dropped warns)
            tasks.append(asyncio.ensure_future(call))
            if len(tasks) % per_turn == 0:
                await asyncio.sleep(0)
        return await asyncio.gather(*tasks, return_exceptions=True)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
