"""The OpenAI server of a test, served by uvicorn on 127.0.0.1 in a thread of the test process."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Callable, Iterator

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


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 20.0) -> None:
    """Poll ``predicate`` until true, at most ``timeout`` seconds (for state the server
    changes in its own threads, with no event to wait on)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
