"""The FastAPI app: the OpenAI completions and chat API over an ``AsyncEngine``.

Every error leaves as the OpenAI body ``{"error": {"message", "type", "param",
"code"}}``: 400 for a request the protocol models or the engine refuse (nothing
of it is queued), 401 without the API key, 404 for an unknown model or route,
413 for a body over the limit, 500 when the engine has failed. A client that
disconnects, streaming or not, aborts its requests. ``serve`` runs the app and
shuts it down once its engine has failed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from jinja2 import TemplateError

from minivllm.outputs import FinishReason, StopReason
from minivllm.sampling import StructuredOutputs
from minivllm.server.chat_output import ChatOutputParser, chat_output_parser
from minivllm.server.engine_loop import (AsyncEngine, Delta, EngineDeadError, RequestGroup,
                                         RequestLostError, merge_deltas)
from minivllm.server.metrics import ServerMetrics
from minivllm.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from minivllm.server.protocol import (AssistantMessage, ChatChoice, ChatFinishReason, ChatCompletionChunk,
                                      ChatCompletionRequest, ChatCompletionResponse,
                                      ChatStreamChoice, ChoiceLogprobs, CompletionChoice,
                                      CompletionLogprobs, CompletionRequest, CompletionResponse,
                                      CompletionStreamResponse, DeltaMessage, ModelCard, ModelList,
                                      DetokenizeRequest, PromptLogprob, PromptLogprobs, PromptTokensDetails, ServerConfig,
                                      TokenizeRequest, TokenizeResponse, WholeCompletionChoice,
                                      TokenLogprob, TopLogprob, Usage, _Request, error_body)
from minivllm.server.tool_calls import ReasoningMode, after_reasoning

T = TypeVar("T")

logger = logging.getLogger(__name__)

# How long a server whose engine failed waits for its open responses before it exits.
SHUTDOWN_GRACE_S = 30

# Request fields an error message may name (its ``param``).
_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)

# JSON has no -inf: a logprob below this is reported as this (vLLM does the same).
_MIN_LOGPROB = -9999.0


class APIError(Exception):
    """An error answered with the OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class ClientDisconnected(Exception):
    """The client left before its response was ready (its requests are aborted)."""


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def _param_named(message: str) -> str | None:
    """The first request field ``message`` names, if any."""
    return next((w for w in re.findall(r"[a-z_]+", message) if w in _FIELDS), None)


def _refusal(message: str, request_ids: Sequence[str], req: _Request) -> APIError:
    """The 400 of an engine or ``SamplingParams`` refusal: without the engine's request ids
    (internal), ``param`` the field the message names, and ``max_tokens`` or
    ``structured_outputs`` under the name the request used for it."""
    for rid in request_ids:
        message = message.replace(f"request {rid!r}: ", "")
    param = _param_named(message)
    field, _ = req.completion_limit()
    if param == "max_tokens" and field != param:
        param = field
        if message.startswith("max_tokens "):
            message = field + message.removeprefix("max_tokens")
    elif param == "structured_outputs":
        param = req.structured_field() or param
    return APIError(400, message, param)


def _validation_error(exc: RequestValidationError) -> APIError:
    """``field: problem; ...``, one problem per top-level field; ``param`` the first field."""
    problems: dict[str, list[str]] = {}
    for err in exc.errors():
        if err.get("type") == "json_invalid":  # loc is ("body", character offset): no field
            detail = err.get("ctx", {}).get("error", "")
            return APIError(400, f"the request body is not valid JSON: {detail} (at character "
                                 f"{err['loc'][-1]})")
        if err.get("type") == "missing" and tuple(err.get("loc", ())) == ("body",):
            return APIError(400, "the request body is empty: send a JSON object")
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        problems.setdefault(loc[0] if loc else "", []).append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    # A union (``prompt``) reports one error per member it tried: say so instead.
    parts = [msgs[0] if len(msgs) == 1 else f"{field}: matches none of its accepted types ({msgs[0]}, ...)"
             for field, msgs in problems.items()]
    message = "; ".join(parts) or "invalid request"
    first = next(iter(problems), "")
    return APIError(400, message, first or _param_named(message))


