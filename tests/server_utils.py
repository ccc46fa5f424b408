"""The OpenAI server of a test, served by uvicorn on 127.0.0.1 in a thread of the test process."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any, Iterator

import uvicorn


@contextlib.contextmanager
def served(app: Any, timeout: float = 60.0) -> Iterator[tuple[str, uvicorn.Server]]:
    """``app`` on a free port of 127.0.0.1: yields (base URL without ``/v1``, the uvicorn
    server); stopped, and its thread joined, on exit."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
