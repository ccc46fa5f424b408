"""The FastAPI app: the OpenAI completions and chat API over an ``AsyncEngine``.

Every error leaves as the OpenAI body ``{"error": {"message", "type", "code"}}``:
400 for a request the protocol models or the engine refuse (nothing of it is
queued), 404 for an unknown model or route, 500 when the engine has failed.
A client that disconnects, streaming or not, aborts its requests.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.outputs import FinishReason
from minivllm.server.engine_loop import AsyncEngine, Delta, EngineDeadError, RequestGroup
from minivllm.server.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk,
                                      ChatCompletionRequest, ChatCompletionResponse,
                                      ChatStreamChoice, CompletionChoice, CompletionRequest,
                                      CompletionResponse, CompletionStreamResponse, DeltaMessage,
                                      ErrorInfo, ErrorResponse, ModelCard, ModelList, Usage,
                                      _Request)

T = TypeVar("T")

_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                500: "internal_server_error"}


class APIError(Exception):
    """An error answered with the OpenAI error body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, code=status,
                                         type=_ERROR_TYPES.get(status, "api_error")))
    return JSONResponse(body.model_dump(), status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    """``field: problem; ...``, one problem per top-level field."""
    problems: dict[str, list[str]] = {}
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        problems.setdefault(loc[0] if loc else "", []).append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    # A union (``prompt``) reports one error per member it tried: say so instead.
    parts = [msgs[0] if len(msgs) == 1 else f"{field}: matches none of its accepted types ({msgs[0]}, ...)"
             for field, msgs in problems.items()]
    return "; ".join(parts) or "invalid request"


def _sse(payload: Any) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class _Server:
    """The handlers' shared state: the engine, the model's name and its tokenizer."""

    def __init__(self, llm: Any, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name
        self.engine = AsyncEngine.from_llm(llm)
        self.created = int(time.time())

    # ---- prompts -------------------------------------------------------------

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """Token ids of each prompt (text is tokenized; ids checked against the vocabulary)."""
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts: list[Any] = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, "prompt: is empty")
        return [self._token_ids(i, p) for i, p in enumerate(prompts)]

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        return self._token_ids(0, self.llm.chat_prompt_ids([m.model_dump() for m in req.messages]))

    def _token_ids(self, i: int, prompt: Any) -> list[int]:
        try:  # LLM's one prompt check: tokenize, non-empty, ids inside the vocabulary
            return self.llm.prompt_token_ids(i, prompt)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"prompt: {e}") from e

    # ---- running requests ----------------------------------------------------

    def check_model(self, req: _Request) -> None:
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves "
                                f"{self.model_name!r}")

    async def submit(self, kind: str, prompts: list[list[int]], req: _Request
                     ) -> tuple[str, int, RequestGroup]:
        """Queue one request per prompt; returns the response id (``kind-<hex>``), its
        creation time and the requests' group."""
        request_id, created = f"{kind}-{uuid.uuid4().hex}", int(time.time())
        try:
            params = req.to_sampling_params()
            ids = [f"{request_id}-{i}" for i in range(len(prompts))]
            return request_id, created, await self.engine.add_requests(ids, prompts, params)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from e
        except EngineDeadError as e:
            raise APIError(500, str(e)) from e

    async def collect(self, request: Request, group: RequestGroup) -> list[list[Delta]]:
        """Every delta of ``group``, by choice index; a client gone meanwhile aborts it."""
        deltas: list[list[Delta]] = [[] for _ in group.request_ids]

        async def gather() -> None:
            async for d in group:
                deltas[d.index].append(d)

        await self.until_disconnect(request, group, gather())
        return deltas

    async def until_disconnect(self, request: Request, group: RequestGroup,
                               work: Awaitable[T]) -> T:
        """Await ``work``; if the client disconnects first, abort ``group`` and cancel it."""
        work_task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work_task.done():
                work_task.cancel()
                self.engine.abort(group.request_ids)
            watch.cancel()
        try:
            return work_task.result()
        except EngineDeadError as e:
            raise APIError(500, str(e)) from e

    async def stream(self, group: RequestGroup,
                     chunks: Callable[[Delta], list[str]], first: list[str]) -> AsyncIterator[str]:
        """Server-sent events: ``first``, then ``chunks(delta)`` per delta, then ``[DONE]``.

        Leaving early (the client disconnected, so the server cancelled this generator)
        aborts the group's unfinished requests.
        """
        try:
            for event in first:
                yield event
            async for delta in group:
                for event in chunks(delta):
                    yield event
        except EngineDeadError as e:
            yield _sse(ErrorResponse(error=ErrorInfo(message=str(e), type="internal_server_error",
                                                     code=500)).model_dump())
        finally:
            if not group.finished:
                self.engine.abort(group.request_ids)
        yield _sse("[DONE]")


