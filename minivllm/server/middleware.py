"""ASGI guards in front of the routes: the API key and the request body size.

Both answer with the OpenAI error body before any route runs. They are plain
ASGI middleware (no ``BaseHTTPMiddleware``), so a streamed response and the
route's disconnect watch (``receive()`` after the body) pass through untouched.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from minivllm.server.protocol import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# The API key guards the OpenAI API, /v1 and below, as in vLLM; /health, /metrics and the
# rest stay open (a load balancer's probe and a metrics scraper carry no key).
PROTECTED_PREFIX = "/v1"

# After a body grows past the limit, this many more bytes are read and dropped before
# the 413 goes out: a client still sending when the server closes the connection gets
# a reset and may never read the answer; past this, the server stops reading anyway.
DRAIN_BYTES = 8 << 20


async def send_error(send: Send, status: int, message: str,
                     headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """Answer with the OpenAI error body."""
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


def _protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")


class ApiKeyMiddleware:
    """Every HTTP route under ``/v1`` requires ``Authorization: Bearer <api_key>``, or
    ``x-api-key: <api_key>`` (the Anthropic clients' header); otherwise 401 (the key is
    compared in constant time)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        bearer, x_api_key = _header(scope, b"authorization"), _header(scope, b"x-api-key")
        given = x_api_key if bearer is None else bearer
        expected = self._key if bearer is None else b"Bearer " + self._key
        if given is None:
            await send_error(send, 401, "missing API key: send the header 'Authorization: Bearer <key>'",
                             ((b"www-authenticate", b"Bearer"),))
        elif not hmac.compare_digest(given, expected):
            where = "Authorization" if bearer is not None else "x-api-key"
            await send_error(send, 401, f"invalid API key in the {where} header",
                             ((b"www-authenticate", b"Bearer"),))
        else:
            await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads each request body before the route does, at most ``max_bytes`` of it; a larger
    one (by ``Content-Length`` or as it arrives, chunked) is answered 413.

    The route then receives the buffered body as one message; later ``receive()`` calls
    go to the server (they report the client's disconnect).
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = _header(scope, b"content-length")
        # uvicorn's parsers refuse a Content-Length that is not a number; checked anyway.
        if header is not None and not header.strip().isdigit():
            await send_error(send, 400, "the Content-Length header is not a number")
            return
        declared = int(header) if header is not None else None
        too_big = declared is not None and declared > self.max_bytes
        if declared is not None and declared > self.max_bytes + DRAIN_BYTES:
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        size, more = 0, True
        while more and size <= self.max_bytes + DRAIN_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body was read: nobody to answer
            body = message.get("body", b"")
            size += len(body)
            more = message.get("more_body", False)
            too_big = too_big or size > self.max_bytes
            if not too_big:
                chunks.append(body)
        if too_big:
            await self._refuse(send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        await send_error(send, 413, f"request body: larger than the limit of {self.max_bytes} bytes "
                                    "(the server's --max-body-bytes)")
