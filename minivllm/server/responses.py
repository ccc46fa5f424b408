"""The OpenAI Responses API (``POST /v1/responses``), built on the chat turn of ``app.py``.

A request becomes one chat request: ``instructions`` a first system message; the ``input``
items messages (a ``function_call`` item joins the assistant message before it as one of
its ``tool_calls``, a ``function_call_output`` item is a ``tool`` message, a ``reasoning``
item opens an assistant message with its text as ``reasoning_content``); flat function
tools chat tools; ``text.format`` the ``response_format``; ``max_output_tokens`` the
``max_tokens``; ``reasoning.effort`` the template variable ``reasoning_effort`` (as vLLM
passes it). An input that ends with an assistant message or reasoning whose status is
``in_progress`` or ``incomplete`` is continued rather than answered (as vLLM does). Errors
name the Responses fields (``input``, not ``messages``).

The choice's text runs through the chat parsers' stream (``ChatOutputParser.stream``) for a
whole response as for a streamed one, so both list the same output items, in the order the
text has them: a ``reasoning`` item (its text as ``reasoning_text`` content, as vLLM gives
it), a ``message`` item per run of content (content after a tool call starts a new one) and
a ``function_call`` item per call. (One exception: content written before ``<think>``
comes after the reasoning when both arrive in one piece, as ``ChoiceStream.feed`` returns a
piece's reasoning before its content.) A stream sends OpenAI's events: ``response.created``,
``response.in_progress``, per item ``output_item.added`` / ``content_part.added`` / its text
or argument deltas / their ``.done`` / ``content_part.done`` / ``output_item.done``, and last
``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` cut it (as
OpenAI does; vLLM sends ``response.completed`` either way), or ``response.failed`` when the
engine failed. Each event has a ``sequence_number``, from 0.

Responses with ``store`` (the default, as OpenAI; vLLM stores only when told to) are kept in
memory, the last ``MAX_STORED_RESPONSES`` of them, for ``GET /v1/responses/{id}`` and for
``previous_response_id``, which continues a stored response's conversation (its input and
output; not its instructions, as OpenAI says). ``background`` is refused, so every response
runs within its request, and a client stops one by disconnecting:
``POST /v1/responses/{id}/cancel`` answers 400 for a stored response (as vLLM answers for
one that did not run in the background) and 404 for an unknown id.

Fields of the OpenAI API that do not change what this server writes (``service_tier``,
prompt-cache options, ``safety_identifier``, ``stream_options``, ``max_tool_calls``,
``text.verbosity``, reasoning summaries, ``include`` values for items this server never
makes) are accepted, and logged once each; those it cannot honour (``background``,
``prompt``, ``conversation``, ``context_management``, log-probabilities) are a 400 naming
them. ``truncation: "auto"`` is accepted but drops nothing: an input over the context is a
400, as with ``"disabled"``. vLLM's extensions ``top_k``, ``seed``, ``stop``,
``repetition_penalty``, ``ignore_eos``, ``include_stop_str_in_output`` and
``structured_outputs`` are taken as the chat API takes them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Literal, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, ValidationError, field_validator, model_validator

from minivllm.server.app import APIError, ChatTurn, _Server, _validation_error
from minivllm.server.chat_output import ChatOutputParser
from minivllm.server.engine_loop import Delta, EngineDeadError, RequestLostError, merge_deltas
from minivllm.server.protocol import (ChatCompletionRequest, DeltaMessage, DeltaToolCall,
                                      FunctionCallParam, Int64, _Body)

logger = logging.getLogger(__name__)

# Responses kept for GET and previous_response_id: the most recent this many (each holds
# its conversation, so memory grows with both).
MAX_STORED_RESPONSES = 512

ItemStatus = Literal["in_progress", "completed", "incomplete"]
TEXT_PARTS = ("input_text", "output_text")


# ---- the request -------------------------------------------------------------------------

def _text_parts(content: Any) -> Any:
    """Check a content list's parts before pydantic does, to name the part at fault."""
    if isinstance(content, list):
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if not isinstance(kind, str):
                raise ValueError(f"part {i}: a content part is an object with a string 'type'")
            if kind not in TEXT_PARTS:
                raise ValueError(f"part {i}: content parts of type {kind!r} are not supported (this "
                                 f"server takes text parts: {', '.join(TEXT_PARTS)})")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: a {kind} part has a string 'text'")
    return content


