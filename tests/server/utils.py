"""The OpenAI server of a test, served by uvicorn on 127.0.0.1 in a thread of the test process."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
import time
from pathlib import Path
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


FIXTURE_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def add_fixture_tokenizer(path: str | os.PathLike[str]) -> str:
    """``path`` with the tiny-qwen3 fixture's character tokenizer (100 ids) copied beside its
    weights (returned), so a checkpoint of that vocabulary serves text."""
    fixture = Path(__file__).resolve().parents[2] / "fixtures" / "tiny-qwen3"
    for name in FIXTURE_TOKENIZER_FILES:
        shutil.copy(fixture / name, path)
    return os.fspath(path)


def assert_server_completes_as_llm(llm: Any, prompt: str, max_tokens: int = 4) -> str:
    """The OpenAI server over ``llm`` answers a greedy completion of ``prompt`` with the text the
    offline ``llm.generate`` gives; returns that text."""
    from fastapi.testclient import TestClient

    from minivllm import SamplingParams
    from minivllm.server.app import build_app
    from minivllm.server.protocol import ServerConfig

    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)[0].text
    with TestClient(build_app(llm, ServerConfig("tiny"))) as client:
        r = client.post("/v1/completions", json=dict(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0, ignore_eos=True))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    return want
