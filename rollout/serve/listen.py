"""The server's listening socket and uvicorn without its signal handlers.

Owns: binding the listening socket itself (a port in use is an `OSError` naming the address,
never uvicorn's `sys.exit`); a uvicorn server that leaves Ctrl-C and SIGTERM to the engine.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one). Raises OSError naming the address."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise OSError(e.errno, f"serve: cannot listen on {host}:{port}: {e.strerror or e}") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"serve: cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.setblocking(False)
    return sock


def uvicorn_server(config: Any) -> Any:
    """uvicorn's server without its signal handlers: the engine's own handling of Ctrl-C and
    SIGTERM shuts everything down, this server included."""
    import uvicorn

    class Quiet(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            yield

    return Quiet(config)