class TextPart(_Body):
    """Text in an item's content: ``input_text``, or ``output_text`` (the model's, passed
    back with its annotations and logprobs, which are ignored)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _chat_content(content: str | list[TextPart]) -> str | list[dict[str, str]]:
    """Content as a chat message holds it (the chat API joins text parts)."""
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": p.text} for p in content]


class MessageItem(_Body):
    """A message (``type`` may be left out): what a user, the system or the model said."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    _parts = field_validator("content", mode="before")(_text_parts)


class FunctionCallItem(_Body):
    """A call the model made: its ``call_id``, the function's name, its arguments (a JSON object)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None

    @field_validator("arguments")
    @classmethod
    def _a_json_object(cls, arguments: str) -> str:
        try:  # the chat API's check of a call's arguments
            FunctionCallParam(name="f", arguments=arguments)
        except ValidationError as e:
            raise ValueError(e.errors()[0]["msg"].removeprefix("Value error, ")
                             .replace("function.arguments: ", "")) from None
        return arguments


class FunctionCallOutputItem(_Body):
    """What the call ``call_id`` returned."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: ItemStatus | None = None

    _parts = field_validator("output", mode="before")(_text_parts)


class SummaryText(_Body):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Body):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Body):
    """The model's reasoning before its answer: its text (``content``), else its summary."""

    type: Literal["reasoning"]
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    id: str | None = None
    status: ItemStatus | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _not_encrypted(cls, value: str) -> str:
        raise ValueError("encrypted reasoning is not supported (this server never writes it): send "
                         "the reasoning's text as content")

    def text(self) -> str:
        return "\n".join(p.text for p in (self.content or self.summary))


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]
ITEM_TYPES: dict[str, type[_Body]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                      "function_call_output": FunctionCallOutputItem,
                                      "reasoning": ReasoningItem}


def input_item(i: int, item: Any) -> InputItem:
    """Input item ``i`` (an object), checked as its ``type`` says.

    Raises:
        ValueError: an unsupported type or a malformed item, naming ``i``, the type and the field.
    """
    if not isinstance(item, dict):
        raise ValueError(f"item {i}: an input item is an object")
    kind = item.get("type", "message")
    model = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ValueError(f"item {i}: items of type {kind!r} are not supported (this server takes "
                         f"{', '.join(ITEM_TYPES)})")
    try:
        return model.model_validate(item)  # type: ignore[return-value]
    except ValidationError as e:
        problems = [f"{'.'.join(str(x) for x in err['loc'])}: "
                    f"{'unknown field' if err['type'] == 'extra_forbidden' else err['msg']}"
                    for err in e.errors()]
        raise ValueError(f"item {i} ({kind}): " + "; ".join(p.replace("Value error, ", "") for p in problems)
                         ) from None


class FunctionTool(_Body):
    """A function tool, flat as the Responses API writes it."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class FunctionChoice(_Body):
    """``tool_choice`` that forces one function."""

    type: Literal["function"]
    name: str


class TextFormat(_Body):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its name and schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> "TextFormat":
        schema = self.type == "json_schema"
        if schema != (self.schema_ is not None) or schema != (self.name is not None):
            raise ValueError("name and schema are required when type is 'json_schema', and only then")
        return self

    def response_format(self) -> dict[str, Any]:
        """As the chat API's ``response_format``."""
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name, "schema": self.schema_, "description": self.description,
                  "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None   # OpenAI-only: ignored


