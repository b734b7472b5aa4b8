"""Every tier: engine starts counted, and no test may leave an asyncio transport for the garbage
collector to close.

Engine starts: every pool start and engine restart, in this process or any process it starts
(`rollout.log.record_engine_start` appends to the file `$ROLLOUT_ENGINE_STARTS` names), is summed
at the end of the run, each with its kind and the test that caused it (`tests.support.starts`):
the count cannot drift from what the suite really started.

asyncio's `_SelectorTransport.__del__` closes the socket without unregistering it from its loop's
selector (CPython 3.11). The loop's selector map keeps the fd; the kernel's epoll set drops it. A
later socket given the same fd number is then registered as a mere change of callback, never
added to epoll, and never read: its request hangs. The same goes for any socket closed while its
loop still polls it. In CI a test's 512 HTTP requests hung so (8 of them: their replies sat in
their sockets, their fds in neither the loop's selector map nor its epoll set) after an earlier
test left its `AsyncOpenAI` client unclosed. Both are recorded here and fail the test that did
it, with where the socket was closed.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import tempfile
import traceback
from asyncio import selector_events

import pytest

from rollout.log import STARTS_ENV
from tests.support import starts

pytest_plugins = ["tests.support.fixtures"]  # the unit tier's shared fixtures (make_cfg, model_dir, ...)

_leaked: list[str] = []
_created = [0]  # transports made since the last check: only then can one be left to the collector
_close_on_gc = selector_events._SelectorTransport.__del__
_init = selector_events._SelectorTransport.__init__


def _counting_init(self, *args, **kwargs):  # noqa: ANN001 -- asyncio's own signature
    _created[0] += 1
    _init(self, *args, **kwargs)


def _recording_del(self, *args):  # noqa: ANN001 -- asyncio's own signature
    if self._sock is not None:
        _leaked.append(repr(self))
    _close_on_gc(self, *args)


selector_events._SelectorTransport.__del__ = _recording_del
selector_events._SelectorTransport.__init__ = _counting_init
_close = socket.socket.close


def _checked_close(self: socket.socket) -> None:
    fd = self.fileno()
    try:
        polled = fd >= 0 and fd in asyncio.get_running_loop()._selector.get_map()  # type: ignore[attr-defined]
    except RuntimeError:  # no loop runs in this thread
        polled = False
    if polled:
        _leaked.append(
            f"socket fd {fd} closed while its loop still polls it, at:\n{''.join(traceback.format_stack(limit=12))}"
        )
    _close(self)


socket.socket.close = _checked_close  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def no_transport_left_to_the_garbage_collector():
    yield
    # A full collection walks the torch/vLLM heap (~0.4 s): 600 unit tests spent 4 minutes in it.
    # A test that made no transport cannot have left one.
    if _created[0]:
        _created[0] = 0
        gc.collect()
    leaked, _leaked[:] = list(_leaked), []
    assert not leaked, (
        f"transports closed by the garbage collector, not by their owner (close the client): {leaked[:4]}"
    )


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get(STARTS_ENV):  # inherited by every process the suite starts
        fd, path = tempfile.mkstemp(prefix="rollout-engine-starts-", suffix=".jsonl")
        os.close(fd)
        os.environ[STARTS_ENV] = path
        config.stash[_starts_file] = path


def pytest_runtest_logstart(nodeid: str) -> None:
    """The test that runs from here on, in the record: the starts that follow are its."""
    if nodeid.startswith(starts.PREFIX):
        starts.append("test", test=nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:  # noqa: ANN001
    path = config.stash.get(_starts_file, None)
    if path is None:
        return
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    os.unlink(path)
    terminalreporter.write_sep("=", "engine starts")
    for line in starts.summary(records):
        terminalreporter.write_line(line)


_starts_file = pytest.StashKey[str]()
