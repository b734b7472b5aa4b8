"""The engine actor's group calls, batched both ways (see `actors.pool.RayEngine`): groups arrive
in bulk through `submit`, each runs in a task of its own, and their samples leave in bulk through
`collect`, each as soon as it finishes (not when its group does: the driver gives the sample's
slot on this engine to the next request at once).

Owns: the submitted groups' tasks (`cancel` stops them) and their results until collected. Every
task, unless the driver cancelled it, ends in one `GroupResult` per sample or in one with the
error that ended it: nothing the driver waits for can vanish. Does not own: running a group
(`VLLMPolicy.stream_group`; an engine without one runs `finish_group` and sends its samples together).
"""

from __future__ import annotations

import asyncio

import msgspec

from rollout.errors import EngineDeadError
from collections.abc import AsyncIterator

from rollout.types import GroupResult, Request, Trajectory


class GroupCalls:
    engine_id: int

    def __init__(self) -> None:
        self._groups: dict[str, asyncio.Task] = {}  # key -> the task running that submitted group
        self._results: list[GroupResult] = []  # finished groups `collect` has not handed over yet
        self._result_ready = asyncio.Event()

    async def finish_group(self, requests: list[Request]) -> list[Trajectory]:
        raise NotImplementedError

    async def stream_group(self, requests: list[Request]) -> AsyncIterator[Trajectory]:
        """A group's trajectories as each finishes; cancelling aborts the rest. By default all at once."""
        for traj in await self.finish_group(requests):
            yield traj

    async def submit(self, batch: bytes) -> None:
        """Start groups: msgpack `[(key, requests)]`. Each comes back once from `collect`, unless cancelled."""
        for key, requests in msgspec.msgpack.decode(batch, type=list[tuple[str, list[Request]]]):
            self._groups[key] = asyncio.ensure_future(self._run_group(key, requests))

    async def _run_group(self, key: str, requests: list[Request]) -> None:
        """One submitted group, to a `GroupResult` per sample as it finishes. A task nobody awaits:
        every way out but `cancel` (the driver gave it up) ends the group's results, or the driver
        would wait for it forever."""
        sent = 0
        try:
            async for traj in self.stream_group(requests):
                self._post(GroupResult(key=key, trajectories=[traj]))
                sent += 1
            if sent == len(requests):
                return
            result = GroupResult(key=key, error=f"engine {self.engine_id}: {sent} of {len(requests)} samples came back")
        except EngineDeadError as e:
            result = GroupResult(key=key, error=str(e), dead=True)
        except Exception as e:  # not a bad request (that is an error trajectory): the group fails
            result = GroupResult(key=key, error=f"engine {self.engine_id}: {type(e).__name__}: {e}")
        except asyncio.CancelledError:
            if key not in self._groups:  # `cancel` took it out first: nobody waits for it
                raise
            result = GroupResult(key=key, error=f"engine {self.engine_id}: the group was cancelled inside the engine")
        finally:
            self._groups.pop(key, None)
        self._post(result)

    def _post(self, result: GroupResult) -> None:
        self._results.append(result)
        self._result_ready.set()

    async def collect(self) -> bytes:
        """Every sample (or group error) finished since the last call, msgpack `[GroupResult]`; waits for one at least."""
        while not self._results:
            self._result_ready.clear()
            await self._result_ready.wait()
        results, self._results = self._results, []
        return msgspec.msgpack.encode(results)

    async def cancel(self, keys: list[str]) -> None:
        """Stop these groups (their requests are aborted); they never come back from `collect`."""
        for key in keys:
            if (task := self._groups.pop(key, None)) is not None:
                task.cancel()