def _sse(payload: Any) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class _ChunkWriter:
    """The SSE text of a stream's common chunks (a choice's new text, its finish reason),
    written from strings serialized once per response instead of a pydantic model per
    chunk: a stream gets a chunk per engine step, and the model is several times dearer
    on the event loop (``docs/tuning.md``, "Host path"). The text equals ``_sse`` of the
    model's dump, field for field (``tests/server/test_app.py`` compares them); chunks with
    logprobs, and the usage chunk, still go through the models.
    """

    def __init__(self, obj: str, rid: str, created: int, model: str, include_usage: bool) -> None:
        self.head = (f'data: {{"id":{json.dumps(rid)},"object":"{obj}","created":{created},'
                     f'"model":{json.dumps(model)},"choices":[{{"index":')
        self.tail = ',"logprobs":null}],"usage":null}\n\n' if include_usage else ',"logprobs":null}]}\n\n'

    def completion(self, index: int, text: str, finish_reason: str | None,
                   stop_reason: StopReason = None) -> str:
        return (f'{self.head}{index},"text":{json.dumps(text)},"finish_reason":'
                f'{json.dumps(finish_reason)},"stop_reason":{json.dumps(stop_reason)}{self.tail}')

    def chat(self, index: int, content: str | None, finish_reason: str | None,
             stop_reason: StopReason = None) -> str:
        delta = "{}" if content is None else f'{{"content":{json.dumps(content)}}}'
        return (f'{self.head}{index},"delta":{delta},"finish_reason":{json.dumps(finish_reason)},'
                f'"stop_reason":{json.dumps(stop_reason)}{self.tail}')


