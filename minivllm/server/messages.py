"""The Anthropic Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``),
built on the chat turn of ``app.py``.

A request becomes a ``ChatCompletionRequest`` (as vLLM's Anthropic endpoint converts it):

- ``system`` (text or text blocks) is a system message; text blocks of a message are
  joined by newlines, as the chat API joins text parts.
- A user message's ``tool_result`` blocks become ``tool`` messages, in order and before
  the turn's text (the user message, if it has text). ``is_error`` is accepted; the chat
  template has no place for it, so the result's text must say what went wrong.
- An assistant message's ``tool_use`` blocks become its tool calls (``input`` as the
  arguments' JSON), its ``thinking`` blocks its ``reasoning_content``; ``redacted_thinking``
  is dropped (its data is opaque).
- ``tools`` become functions (``input_schema`` the parameters); ``tool_choice`` ``auto``,
  ``any`` (the chat API's ``required``), ``tool`` (a named function) and ``none``, with
  ``disable_parallel_tool_use``; ``stop_sequences`` are stop strings (the one that ended
  a reply is its ``stop_sequence``); ``output_config.format`` is a JSON-schema constraint.
- ``thinking`` is accepted and changes nothing: with the server's reasoning parser the
  model's reasoning always comes back as a ``thinking`` block, without it as text (vLLM
  does the same). Qwen3's own switch is ``chat_template_kwargs`` (``enable_thinking``).
- Images and documents are refused (this server serves text models); so is any field
  the API does not define (``cache_control`` and ``metadata`` are accepted and unused:
  prefix caching is automatic here).

The reply's blocks follow the order of the model's text: a ``thinking`` block, text, and a
``tool_use`` block per call; a whole response and a stream build them with the same code,
so a stream always reassembles into the whole response. Errors are Anthropic's body
``{"type": "error", "error": {"type", "message"}}``; a failure after a stream has started is
an ``error`` event.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, ValidationError, field_validator, model_validator

from minivllm.server.app import APIError, ChatTurn, _Server
from minivllm.server.engine_loop import Delta, EngineDeadError, RequestLostError, merge_deltas
from minivllm.server.protocol import FUNCTION_NAME_PATTERN, ChatCompletionRequest, DeltaMessage, _Body

# Anthropic's error types by HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 529: "overloaded_error"}

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]

# Per block type: the fields it must have, and the others it may have.
_BLOCK_FIELDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "text": (frozenset({"text"}), frozenset({"cache_control", "citations"})),
    "tool_use": (frozenset({"id", "name", "input"}), frozenset({"cache_control"})),
    "tool_result": (frozenset({"tool_use_id"}), frozenset({"content", "is_error", "cache_control"})),
    "thinking": (frozenset({"thinking"}), frozenset({"signature"})),
    "redacted_thinking": (frozenset({"data"}), frozenset()),
}
_MEDIA_BLOCKS = ("image", "document")
_ROLE_BLOCKS = {"user": ("text", "tool_result"),
                "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for HTTP ``status``."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


def _text_only(blocks: list[ContentBlock] | None, message: str) -> list[ContentBlock] | None:
    """``blocks`` if every one is a text block (or None); else ``ValueError(message)``."""
    if blocks is not None and any(b.type != "text" for b in blocks):
        raise ValueError(message)
    return blocks


def _as_text_blocks(value: Any) -> list[Any]:
    """Content: a string (one text block) or a list of blocks."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise ValueError("must be text or a list of content blocks")
    return value


# ---- the request ------------------------------------------------------------------------

class ContentBlock(_Body):
    """A content block of a message (or of a ``tool_result``): one of ``_BLOCK_FIELDS``'s
    types with that type's fields. Which types a message may hold depends on its role."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: list[ContentBlock] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _fields_of_the_type(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("type"), str):
            raise ValueError("a content block is an object with a string 'type'")
        kind = data["type"]
        if kind in _MEDIA_BLOCKS:
            raise ValueError(f"{kind} blocks are not supported (this server serves text models only)")
        if kind not in _BLOCK_FIELDS:
            raise ValueError(f"unknown block type {kind!r} (expected one of {sorted(_BLOCK_FIELDS)})")
        required, optional = _BLOCK_FIELDS[kind]
        given = {k for k, v in data.items() if v is not None} - {"type"}
        missing = sorted(required - given)
        if missing:
            raise ValueError(f"a {kind} block needs {', '.join(missing)}")
        extra = sorted(given - required - optional)
        if extra:
            raise ValueError(f"a {kind} block has no field {', '.join(map(repr, extra))}")
        if isinstance(data.get("content"), str):
            data = {**data, "content": _as_text_blocks(data["content"])}
        return data

    @field_validator("content")
    @classmethod
    def _text_results(cls, content: list[ContentBlock] | None) -> list[ContentBlock] | None:
        return _text_only(content, "a tool_result's content is text or a list of text blocks")

    def result_text(self) -> str:
        """A ``tool_result``'s content as text (its text blocks joined by newlines)."""
        return "\n".join(b.text or "" for b in self.content or ())