async def _wait_for_disconnect(request: Request) -> None:
    # After the body, receive() returns only when the client leaves (or the response ends).
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(per_choice: list[list[Delta]]) -> Usage:
    prompt = sum(d[-1].num_prompt_tokens for d in per_choice)
    completion = sum(d[-1].num_completion_tokens for d in per_choice)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def build_app(llm: Any, model_name: str) -> FastAPI:
    """The OpenAI-compatible app over ``llm`` (an ``LLM``: its engine, tokenizer and chat template).

    The engine thread starts with the app (lifespan) and stops with it.

    Raises:
        ValueError: ``llm`` has no tokenizer.
    """
    server = _Server(llm, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, server.engine.close)

    app = FastAPI(title="minivllm", lifespan=lifespan)
    app.state.server = server
    _add_error_handlers(app)
    _add_info_routes(app, server)
    _add_completion_route(app, server)
    _add_chat_route(app, server)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))


def _add_info_routes(app: FastAPI, server: _Server) -> None:
    @app.get("/health")
    async def health() -> Response:
        if server.engine.error is not None:
            return error_response(500, str(server.engine.error))
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = ModelCard(id=server.model_name, created=server.created,
                         max_model_len=server.engine.engine.scheduler_config.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus_text(server.engine),
                                 media_type="text/plain; version=0.0.4")


def prometheus_text(engine: AsyncEngine) -> str:
    """The engine's counters in the Prometheus text exposition format."""
    m = engine.metrics
    rows = [
        ("requests_total", "counter", "Requests admitted to the engine.", m.requests_total),
        ("requests_running", "gauge", "Requests in the running queue.", m.requests_running),
        ("requests_waiting", "gauge", "Requests waiting to be scheduled.", m.requests_waiting),
        ("requests_aborted_total", "counter", "Requests aborted by their client.",
         m.requests_aborted_total),
        ("generation_tokens_total", "counter", "Completion tokens generated.",
         m.generation_tokens_total),
        ("engine_steps_total", "counter", "Engine steps run.", m.engine_steps_total),
    ]
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP minivllm_{name} {help_text}", f"# TYPE minivllm_{name} {kind}",
                  f"minivllm_{name} {value}"]
    return "\n".join(lines) + "\n"


def _add_completion_route(app: FastAPI, server: _Server) -> None:
    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Response:
        server.check_model(req)
        rid, created, group = await server.submit("cmpl", server.completion_prompts(req), req)

        def chunk(d: Delta) -> list[str]:
            if not d.text and d.finish_reason is None:
                return []
            choice = CompletionChoice(index=d.index, text=d.text, finish_reason=d.finish_reason)
            return [_sse(CompletionStreamResponse(id=rid, created=created, model=server.model_name,
                                                  choices=[choice]).model_dump())]

        if req.stream:
            return StreamingResponse(server.stream(group, chunk, []), media_type="text/event-stream")
        deltas = await server.collect(request, group)
        choices = [CompletionChoice(index=i, text="".join(d.text for d in ds),
                                    finish_reason=ds[-1].finish_reason) for i, ds in enumerate(deltas)]
        return JSONResponse(CompletionResponse(id=rid, created=created, model=server.model_name,
                                               choices=choices, usage=_usage(deltas)).model_dump())


def _add_chat_route(app: FastAPI, server: _Server) -> None:
    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        server.check_model(req)
        rid, created, group = await server.submit("chatcmpl", [server.chat_prompt(req)], req)

        def event(delta: DeltaMessage, finish_reason: FinishReason | None = None) -> str:
            choice = ChatStreamChoice(index=0, delta=delta, finish_reason=finish_reason)
            body = ChatCompletionChunk(id=rid, created=created, model=server.model_name,
                                       choices=[choice]).model_dump()
            # A delta names only what it adds; finish_reason stays, as null, as OpenAI sends it.
            body["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
            return _sse(body)

        def chunk(d: Delta) -> list[str]:
            if not d.text and d.finish_reason is None:
                return []
            return [event(DeltaMessage(content=d.text) if d.text else DeltaMessage(), d.finish_reason)]

        if req.stream:
            first = [event(DeltaMessage(role="assistant", content=""))]
            return StreamingResponse(server.stream(group, chunk, first), media_type="text/event-stream")
        deltas = await server.collect(request, group)
        text = "".join(d.text for d in deltas[0])
        choice = ChatChoice(index=0, message=AssistantMessage(content=text),
                            finish_reason=deltas[0][-1].finish_reason)
        return JSONResponse(ChatCompletionResponse(id=rid, created=created, model=server.model_name,
                                                   choices=[choice], usage=_usage(deltas)).model_dump())