def _top(logprobs: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(logprobs.items(), key=lambda kv: -kv[1])[:k]


def _finite(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


class _Server:
    """The handlers' shared state: the engine, the config and the tokenizer."""

    def __init__(self, llm: Any, config: ServerConfig, engine: AsyncEngine | None = None) -> None:
        self.llm = llm
        self.config = config
        self.model_name = config.model_name
        self.engine = engine if engine is not None else AsyncEngine.from_llm(llm, ServerMetrics(config.model_name))
        self.metrics = self.engine.metrics
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}

    # ---- prompts -------------------------------------------------------------

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """Token ids of each prompt (text is tokenized; ids checked against the vocabulary)."""
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts: list[Any] = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, "prompt: is empty", "prompt")
        return [self._token_ids(i, p, "prompt", req.truncate_prompt_tokens) for i, p in enumerate(prompts)]

    def chat_prompt(self, req: ChatCompletionRequest) -> tuple[list[int], str]:
        """The prompt's token ids, and the text that opens the reply: the messages through the
        chat template, with the request's tools, ``chat_template_kwargs``,
        ``add_generation_prompt`` and ``continue_final_message``.

        The opening is what the template adds after the conversation (its generation
        prompt, which may open a ``<think>`` block), or the final message when it is
        continued: text a user wrote (say, about the ``<think>`` tag) is never in it.
        """
        messages, tools = [m.template_message() for m in req.messages], req.template_tools()
        if req.chat_template is not None and not self.config.trust_request_chat_template:
            raise APIError(400, "chat_template: this server takes no chat template from a request "
                                "(start it with --trust-request-chat-template, as vLLM)", "chat_template")
        template = req.chat_template or self.config.chat_template
        variables = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:
            variables.setdefault("reasoning_effort", req.reasoning_effort)

        def render(add_generation_prompt: bool, continue_final_message: bool) -> str:
            return self.llm.chat_prompt_text(messages, tools, variables,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, chat_template=template)
        try:
            text = render(req.add_generation_prompt, req.continue_final_message)
            if req.continue_final_message:
                opening = req.messages[-1].content
            elif req.add_generation_prompt:
                bare = render(False, False)
                opening = text[len(bare):] if text.startswith(bare) else ""
            else:
                opening = ""
        except TemplateError as e:  # the template's own check (say, roles that must alternate)
            raise APIError(400, f"messages: refused by the model's chat template: {e}", "messages") from e
        except ValueError as e:  # chat_template_kwargs that set apply_chat_template's own arguments
            raise APIError(400, str(e), _param_named(str(e))) from e
        return self._token_ids(0, text, "messages", req.truncate_prompt_tokens), opening

    def _token_ids(self, i: int, prompt: Any, field: str, keep: int | None = None) -> list[int]:
        """``prompt``'s token ids; ``keep``: only its last ``keep`` (``truncate_prompt_tokens``;
        -1: the context's length), as vLLM truncates from the left."""
        try:  # LLM's one prompt check: tokenize, non-empty, ids inside the vocabulary
            ids = self.llm.prompt_token_ids(i, prompt)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"{field}: {e}", field) from e
        if keep is None:
            return ids
        keep = self.engine.max_model_len if keep == -1 else keep
        return ids[-keep:]

    def max_tokens(self, req: _Request, prompts: list[list[int]]) -> int:
        """The request's completion limit: the one it sends, else its endpoint's default.

        The engine refuses a request that does not fit its context too; checked here first
        to blame the right field: the prompt when it leaves no room for one token, else
        the limit (as vLLM's server does).

        Raises:
            APIError: 400, naming ``prompt``/``messages`` or the limit's field.
        """
        max_len = self.engine.max_model_len
        i = max(range(len(prompts)), key=lambda j: len(prompts[j]))
        num, what = len(prompts[i]), f"prompt {i}" if len(prompts) > 1 else req.prompt_field
        has = "have" if what == "messages" else "has"
        context = f"This model's maximum context length (max_model_len) is {max_len} tokens"
        if num >= max_len:
            raise APIError(400, f"{context}, and the {what} {has} {num} tokens, which leaves no room "
                                "for a completion: shorten it", req.prompt_field)
        field, limit = req.completion_limit()
        if getattr(req, "prompt_only", False):
            return 1  # the prompt is scored by a step that samples one token, which is not returned
        room = max_len - num
        if limit is None:
            limit = req.default_max_tokens(room)
            if limit > room:
                raise APIError(400, f"{context}, and the {what} {has} {num} tokens: {room} are left for the "
                                    f"completion, fewer than the default {field} of {limit}; send a "
                                    f"smaller {field}", field)
        elif limit > room:
            raise APIError(400, f"{context}. However, you requested {num + limit} tokens ({num} in the "
                                f"{what}, {limit} in {field}): reduce {field} or the {what}", field)
        return limit

    def check_stop_token_ids(self, req: _Request) -> None:
        """Stop token ids must be in the vocabulary (the engine would never see them sampled)."""
        if not req.stop_token_ids:
            return
        vocab = self.llm.model_config.vocab_size
        bad = [t for t in req.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"stop_token_ids: {bad[:5]} outside the vocabulary [0, {vocab})",
                           "stop_token_ids")

    # ---- logprobs ------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        """A token's own text (special tokens as written); cached, the vocabulary is fixed."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.llm.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def completion_logprobs(self, d: Delta, offset: int) -> CompletionLogprobs:
        """The legacy ``logprobs`` object of ``d``'s tokens, whose text starts at ``offset``.

        ``top_logprobs`` holds the N most likely tokens and the sampled one (N + 1
        entries when it is not among them), as the OpenAI and vLLM completions APIs do.
        """
        assert d.logprobs is not None
        tokens = [self.token_text(t) for t in d.token_ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[_finite(lp[t]) for t, lp in zip(d.token_ids, d.logprobs)],
            top_logprobs=[{self.token_text(i): _finite(v) for i, v in _top(lp, len(lp))}
                          for lp in d.logprobs],
            text_offset=offsets)

    def echo_logprobs(self, prompt: list[int], d: Delta) -> CompletionLogprobs:
        """The legacy ``logprobs`` of an echoed prompt (the first token has none: null)."""
        assert d.prompt_logprobs is not None, "echo with logprobs asks the engine for the prompt's"
        tokens = [self.token_text(t) for t in prompt]
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[None if lp is None else _finite(lp[t]) for t, lp in zip(prompt, d.prompt_logprobs)],
            top_logprobs=[None if lp is None else {self.token_text(i): _finite(v) for i, v in _top(lp, len(lp))}
                          for lp in d.prompt_logprobs],
            text_offset=offsets)

    def prompt_logprobs(self, prompt: list[int], d: Delta) -> PromptLogprobs:
        """vLLM's ``prompt_logprobs``: per prompt token (None for the first), its listed tokens
        by id with their log-probability, rank among those listed and text."""
        assert d.prompt_logprobs is not None
        out: PromptLogprobs = []
        for lp in d.prompt_logprobs:
            if lp is None:
                out.append(None)
                continue
            ranked = _top(lp, len(lp))
            out.append({i: PromptLogprob(logprob=_finite(v), rank=rank, decoded_token=self.token_text(i))
                        for rank, (i, v) in enumerate(ranked, 1)})
        return out

    def chat_logprobs(self, d: Delta, k: int) -> ChoiceLogprobs:
        """``choices[i].logprobs`` of ``d``'s tokens, with the ``k`` most likely alternatives."""
        assert d.logprobs is not None

        def entry(token_id: int, logprob: float) -> TopLogprob:
            text = self.token_text(token_id)
            return TopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode()))

        content = []
        for t, lp in zip(d.token_ids, d.logprobs):
            own = entry(t, lp[t])
            content.append(TokenLogprob(token=own.token, logprob=own.logprob, bytes=own.bytes,
                                        top_logprobs=[entry(i, v) for i, v in _top(lp, k)]))
        return ChoiceLogprobs(content=content)

    # ---- running requests ----------------------------------------------------

    def check_model(self, req: Any) -> None:
        """404 unless ``req.model`` is unset or one of the served names."""
        if req.model is not None and req.model not in self.config.served_names:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves "
                                f"{_names(self.config.served_names)}", "model")

    async def submit(self, kind: str, prompts: list[list[int]], req: _Request,
                     tool_constraint: StructuredOutputs | None = None,
                     reasoning: ReasoningMode = "none") -> tuple[str, int, RequestGroup]:
        """Queue one request per prompt; returns the response id (``kind-<hex>``), its
        creation time and the requests' group. ``tool_constraint``: the grammar of a forced
        tool call (``tool_choice``), which no other constraint may accompany. ``reasoning``:
        where the model may reason before the request's own constraint applies (a chat
        reply with the reasoning parser on)."""
        request_id, created = f"{kind}-{req.request_id or uuid.uuid4().hex}", int(time.time())
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        max_tokens = self.max_tokens(req, prompts)
        self.check_stop_token_ids(req)
        try:
            params = req.to_sampling_params(max_tokens)
            if tool_constraint is not None:
                if params.structured_outputs is not None:
                    raise ValueError("tool_choice: a forced tool call cannot be combined with another "
                                     "structured-output constraint (response_format, structured_outputs)")
                params = dataclasses.replace(params, structured_outputs=tool_constraint)
            elif params.structured_outputs is not None and reasoning != "none":
                params = dataclasses.replace(params, structured_outputs=after_reasoning(
                    params.structured_outputs, reasoning))
            return request_id, created, await self.engine.add_requests(ids, prompts, params)
        except (ValueError, TypeError) as e:
            raise _refusal(str(e), ids, req) from e
        except EngineDeadError as e:
            raise APIError(500, str(e)) from e

    async def collect(self, request: Request, group: RequestGroup) -> list[list[Delta]]:
        """Every delta of ``group``, by choice index; a client gone meanwhile aborts it."""
        deltas: list[list[Delta]] = [[] for _ in range(group.num_choices)]

        async def gather() -> None:
            async for d in group:
                deltas[d.index].append(d)

        await self.until_disconnect(request, group, gather())
        return deltas

    async def until_disconnect(self, request: Request, group: RequestGroup,
                               work: Awaitable[T]) -> T:
        """Await ``work``; if the client disconnects first, abort ``group``, cancel ``work``
        and raise ``ClientDisconnected`` (answered with nothing: nobody is listening)."""
        work_task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work_task.done():
                work_task.cancel()
                self.engine.abort(group.request_ids)
        if not work_task.done():  # cancelled, and ends at the loop's next turn
            raise ClientDisconnected
        try:
            return work_task.result()
        except (EngineDeadError, RequestLostError) as e:
            raise APIError(500, str(e)) from e

    async def stream(self, group: RequestGroup, chunks: Callable[[Delta], list[str]],
                     first: list[str], usage_chunk: Callable[[Usage], str] | None
                     ) -> AsyncIterator[str]:
        """Server-sent events: ``first``, then ``chunks(delta)`` per delta, then (with
        ``usage_chunk``) the usage, then ``[DONE]``.

        Leaving early (the client disconnected, so the server cancelled this generator)
        aborts the group's unfinished requests.
        """
        last: dict[int, Delta] = {}
        try:
            for event in first:
                yield event
            async with aclosing(self.deltas(group)) as deltas:
                async for delta in deltas:
                    last[delta.index] = delta
                    for event in chunks(delta):
                        yield event
            if usage_chunk is not None:
                yield usage_chunk(_usage(last, group.n, self.config.enable_prompt_tokens_details))
        except (EngineDeadError, RequestLostError) as e:
            yield _sse(error_body(500, str(e)))
        yield _sse("[DONE]")

    async def deltas(self, group: RequestGroup) -> AsyncIterator[Delta]:
        """``group``'s deltas as they come (``EngineDeadError`` / ``RequestLostError`` pass
        through). Leaving early (close it: ``contextlib.aclosing``) aborts the group's
        unfinished requests."""
        try:
            async for delta in group:
                yield delta
        finally:
            if not group.finished:
                self.engine.abort(group.request_ids)

    # ---- chat turns: the chat route, and the APIs built on it ---------------

    async def start_chat(self, req: ChatCompletionRequest, kind: str = "chatcmpl") -> "ChatTurn":
        """Check, render and queue a chat request (id ``kind-<hex>``) with its output parser.

        Raises:
            APIError: 400 for what the template, the parsers or the engine refuse; 404 for
                another model's name.
        """
        self.check_model(req)
        prompt, opening = self.chat_prompt(req)
        try:
            parser = chat_output_parser(self.config, req, opening)
        except ValueError as e:
            raise APIError(400, str(e), _param_named(str(e))) from e
        rid, created, group = await self.submit(kind, [prompt], req,
                                                parser.constraint if parser is not None else None,
                                                parser.reasoning_mode if parser is not None else "none")
        return ChatTurn(req, rid, created, group, parser, prompt)

    def chat_choices(self, turn: "ChatTurn", deltas: list[list[Delta]]) -> tuple[list[ChatChoice], Usage]:
        """A finished turn's choices (each text parsed into reasoning and tool calls when the
        turn has a parser; finish and stop reasons; logprobs) and its usage."""
        top_k = turn.req.num_logprobs()
        choices = []
        for ds in deltas:
            d = merge_deltas(ds)
            message, called = (AssistantMessage(content=d.text), False) if turn.parser is None else \
                turn.parser.message(d.index, d.text)
            choices.append(ChatChoice(
                index=d.index, message=message, finish_reason=_chat_finish(d.finish_reason, called),
                stop_reason=d.stop_reason,
                logprobs=self.chat_logprobs(d, top_k) if top_k is not None else None,
                token_ids=list(d.token_ids) if turn.req.return_token_ids else None))
        return choices, _usage(_final(deltas), turn.group.n, self.config.enable_prompt_tokens_details)