def _text_parts(blocks: list[ContentBlock]) -> list[dict[str, str]]:
    return [{"type": "text", "text": b.text or ""} for b in blocks if b.type == "text"]


class Message(_Body):
    """One turn: ``user`` (text, tool results) or ``assistant`` (text, tool calls, thinking)."""

    role: Literal["user", "assistant"]
    content: Annotated[list[ContentBlock], Field(min_length=1)]

    @field_validator("content", mode="before")
    @classmethod
    def _text_is_a_block(cls, content: Any) -> Any:
        return _as_text_blocks(content)

    @model_validator(mode="after")
    def _blocks_of_the_role(self) -> Message:
        allowed = _ROLE_BLOCKS[self.role]
        wrong = sorted({b.type for b in self.content} - set(allowed))
        if wrong:
            raise ValueError(f"content: {self.role} messages hold {', '.join(allowed)} blocks, "
                             f"not {', '.join(wrong)}")
        return self

    def chat_messages(self) -> list[dict[str, Any]]:
        """The chat API's messages for this turn."""
        if self.role == "user":
            results = [b for b in self.content if b.type == "tool_result"]
            texts = _text_parts(self.content)
            out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.result_text()}
                                         for b in results]
            if texts or not results:
                out.append({"role": "user", "content": texts})
            return out
        message: dict[str, Any] = {"role": "assistant", "content": _text_parts(self.content)}
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                 for b in self.content if b.type == "tool_use"]
        if calls:
            message["tool_calls"] = calls
        thoughts = [b.thinking or "" for b in self.content if b.type == "thinking"]
        if thoughts:
            message["reasoning_content"] = "".join(thoughts)
        return [message]


class Tool(_Body):
    """A client tool: the model calls it with an ``input`` that follows ``input_schema``."""

    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None   # accepted; a forced call always follows the schema

    def chat_tool(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": {"type": "object", **self.input_schema}}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(_Body):
    """``auto``, ``any`` (some tool must be called), ``tool`` (the one ``name``d) or ``none``."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.name is not None) != (self.type == "tool"):
            raise ValueError("name: required when type is 'tool', and only then")
        if self.type == "none" and self.disable_parallel_tool_use is not None:
            raise ValueError("disable_parallel_tool_use: not allowed when type is 'none'")
        return self

    def chat_tool_choice(self) -> str | dict[str, Any]:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return "required" if self.type == "any" else self.type


class Thinking(_Body):
    """``thinking``: ``{"type": "enabled", "budget_tokens": N}`` or ``{"type": "disabled"}``
    (accepted; see the module docstring)."""

    type: Literal["enabled", "disabled"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> Thinking:
        if (self.budget_tokens is not None) != (self.type == "enabled"):
            raise ValueError("budget_tokens: required when type is 'enabled', and only then")
        return self


class Metadata(_Body):
    """``metadata``: who the request is for (accepted for the caller's own logs)."""

    user_id: str | None = None


class OutputFormat(_Body):
    """``output_config.format``: the reply's text is JSON that follows ``schema``."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    """``output_config``: only ``format`` (vLLM also maps ``effort``, which no model here reads)."""

    format: OutputFormat | None = None


class Conversation(_Body):
    """``POST /v1/messages/count_tokens``'s request: what the prompt is made of (and the
    output format, which changes the reply, not the prompt)."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None          # accepted, unused (see the module docstring)
    chat_template_kwargs: dict[str, Any] | None = None   # extension (vLLM): template variables

    @field_validator("system", mode="before")
    @classmethod
    def _text_is_a_block(cls, system: Any) -> Any:
        return _as_text_blocks(system)

    @field_validator("system")
    @classmethod
    def _system_is_text(cls, system: list[ContentBlock] | None) -> list[ContentBlock] | None:
        return _text_only(system, "the system prompt is text or text blocks")

    @model_validator(mode="after")
    def _tool_choice_among_tools(self) -> Conversation:
        names = [t.name for t in self.tools or ()]
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice: tool {choice.name!r} is not among the tools {names}")
        return self

    def chat_fields(self) -> dict[str, Any]:
        """The ``ChatCompletionRequest`` fields of the conversation."""
        messages = [] if self.system is None else [{"role": "system", "content": _text_parts(self.system)}]
        for m in self.messages:
            messages += m.chat_messages()
        fields: dict[str, Any] = {"model": self.model, "messages": messages,
                                  "chat_template_kwargs": self.chat_template_kwargs}
        if self.tools:
            fields["tools"] = [t.chat_tool() for t in self.tools]
        if self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice.chat_tool_choice()
            fields["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        if self.output_config is not None and self.output_config.format is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": self.output_config.format.schema_}}
        return fields

    def chat_request(self) -> ChatCompletionRequest:
        return _chat_request(self.chat_fields())