class ReasoningConfig(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None            # ignored
    generate_summary: Literal["auto", "concise", "detailed"] | None = None   # ignored


class StreamOptions(_Body):
    include_obfuscation: bool | None = None   # ignored: events carry no obfuscation


Includable = Literal["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                     "message.input_image.image_url", "computer_call_output.output.image_url",
                     "code_interpreter_call.outputs", "reasoning.encrypted_content",
                     "message.output_text.logprobs"]

# Top-level fields accepted and ignored: they change nothing this server writes.
IGNORED_FIELDS = ("service_tier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
                  "safety_identifier", "stream_options", "max_tool_calls")
LOGPROBS_REFUSED = "log-probabilities are not supported by this server's Responses API (its chat API has them)"
# Fields refused whatever their value (null aside), and why.
REFUSED_FIELDS = {
    "prompt": "reusable prompts (kept by OpenAI) are not supported: send instructions and input",
    "conversation": "conversations are not supported: continue a response with previous_response_id",
    "context_management": "context management (compaction) is not supported",
}


class ResponsesRequest(_Body):
    """POST /v1/responses."""

    model: str | None = None
    input: Union[str, list[InputItem]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionChoice] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[Includable] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    top_logprobs: int | None = None
    # OpenAI-only (IGNORED_FIELDS)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    stream_options: StreamOptions | None = None
    max_tool_calls: Int64 | None = None
    # Refused (REFUSED_FIELDS)
    prompt: Any = None
    conversation: Any = None
    context_management: Any = None
    # vLLM's extensions, as the chat API takes them
    top_k: Int64 | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    structured_outputs: dict[str, Any] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        return [input_item(i, item) for i, item in enumerate(value)] if isinstance(value, list) else value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools: Any) -> Any:
        for i, tool in enumerate(tools if isinstance(tools, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise ValueError(f"tool {i}: tools of type {kind!r} are not supported (this server "
                                 "calls function tools only)")
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, choice: Any) -> Any:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise ValueError(f"tool_choice of type {kind!r} is not supported (this server takes none, "
                             "auto, required or a function)")
        return choice

    @field_validator("background")
    @classmethod
    def _not_background(cls, background: bool) -> bool:
        if background:
            raise ValueError("background responses are not supported: a response runs within its "
                             "request (stream it to see it progress)")
        return background

    @field_validator(*REFUSED_FIELDS)
    @classmethod
    def _refused(cls, value: Any, info: Any) -> Any:
        raise ValueError(REFUSED_FIELDS[info.field_name])

    @field_validator("include")
    @classmethod
    def _no_logprobs(cls, include: list[str]) -> list[str]:
        if "message.output_text.logprobs" in include:
            raise ValueError(LOGPROBS_REFUSED)
        return include

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, top_logprobs: int) -> int:
        if top_logprobs:
            raise ValueError(LOGPROBS_REFUSED)
        return top_logprobs

    def ignored_fields(self) -> list[str]:
        """The fields sent that this server accepts and ignores (``IGNORED_FIELDS`` and a few
        nested ones)."""
        sent = [f for f in IGNORED_FIELDS if f in self.model_fields_set]
        if self.text is not None and self.text.verbosity is not None:
            sent.append("text.verbosity")
        if self.reasoning is not None:
            sent += [f"reasoning.{f}" for f in ("summary", "generate_summary") if f in self.reasoning.model_fields_set]
        return sent + [f"include={v}" for v in self.include or ()]


# ---- the request as a chat request ----------------------------------------------------------

def to_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Items as chat messages: a reasoning item opens an assistant message, the assistant's
    message item and function calls that follow join it, a call's output is a tool message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if isinstance(item, MessageItem):
            if item.role == "assistant" and last is not None and not last["content"] and "tool_calls" not in last:
                last["content"] = _chat_content(item.content)
            else:
                messages.append({"role": item.role, "content": _chat_content(item.content)})
        elif isinstance(item, ReasoningItem):
            messages.append({"role": "assistant", "content": "", "reasoning_content": item.text()})
        elif isinstance(item, FunctionCallItem):
            if last is None:
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function",
                 "function": {"name": item.name, "arguments": item.arguments}})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _chat_content(item.output)})
    return messages


def continues_final_message(req: ResponsesRequest) -> bool:
    """Whether the input ends with an assistant message or reasoning still in progress (or
    cut short), which the model then continues instead of starting a new reply (as vLLM does)."""
    last = req.input[-1] if isinstance(req.input, list) and req.input else None
    unfinished = getattr(last, "status", None) in ("in_progress", "incomplete")
    return unfinished and (isinstance(last, ReasoningItem) or getattr(last, "role", None) == "assistant")