@dataclasses.dataclass(frozen=True)
class ChatTurn:
    """A queued chat request: the request, its response id and creation time, its requests'
    group, its output parser (None: the text is the content) and its prompt's token ids."""

    req: ChatCompletionRequest
    rid: str
    created: int
    group: RequestGroup
    parser: ChatOutputParser | None
    prompt: list[int]


async def _wait_for_disconnect(request: Request) -> None:
    # After the body, receive() returns only when the client leaves (or the response ends).
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(last: dict[int, Delta], n: int, details: bool = False) -> Usage:
    """From each choice's last delta; choice i * n + j is completion j of prompt i, and each
    prompt counts once (its cached tokens too, with ``details``)."""
    prompt = sum(d.num_prompt_tokens for i, d in last.items() if i % n == 0)
    completion = sum(d.num_completion_tokens for d in last.values())
    cached = PromptTokensDetails(cached_tokens=sum(d.num_cached_tokens for i, d in last.items() if i % n == 0))
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=cached if details else None)


def _final(deltas: list[list[Delta]]) -> dict[int, Delta]:
    return {i: ds[-1] for i, ds in enumerate(deltas)}


def _chat_finish(reason: FinishReason | None, called: bool) -> ChatFinishReason | None:
    """A choice that called tools and then stopped reports ``tool_calls``, as OpenAI does."""
    return "tool_calls" if called and reason == "stop" else reason