class MessagesRequest(Conversation):
    """``POST /v1/messages``."""

    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None

    def chat_request(self) -> ChatCompletionRequest:
        return _chat_request(self.chat_fields() | {
            "max_tokens": self.max_tokens, "stop": self.stop_sequences, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "stream": self.stream})


def _problems(e: ValidationError) -> str:
    """``field.path: problem; ...`` of a validation error."""
    problems = []
    for err in e.errors(include_url=False):
        where = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        elif err["type"] == "missing":
            msg = "required"
        else:
            msg = str(err["msg"]).removeprefix("Value error, ")
        problems.append(f"{where}: {msg}" if where else msg)
    return "; ".join(dict.fromkeys(problems)) or "invalid request"


# The chat API's fields under another name here: its refusals are told in this API's terms.
_CHAT_FIELDS = re.compile(r"^(stop|response_format|structured_outputs)(\.\w+)?\b")
_RENAMED = {"stop": "stop_sequences", "response_format": "output_config.format",
            "structured_outputs": "output_config.format"}


def _own_terms(e: APIError) -> APIError:
    return APIError(e.status, _CHAT_FIELDS.sub(lambda m: _RENAMED[m[1]], e.message))


def _chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """Raises: APIError: 400, what the chat API refuses in the converted request."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        raise _own_terms(APIError(400, _problems(e))) from e


async def _parse(request: Request, model: type[Conversation]) -> Any:
    """The request body as ``model``.

    Raises:
        APIError: 400, naming what is wrong (not JSON, not an object, each bad field).
    """
    body = await request.body()
    if not body:
        raise APIError(400, "the request body is empty: send a JSON object")
    try:
        data = json.loads(body)
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise APIError(400, _problems(e)) from e


# ---- the reply ----------------------------------------------------------------------------

Event = dict[str, Any]   # a stream event, named by its "type"


class ContentBuilder:
    """A reply's content blocks, built from the parser's deltas in the order they come;
    ``add`` and ``close`` return the stream events that build the same blocks."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open = False
        self._arguments: dict[int, str] = {}   # tool_use block index -> its input's JSON so far
        self._calls: dict[int, int] = {}       # tool call index -> its block index

    @property
    def called(self) -> bool:
        return bool(self._calls)

    def add(self, m: DeltaMessage) -> list[Event]:
        events: list[Event] = []
        if m.reasoning_content:
            events += self._append("thinking", m.reasoning_content)
        if m.content:
            events += self._append("text", m.content)
        for call in m.tool_calls or ():
            if call.id is not None:
                events += self._start({"type": "tool_use", "id": call.id, "name": call.function.name,
                                       "input": {}})
                self._calls[call.index] = len(self.blocks) - 1
                self._arguments[len(self.blocks) - 1] = ""
            if call.function.arguments:
                index = self._calls[call.index]
                assert self._open and index == len(self.blocks) - 1, "arguments of a call already closed"
                self._arguments[index] += call.function.arguments
                events.append(_delta(index, {"type": "input_json_delta",
                                             "partial_json": call.function.arguments}))
        return events

    def close(self) -> list[Event]:
        """End the open block, if any."""
        if not self._open:
            return []
        self._open = False
        index, block = len(self.blocks) - 1, self.blocks[-1]
        events = []
        if block["type"] == "thinking":
            events.append(_delta(index, {"type": "signature_delta", "signature": block["signature"]}))
        elif block["type"] == "tool_use":
            block["input"] = json.loads(self._arguments[index] or "{}")
        return events + [{"type": "content_block_stop", "index": index}]

    def _append(self, kind: Literal["thinking", "text"], text: str) -> list[Event]:
        events = []
        if not (self._open and self.blocks[-1]["type"] == kind):
            first = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            events = self._start(first)
            if kind == "thinking":
                self.blocks[-1]["signature"] = secrets.token_hex(16)
        self.blocks[-1][kind] += text
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
            {"type": "text_delta", "text": text}
        return events + [_delta(len(self.blocks) - 1, delta)]

    def _start(self, block: dict[str, Any]) -> list[Event]:
        events = self.close()
        self.blocks.append(dict(block))
        self._open = True
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": block}]