def chat_body(req: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request of ``req`` whose conversation is ``messages``, as JSON."""
    choice = req.tool_choice
    effort = req.reasoning.effort if req.reasoning is not None else None
    continues = continues_final_message(req)
    body = {
        "model": req.model, "messages": messages, "stream": req.stream, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
        "user": req.user, "top_k": req.top_k, "seed": req.seed, "stop": req.stop,
        "repetition_penalty": req.repetition_penalty, "ignore_eos": req.ignore_eos,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "structured_outputs": req.structured_outputs,
        "tools": [t.chat_tool() for t in req.tools] if req.tools else None,
        "tool_choice": {"type": "function", "function": {"name": choice.name}}
        if isinstance(choice, FunctionChoice) else choice,
        "response_format": req.text.format.response_format()
        if req.text is not None and req.text.format is not None else None,
        "chat_template_kwargs": {"reasoning_effort": effort} if effort is not None else None,
        "add_generation_prompt": False if continues else None,
        "continue_final_message": True if continues else None,
    }
    return {k: v for k, v in body.items() if v is not None}


# Chat names in error messages -> the Responses API's (longest first).
_RENAMES = (("the messages have", "the input has"), ("messages", "input"),
            ("max_tokens", "max_output_tokens"), ("response_format", "text.format"))
_RENAMED_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


def responses_error(error: APIError) -> APIError:
    """A chat turn's error, its fields named as the Responses API names them."""
    message = error.message
    for chat, ours in _RENAMES:
        message = re.sub(rf"\b{re.escape(chat)}\b", ours, message)
    return APIError(error.status, message, _RENAMED_PARAMS.get(error.param or "", error.param))


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[ChatCompletionRequest,
                                                                                 list[dict[str, Any]]]:
    """The chat request of ``req`` after the conversation ``history``, and its conversation
    without the instructions (what a response continuing it starts from).

    Raises:
        APIError: 400 for what the chat request refuses, named as this API names it.
    """
    conversation = history + ([{"role": "user", "content": req.input}] if isinstance(req.input, str)
                              else to_messages(req.input))
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    try:
        chat = ChatCompletionRequest.model_validate(chat_body(req, system + conversation))
    except ValidationError as e:
        raise responses_error(_validation_error(RequestValidationError(e.errors()))) from e
    return chat, conversation


# ---- the output ----------------------------------------------------------------------------

_ID_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


@dataclasses.dataclass
class OutputItem:
    """One output item as it grows: ``text`` is the reasoning, the message's text, or the
    call's arguments."""

    kind: Literal["reasoning", "message", "function_call"]
    id: str
    output_index: int
    call_id: str = ""
    name: str = ""
    text: str = ""
    status: ItemStatus = "in_progress"

    def part(self, text: str | None = None) -> dict[str, Any]:
        """Its content part (with ``text``, else its own)."""
        text = self.text if text is None else text
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def body(self) -> dict[str, Any]:
        """The item as the API shows it; in progress, without its content part."""
        content = [] if self.status == "in_progress" else [self.part()]
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "summary": [], "content": content, "status": self.status}
        if self.kind == "message":
            return {"id": self.id, "type": "message", "role": "assistant", "status": self.status,
                    "content": content}
        return {"id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                "arguments": self.text, "status": self.status}


class ResponseOutput:
    """The output items of one choice, from its text through the request's parsers; each
    step returns the stream events it makes (without ``sequence_number``).

    One item is open at a time: the reasoning, a message, or a call; text of another kind
    closes it and opens the next. Item ids are the response's hex id with a prefix and the
    item's index.
    """

    def __init__(self, parser: ChatOutputParser | None, response_hex: str) -> None:
        self._stream = parser.stream(0) if parser is not None else None
        self._hex = response_hex
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The events of the choice's next text."""
        if self._stream is None:
            return self._append("message", text) if text else []
        return self._apply(self._stream.feed(text))

    def finish(self, finish_reason: str | None) -> list[dict[str, Any]]:
        """The events of the choice's end: the parsers' held-back text, then the open item's
        done events (the item ``incomplete`` when the length limit cut it)."""
        events = self._apply(self._stream.finish()) if self._stream is not None else []
        return events + self._close("incomplete" if finish_reason == "length" else "completed")

    def bodies(self) -> list[dict[str, Any]]:
        return [item.body() for item in self.items]

    def reasoning_text(self) -> str:
        return "".join(item.text for item in self.items if item.kind == "reasoning")

    def _apply(self, messages: list[DeltaMessage]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for m in messages:
            if m.reasoning_content:
                events += self._append("reasoning", m.reasoning_content)
            if m.content:
                events += self._append("message", m.content)
            for call in m.tool_calls or ():
                events += self._call(call)
        return events

    def _append(self, kind: Literal["reasoning", "message"], text: str) -> list[dict[str, Any]]:
        same = self._open is not None and self._open.kind == kind
        events = [] if same else self._close("completed") + self._start(kind)
        item = self._current()
        item.text += text
        delta = {"type": "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta",
                 "item_id": item.id, "output_index": item.output_index, "content_index": 0, "delta": text}
        if kind == "message":
            delta["logprobs"] = []
        return events + [delta]

    def _call(self, call: DeltaToolCall) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if call.id is not None:  # a new call: its id and name, then its arguments' pieces
            events = self._close("completed") + self._start("function_call", call.id, call.function.name or "")
        item = self._current()
        assert item.kind == "function_call", "a call's arguments follow its start"
        if call.function.arguments:
            item.text += call.function.arguments
            events.append({"type": "response.function_call_arguments.delta", "item_id": item.id,
                           "output_index": item.output_index, "delta": call.function.arguments})
        return events

    def _current(self) -> OutputItem:
        assert self._open is not None
        return self._open

    def _start(self, kind: Literal["reasoning", "message", "function_call"], call_id: str = "",
               name: str = "") -> list[dict[str, Any]]:
        index = len(self.items)
        item = OutputItem(kind, f"{_ID_PREFIX[kind]}_{self._hex}_{index}", index, call_id, name)
        self.items.append(item)
        self._open = item
        events = [{"type": "response.output_item.added", "output_index": index, "item": item.body()}]
        if kind != "function_call":
            events.append({"type": "response.content_part.added", "item_id": item.id, "output_index": index,
                           "content_index": 0, "part": item.part("")})
        return events

    def _close(self, status: ItemStatus) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        where = {"item_id": item.id, "output_index": item.output_index}
        if item.kind == "function_call":
            events = [{"type": "response.function_call_arguments.done", **where, "arguments": item.text}]
        else:
            done: dict[str, Any] = {"type": f"response.{'reasoning' if item.kind == 'reasoning' else 'output'}"
                                            "_text.done", **where, "content_index": 0, "text": item.text}
            if item.kind == "message":
                done["logprobs"] = []
            events = [done, {"type": "response.content_part.done", **where, "content_index": 0,
                             "part": item.part()}]
        return events + [{"type": "response.output_item.done", "output_index": item.output_index,
                          "item": item.body()}]


ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]


def response_status(finish_reason: str | None) -> ResponseStatus:
    return "incomplete" if finish_reason == "length" else "cancelled" if finish_reason == "abort" else "completed"


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    """A finished response and its conversation: its history, input and output as chat
    messages (its instructions left out), which ``previous_response_id`` continues."""

    body: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    """The last ``capacity`` stored responses, by id."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        return self._responses.get(response_id)

    def put(self, response: StoredResponse) -> None:
        self._responses[response.body["id"]] = response
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)


class ResponseRun:
    """One response being made: the request, its chat turn, its output so far, and the
    response object at each stage."""

    def __init__(self, server: _Server, req: ResponsesRequest, turn: ChatTurn,
                 conversation: list[dict[str, Any]]) -> None:
        self.server, self.req, self.turn, self.conversation = server, req, turn, conversation
        hex_id = turn.rid.split("-", 1)[1]
        self.id = f"resp_{hex_id}"
        self.output = ResponseOutput(turn.parser, hex_id)
        params = turn.req.to_sampling_params(1)
        self.temperature, self.top_p = params.temperature, params.top_p

    def body(self, status: ResponseStatus, usage: dict[str, Any] | None = None,
             error: str | None = None) -> dict[str, Any]:
        """The response object (the request's echo with ``status``, the output so far, ``usage``)."""
        req = self.req
        text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text is not None else {}
        choice = req.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.turn.created, "status": status,
            "background": False, "error": {"code": "server_error", "message": error} if error else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "model": self.server.model_name,
            "output": self.output.bodies() if status != "in_progress" else [],
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None,
            "service_tier": "default", "store": req.store, "temperature": self.temperature,
            "text": {"format": {"type": "text"}} | text,
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else choice or "auto",
            "tools": [t.model_dump() for t in req.tools or ()], "top_p": self.top_p, "top_logprobs": 0,
            "truncation": req.truncation, "usage": usage, "user": req.user, "metadata": req.metadata or {},
            "prompt_cache_key": req.prompt_cache_key, "safety_identifier": req.safety_identifier,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        }

    def usage(self, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict[str, Any]:
        """Token counts; the reasoning's are its text's tokens (as the model wrote them, when
        it wrote the tokenizer's own split of that text)."""
        reasoning = self.output.reasoning_text()
        num_reasoning = len(self.server.llm.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return {"input_tokens": num_prompt_tokens, "input_tokens_details": {"cached_tokens": num_cached_tokens},
                "output_tokens": num_completion_tokens, "output_tokens_details": {"reasoning_tokens": num_reasoning},
                "total_tokens": num_prompt_tokens + num_completion_tokens}

    def finished(self, d: Delta, store: ResponseStore) -> dict[str, Any]:
        """The final response object (``d``: the choice's last delta), kept in ``store`` when
        the request asked for it."""
        body = self.body(response_status(d.finish_reason),
                         self.usage(d.num_prompt_tokens, d.num_completion_tokens, d.num_cached_tokens))
        if self.req.store:
            outputs = [input_item(i, item) for i, item in enumerate(body["output"])]
            store.put(StoredResponse(body, self.conversation + to_messages(outputs)))
        return body

    async def whole(self, request: Request, store: ResponseStore) -> dict[str, Any]:
        """The finished response (a client gone meanwhile aborts it)."""
        deltas = await self.server.collect(request, self.turn.group)
        d = merge_deltas(deltas[0])
        self.output.feed(d.text)
        self.output.finish(d.finish_reason)
        return self.finished(d, store)

    async def events(self, store: ResponseStore) -> AsyncIterator[str]:
        """The response's server-sent events. Leaving early (the client disconnected) aborts
        its request."""
        numbers = itertools.count()

        def sse(event: dict[str, Any]) -> str:
            event["sequence_number"] = next(numbers)
            return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"

        group = self.turn.group
        try:
            for kind in ("response.created", "response.in_progress"):
                yield sse({"type": kind, "response": self.body("in_progress")})
            async with aclosing(self.server.deltas(group)) as deltas:
                async for d in deltas:
                    events = self.output.feed(d.text)
                    if d.finish_reason is not None:
                        events += self.output.finish(d.finish_reason)
                        final = self.finished(d, store)
                        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
                        events.append({"type": kind, "response": final})
                    for event in events:
                        yield sse(event)
        except (EngineDeadError, RequestLostError) as e:
            yield sse({"type": "response.failed", "response": self.body("failed", error=str(e))})
        finally:
            # Closed at one of the first two events, before ``deltas`` ran (and would abort).
            if not group.finished:
                self.server.engine.abort(group.request_ids)


# ---- the routes ----------------------------------------------------------------------------

def add_routes(app: FastAPI, server: _Server) -> None:
    """Add this API's routes to ``app`` (served by ``server``, the app's ``_Server``)."""
    store = ResponseStore()
    warned: set[str] = set()  # ignored fields already logged

    def stored(response_id: str, param: str) -> StoredResponse:
        found = store.get(response_id)
        if found is None:
            raise APIError(404, f"Response with id {response_id!r} not found.", param)
        return found

    @app.post("/v1/responses", response_model=None)
    async def create(req: ResponsesRequest, request: Request) -> Response:
        for name in req.ignored_fields():
            if name not in warned:
                warned.add(name)
                logger.warning("responses: %s is accepted and ignored (it changes nothing this server "
                               "writes)", name)
        history = [] if req.previous_response_id is None else \
            stored(req.previous_response_id, "previous_response_id").conversation
        chat, conversation = chat_request(req, history)
        try:
            turn = await server.start_chat(chat, kind="resp")
        except APIError as e:
            raise responses_error(e) from e
        run = ResponseRun(server, req, turn, conversation)
        if req.stream:
            return StreamingResponse(run.events(store), media_type="text/event-stream")
        return JSONResponse(await run.whole(request, store))

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> JSONResponse:
        return JSONResponse(stored(response_id, "response_id").body)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> JSONResponse:
        stored(response_id, "response_id")
        raise APIError(400, f"Response {response_id!r} has finished: only a background response can be "
                            "cancelled, and this server runs none (stop a response by disconnecting)",
                       "response_id")