def build_app(llm: Any, config: ServerConfig, engine: AsyncEngine | None = None) -> FastAPI:
    """The OpenAI-compatible app over ``llm`` (an ``LLM``: its engine, tokenizer and chat template).

    ``engine``: the ``AsyncEngine`` to serve with instead of one over ``llm``'s engine
    (``ProcessAsyncEngine``: the engine in its own process; ``llm`` is then an
    ``LLMFront``, which has the tokenizer and prompt checks but no model). The engine
    thread starts with the app (lifespan) and stops with it.

    Raises:
        ValueError: ``llm`` has no tokenizer.
    """
    server = _Server(llm, config, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, server.engine.close)

    app = FastAPI(title="minivllm", lifespan=lifespan)
    app.state.server = server
    # The last added runs first: the key is checked before any body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    _add_error_handlers(app)
    _add_info_routes(app, server)
    _add_completion_route(app, server)
    _add_chat_route(app, server)
    from minivllm.server import messages, responses  # built on the chat turn above
    responses.add_routes(app, server)
    messages.add_routes(app, server)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(ClientDisconnected)
    async def gone(request: Request, exc: ClientDisconnected) -> Response:
        # Never sent (the server drops what goes to a closed connection); nginx's code for it.
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = _validation_error(exc)
        return error_response(error.status, error.message, error.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        # A bug in a handler: the OpenAI body still (Starlette logs the traceback after).
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def _add_info_routes(app: FastAPI, server: _Server) -> None:
    @app.get("/health")
    async def health() -> Response:
        if server.engine.error is not None:
            return error_response(500, str(server.engine.error))
        return JSONResponse({"status": "ok"})

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=server.created, max_model_len=server.engine.max_model_len)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[card(name) for name in server.config.served_names]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id not in server.config.served_names:
            raise APIError(404, f"model {model_id!r} does not exist; this server serves "
                                f"{_names(server.config.served_names)}", "model")
        return card(model_id).model_dump()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        server.check_model(req)
        tokenizer = server.llm.tokenizer
        if req.prompt is not None:
            ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        else:
            try:
                chat = req.chat_request()
            except ValueError as e:  # the chat request's own checks (continue_final_message ...)
                raise APIError(400, str(e), _param_named(str(e))) from e
            ids, _ = server.chat_prompt(chat)
            if req.add_special_tokens:
                ids = tokenizer.build_inputs_with_special_tokens(ids)
        strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=server.engine.max_model_len, tokens=ids,
                                token_strs=strs).model_dump(exclude_none=True)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        server.check_model(req)
        vocab = server.llm.model_config.vocab_size
        bad = sorted({t for t in req.tokens if not 0 <= t < vocab})
        if bad:
            raise APIError(400, f"tokens: {bad[:8]} outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": server.llm.tokenizer.decode(req.tokens)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def _names(names: Sequence[str]) -> str:
    return " and ".join(repr(n) for n in names)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("minivllm")
    except PackageNotFoundError:  # run from the tree, not installed
        return "unknown"


def _chunk_json(chunk: CompletionStreamResponse | ChatCompletionChunk, include_usage: bool) -> dict:
    # With include_usage every chunk carries "usage" (null but in the last), as OpenAI sends it.
    return chunk.model_dump(exclude=None if include_usage else {"usage"})


def _add_completion_route(app: FastAPI, server: _Server) -> None:
    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Response:
        server.check_model(req)
        prompts = server.completion_prompts(req)
        rid, created, group = await server.submit("cmpl", prompts, req)
        want_logprobs = req.logprobs is not None
        echoed: set[int] = set()  # choices whose prompt was sent

        def body(choices: list[CompletionChoice], usage: Usage | None = None) -> dict:
            return _chunk_json(CompletionStreamResponse(id=rid, created=created, model=server.model_name,
                                                        choices=choices, usage=usage), req.include_usage)

        offsets: dict[int, int] = {}  # choice -> text offset of its next token
        writer = _ChunkWriter("text_completion", rid, created, server.model_name, req.include_usage)

        def echo(d: Delta) -> tuple[str, CompletionLogprobs | None]:
            """The prompt before a choice's first text (``echo``), and its logprobs."""
            if d.index in echoed:
                return "", None
            echoed.add(d.index)
            if not req.echo:
                return "", None
            ids = prompts[d.index // group.n]
            return server.llm.tokenizer.decode(ids), server.echo_logprobs(ids, d) if want_logprobs else None

        def chunk(d: Delta) -> list[str]:
            d = _scored_only(d) if req.prompt_only else d
            first = d.index not in echoed
            head, head_logprobs = echo(d)
            if not head and not d.text and d.finish_reason is None and not (
                    (want_logprobs or req.return_token_ids) and d.token_ids):
                return []
            if not want_logprobs and not req.return_token_ids:
                return [writer.completion(d.index, head + d.text, d.finish_reason, d.stop_reason)]
            logprobs = None
            if want_logprobs:
                offset = offsets.get(d.index, 0)
                logprobs = _joined(head_logprobs, server.completion_logprobs(d, offset + len(head)))
                offsets[d.index] = offset + sum(len(t) for t in logprobs.tokens)
            choice = CompletionChoice(index=d.index, text=head + d.text, finish_reason=d.finish_reason,
                                      stop_reason=d.stop_reason, logprobs=logprobs)
            event = body([choice])
            if req.return_token_ids:
                event["choices"][0]["token_ids"] = list(d.token_ids)
                if first:
                    event["choices"][0]["prompt_token_ids"] = prompts[d.index // group.n]
            return [_sse(event)]

        def usage_chunk(usage: Usage) -> str:
            return _sse(body([], usage))

        if req.stream:
            return StreamingResponse(server.stream(group, chunk, [], usage_chunk if req.include_usage else None),
                                     media_type="text/event-stream")
        deltas = await server.collect(request, group)
        choices = []
        for ds in deltas:
            d = merge_deltas(ds)
            d = _scored_only(d) if req.prompt_only else d
            head, head_logprobs = echo(d)
            logprobs = _joined(head_logprobs, server.completion_logprobs(d, len(head))) if want_logprobs else None
            choices.append(WholeCompletionChoice(
                index=d.index, text=head + d.text, finish_reason=d.finish_reason, stop_reason=d.stop_reason,
                logprobs=logprobs, prompt_logprobs=server.prompt_logprobs(prompts[d.index // group.n], d)
                if req.prompt_logprobs is not None else None,
                prompt_token_ids=prompts[d.index // group.n] if req.return_token_ids else None,
                token_ids=list(d.token_ids) if req.return_token_ids else None))
        last = _final(deltas)
        if req.prompt_only:
            last = {i: _scored_only(d) for i, d in last.items()}
        return JSONResponse(CompletionResponse(id=rid, created=created, model=server.model_name,
                                               choices=choices, usage=_usage(last, group.n, server.config.enable_prompt_tokens_details)
                                               ).model_dump())


def _scored_only(d: Delta) -> Delta:
    """``d`` without what was generated: a prompt-only request (``echo``, ``max_tokens`` 0)
    runs one token, which it does not return."""
    return dataclasses.replace(d, text="", token_ids=(), logprobs=() if d.logprobs is not None else None,
                               num_completion_tokens=0, finish_reason=d.finish_reason and "length",
                               stop_reason=None)


def _joined(a: CompletionLogprobs | None, b: CompletionLogprobs) -> CompletionLogprobs:
    if a is None:
        return b
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)


class _ChatChunks:
    """The chunks of one streamed chat request: plain text deltas, or the parsers' deltas
    (reasoning, tool calls) when the request has a parser; logprobs and the finish on the
    last chunk of a delta."""

    def __init__(self, server: _Server, req: ChatCompletionRequest, rid: str, created: int,
                 parser: Any, num_choices: int, prompt: list[int]) -> None:
        self.server, self.req, self.rid, self.created, self.prompt = server, req, rid, created, prompt
        self.top_k = req.num_logprobs()
        self.writer = _ChunkWriter("chat.completion.chunk", rid, created, server.model_name, req.include_usage)
        self.streams = {i: parser.stream(i) for i in range(num_choices)} if parser is not None else None

    def event(self, index: int, delta: DeltaMessage, finish_reason: ChatFinishReason | None = None,
              logprobs: ChoiceLogprobs | None = None, stop_reason: StopReason = None,
              token_ids: Sequence[int] = ()) -> str:
        choice = ChatStreamChoice(index=index, delta=delta, finish_reason=finish_reason,
                                  stop_reason=stop_reason, logprobs=logprobs)
        body = _chunk_json(ChatCompletionChunk(id=self.rid, created=self.created, model=self.server.model_name,
                                               choices=[choice]), self.req.include_usage)
        # A delta names only what it adds; finish_reason stays, as null, as OpenAI sends it.
        body["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        if self.req.return_token_ids:  # vLLM's: each chunk's new token ids (the prompt's in the first)
            body["choices"][0]["token_ids"] = list(token_ids)
        return _sse(body)

    def first(self, num_choices: int) -> list[str]:
        events = [self.event(i, DeltaMessage(role="assistant", content="")) for i in range(num_choices)]
        if self.req.return_token_ids:
            events[0] = events[0][:-len("}\n\n")] + f',"prompt_token_ids":{json.dumps(self.prompt)}}}\n\n'
        return events

    def __call__(self, d: Delta) -> list[str]:
        return self.plain(d) if self.streams is None else self.parsed(d)

    def plain(self, d: Delta) -> list[str]:
        top_k = self.top_k
        if not d.text and d.finish_reason is None and not ((top_k is not None or self.req.return_token_ids)
                                                           and d.token_ids):
            return []
        if top_k is None and not self.req.return_token_ids:
            return [self.writer.chat(d.index, d.text or None, d.finish_reason, d.stop_reason)]
        logprobs = self.server.chat_logprobs(d, top_k) if top_k is not None else None
        return [self.event(d.index, DeltaMessage(content=d.text) if d.text else DeltaMessage(),
                           d.finish_reason, logprobs, d.stop_reason, d.token_ids)]

    def parsed(self, d: Delta) -> list[str]:
        """The parsers' deltas, one chunk each; the last carries the logprobs and finish."""
        assert self.streams is not None
        stream = self.streams[d.index]
        messages = stream.feed(d.text) + (stream.finish() if d.finish_reason is not None else [])
        top_k = self.top_k
        logprobs = self.server.chat_logprobs(d, top_k) if top_k is not None and d.token_ids else None
        if not messages and d.finish_reason is None and logprobs is None and not (self.req.return_token_ids
                                                                                 and d.token_ids):
            return []
        messages = messages or [DeltaMessage()]
        last = len(messages) - 1
        return [self.event(d.index, m) for m in messages[:last]] + [
            self.event(d.index, messages[last], _chat_finish(d.finish_reason, stream.called), logprobs,
                       d.stop_reason, d.token_ids)]

    def usage(self, usage: Usage) -> str:
        return _sse(ChatCompletionChunk(id=self.rid, created=self.created, model=self.server.model_name,
                                        choices=[], usage=usage).model_dump())


def _add_chat_route(app: FastAPI, server: _Server) -> None:
    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        turn = await server.start_chat(req)
        if req.stream:
            chunks = _ChatChunks(server, req, turn.rid, turn.created, turn.parser, turn.group.num_choices, turn.prompt)
            return StreamingResponse(server.stream(turn.group, chunks, chunks.first(turn.group.num_choices),
                                                   chunks.usage if req.include_usage else None),
                                     media_type="text/event-stream")
        deltas = await server.collect(request, turn.group)
        choices, usage = server.chat_choices(turn, deltas)
        prompt_logprobs = server.prompt_logprobs(turn.prompt, deltas[0][0]) if req.prompt_logprobs is not None else None
        return JSONResponse(ChatCompletionResponse(
            id=turn.rid, created=turn.created, model=server.model_name, choices=choices, usage=usage,
            prompt_logprobs=prompt_logprobs, prompt_token_ids=turn.prompt if req.return_token_ids else None
        ).model_dump())


def serve(app: FastAPI, host: str, port: int, log_level: str = "info") -> int:
    """Run ``app`` (from ``build_app``) under uvicorn until it is stopped (returns 0) or its
    engine fails (returns 1).

    A server whose engine is dead shuts down, as vLLM's does, rather than answer 500 for
    ever: it stops accepting connections, answers the open requests (500, which the
    engine's failure gave them), and exits, so that a supervisor can restart it.
    """
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    failed = threading.Event()

    def stop(error: BaseException) -> None:  # on the engine thread; uvicorn polls should_exit
        failed.set()
        server.should_exit = True

    app.state.server.engine.on_failure(stop)
    server.run()
    if failed.is_set():
        logger.error("the server stopped because its engine failed: %s", app.state.server.engine.error)
        return 1
    return 0
