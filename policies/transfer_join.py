"""A worker's rendezvous with the learner, off vLLM's engine core: what `init_weight_transfer_engine`
starts for our backends (`policies.gloo_transfer`, `policies.shm_transfer`) and the round's calls
wait for.

vLLM runs `init_weight_transfer_engine` inside the engine core, which generates nothing while a
utility call runs. So a worker's init only checks the info and starts a `Join`: a daemon thread
that meets the learner (gloo: its store and the pair group; shm: its socket and ring) within the
init's `timeout_s`. The first call that needs the connection waits for it (`wait`, never past
that deadline) and raises the rendezvous's error, naming where it looked; `failure` and `peek`
answer without waiting. A new init, or the worker's shutdown, `close`s a join whichever state it
is in: a pending one is told to stop (`stop`, and what it `hold`s is closed, so a blocked socket
wakes), and what it connects later is closed by its own thread, never kept.

Owns: `Join`. Does not own: what a rendezvous does (the backends' `connect`), the round's calls.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any


class Join:
    """One init's rendezvous, run by `connect(self)` in a daemon thread; `close(result)` releases
    a result nobody will use. Thread-safe: the thread publishes its outcome under the lock, and
    a join closed first has its late result closed by the thread itself."""

    def __init__(self, what: str, timeout_s: float, connect: Callable[[Join], Any], close: Callable[[Any], None]):
        self.what, self.timeout_s, self.deadline = what, timeout_s, time.monotonic() + timeout_s
        self.stop = threading.Event()  # set by `close`: the rendezvous gives up at its next check
        self._connect: Callable[[Join], Any] | None = connect
        self._release = close
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._result: Any = None
        self._error: str | None = None
        self._held: list[Any] = []  # sockets the rendezvous blocks on: closed by `close` to wake it
        self.thread = threading.Thread(target=self._run, daemon=True, name="transfer-join")
        self.thread.start()

    def _run(self) -> None:
        connect, self._connect = self._connect, None  # no cycle back to the worker: it goes with its last reference
        try:
            got, error = connect(self), None
        except BaseException as e:  # noqa: BLE001 -- reported by the call that waits for it
            got, error = None, f"{self.what}: {type(e).__name__}: {e}"
        del connect
        with self._lock:
            late = self.stop.is_set()
            if not late:
                self._result, self._error = got, error
            self._held = []
            self._done.set()
        if late and got is not None:
            self._release(got)

    def hold(self, sock: Any) -> None:
        """`sock` is closed by `close` (so a rendezvous blocked on it wakes at once)."""
        with self._lock:
            if self.stop.is_set():
                sock.close()
                raise ConnectionAbortedError("the join was closed")
            self._held.append(sock)

    def done(self) -> bool:
        return self._done.is_set()

    def peek(self) -> Any:
        """The rendezvous's result if it succeeded; None while it runs or if it failed."""
        return self._result if self._done.is_set() else None

    def failure(self) -> str | None:
        """Why the rendezvous failed, without waiting; None while it runs or once it succeeded."""
        return self._error if self._done.is_set() else None

    def wait(self) -> Any:
        """The result, waiting at most until the init's deadline. Raises RuntimeError naming where
        the rendezvous looked and the timeout, if it failed or is still running then."""
        if not self._done.wait(max(self.deadline - time.monotonic(), 0)):
            self._fail(f"{self.what}: TimeoutError: no rendezvous within {self.timeout_s:g} s")
        if self._error is not None:
            raise RuntimeError(self._error)
        return self._result

    def _fail(self, error: str) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            self.stop.set()  # its thread's late result is closed, never used
            held, self._held = self._held, []
            self._done.set()
        for sock in held:
            with contextlib.suppress(OSError):
                sock.close()

    def close(self) -> None:
        """Releases the rendezvous whatever its state: a running one stops (and closes what it
        connects later), a result is closed. Returns at once."""
        self._fail(f"{self.what}: closed before it completed")
        with self._lock:
            got, self._result = self._result, None
            if got is not None:
                self._error = f"{self.what}: closed"
        if got is not None:
            self._release(got)