def _delta(index: int, delta: dict[str, Any]) -> Event:
    return {"type": "content_block_delta", "index": index, "delta": delta}


class _Reader:
    """A choice's text as the parser's deltas (reasoning, content, tool calls); without a
    parser, all of it is content."""

    def __init__(self, turn: ChatTurn) -> None:
        self._stream = turn.parser.stream(0) if turn.parser is not None else None

    def read(self, d: Delta) -> list[DeltaMessage]:
        final = d.finish_reason is not None
        if self._stream is None:
            return [DeltaMessage(content=d.text)] if d.text else []
        return self._stream.feed(d.text) + (self._stream.finish() if final else [])


def _stop(d: Delta, called: bool) -> tuple[StopReason, str | None]:
    """The stop reason and stop sequence of a finished choice: a call beats a stop, as the
    chat API's ``tool_calls`` does; a stop string is reported as the stop sequence."""
    if d.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(d.stop_reason, str):
        return "stop_sequence", d.stop_reason
    return "end_turn", None


def _message(msg_id: str, model: str, content: list[dict[str, Any]], stop: StopReason | None,
             stop_sequence: str | None, input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}


def _sse(event: Event) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


def _message_id(turn: ChatTurn) -> str:
    return "msg_" + turn.rid.split("-", 1)[1]


async def _events(server: _Server, turn: ChatTurn, deltas: AsyncGenerator[Delta, None], first: Delta
                  ) -> AsyncIterator[str]:
    """The stream's server-sent events, from its first delta on. ``deltas`` is closed at the
    end, or when the client leaves (which aborts the request)."""
    reader, content, d = _Reader(turn), ContentBuilder(), first
    yield _sse({"type": "message_start", "message": _message(
        _message_id(turn), server.model_name, [], None, None, first.num_prompt_tokens, 0)})
    try:
        async with aclosing(deltas):
            while True:
                for m in reader.read(d):
                    for event in content.add(m):
                        yield _sse(event)
                if d.finish_reason is not None:
                    break
                d = await anext(deltas)
    except (EngineDeadError, RequestLostError) as e:
        yield _sse(error_body(500, str(e)))
        return
    for event in content.close():
        yield _sse(event)
    stop, sequence = _stop(d, content.called)
    yield _sse({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": sequence},
                "usage": {"input_tokens": d.num_prompt_tokens, "output_tokens": d.num_completion_tokens}})
    yield _sse({"type": "message_stop"})


async def _create(server: _Server, request: Request) -> Response:
    req: MessagesRequest = await _parse(request, MessagesRequest)
    try:
        turn = await server.start_chat(req.chat_request(), kind="msg")
    except APIError as e:
        raise _own_terms(e) from e
    if req.stream:
        deltas = server.deltas(turn.group)
        # The first delta gives the prompt's length for message_start; an engine that fails
        # before it is still answered with an error status.
        first = await server.until_disconnect(request, turn.group, anext(deltas))
        return StreamingResponse(_events(server, turn, deltas, first), media_type="text/event-stream")
    d = merge_deltas((await server.collect(request, turn.group))[0])
    content, reader = ContentBuilder(), _Reader(turn)
    for m in reader.read(d):
        content.add(m)
    content.close()
    stop, sequence = _stop(d, content.called)
    return JSONResponse(_message(_message_id(turn), server.model_name, content.blocks, stop, sequence,
                                 d.num_prompt_tokens, d.num_completion_tokens))


async def _count_tokens(server: _Server, request: Request) -> Response:
    req: Conversation = await _parse(request, Conversation)
    chat = req.chat_request()
    server.check_model(chat)
    prompt, _ = server.chat_prompt(chat)
    return JSONResponse({"input_tokens": len(prompt)})


def add_routes(app: FastAPI, server: _Server) -> None:
    """Add this API's routes to ``app`` (served by ``server``, the app's ``_Server``)."""

    @app.post("/v1/messages", response_model=None)
    async def messages(request: Request) -> Response:
        try:
            return await _create(server, request)
        except APIError as e:
            return _error(e.status, e.message)

    @app.post("/v1/messages/count_tokens", response_model=None)
    async def count_tokens(request: Request) -> Response:
        try:
            return await _count_tokens(server, request)
        except APIError as e:
            return _error(e.status, e.message)
