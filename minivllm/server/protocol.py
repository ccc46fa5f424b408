"""OpenAI API request and response models (pydantic v2), and the server's config.

Requests forbid unknown fields, so a misspelt option is a 400, never silently ignored;
types are read as vLLM's server reads them, by pydantic's lax mode (``"16"`` is 16, ``1``
is true; ``"hot"`` is no number, a 400); ``null`` for a field means its default, as OpenAI
clients send it for what they leave unset. A field of the OpenAI API that
this server does not implement is declared only to be refused with a message
naming it. Sampling values are checked once, by ``SamplingParams``
(``to_sampling_params``); only what has no ``SamplingParams`` counterpart
(``top_logprobs``, ``stream_options``, message content) is checked here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, Callable, ClassVar, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictInt, field_validator, model_serializer,
                      model_validator)

from minivllm.outputs import FinishReason, StopReason
from minivllm.sampling import MAX_LOGPROBS, MAX_N, SamplingParams, StructuredOutputs

logger = logging.getLogger(__name__)

# A completion prompt: text, several texts, token ids, or several token-id lists.
PromptInput = Union[str, list[str], list[StrictInt], list[list[StrictInt]]]

# JSON integers are unbounded; the sampler packs these into int64 arrays.
Int64 = Annotated[int, Field(ge=-(1 << 63), le=(1 << 63) - 1)]

# OpenAI's own limit on n (the engine's, SamplingParams): each choice is a sequence.

DEFAULT_MAX_TOKENS = 16
DEFAULT_MAX_BODY_BYTES = 1 << 20

REASONING_PARSERS = (None, "qwen3")
TOOL_CALL_PARSERS = (None, "hermes")
# OpenAI's rule for a function's name (it is also written into prompts and grammars).
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
               404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 500: "internal_server_error"}


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server answers (the engine's options live in the ``LLM``).

    Attributes:
        model_name: the name clients send as ``model`` (another name is a 404).
        api_key: when set, every ``/v1/*`` route requires ``Authorization: Bearer
            <api_key>`` (``/health`` and ``/metrics`` stay open, as in vLLM).
        max_body_bytes: largest request body accepted; a larger one is a 413.
        reasoning_parser: ``"qwen3"``: chat responses split ``<think>...</think>`` into
            ``reasoning_content`` (``minivllm/server/reasoning.py``); None: all content.
        tool_call_parser: ``"hermes"``: ``<tool_call>`` blocks become ``tool_calls``
            when a request gives tools (``minivllm/server/tool_calls.py``); None: a request
            whose tool_choice is ``auto`` is refused, as vLLM refuses it.
        aliases: more names clients may send as ``model`` (vLLM's ``--served-model-name A B``:
            responses and metrics carry the first, ``model_name``).
        chat_template: the chat template (Jinja text) that replaces the tokenizer's, or None.
        trust_request_chat_template: a request may send its own ``chat_template`` (vLLM's
            ``--trust-request-chat-template``; without it such a request is refused).
        enable_prompt_tokens_details: ``usage.prompt_tokens_details.cached_tokens`` in
            replies (vLLM's ``--enable-prompt-tokens-details``).
    """

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    reasoning_parser: Literal["qwen3"] | None = None
    tool_call_parser: Literal["hermes"] | None = None
    aliases: tuple[str, ...] = ()
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    enable_prompt_tokens_details: bool = False

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name clients may send as ``model``, the first the one responses carry."""
        return (self.model_name, *self.aliases)

    def __post_init__(self) -> None:
        for name in self.served_names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"model_name must be a non-empty string, got {name!r}")
        if len(set(self.served_names)) != len(self.served_names):
            raise ValueError(f"served model names must differ, got {list(self.served_names)}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be None or a non-empty string")
        b = self.max_body_bytes
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"max_body_bytes must be an int >= 1, got {b!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")


class _Body(BaseModel):
    """A JSON object of a request: unknown fields are refused, types read leniently (module
    doc); ``null`` for a field means its default (OpenAI clients send null for what they leave
    unset)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage (no choices)."""

    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """``response_format.json_schema``: a named JSON schema. ``strict`` is accepted; the
    schema is always enforced."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: required when type is 'json_schema', and only then")
        return self

    def constraint(self) -> StructuredOutputs | None:
        if self.type == "json_object":
            return StructuredOutputs(json_object=True)
        if self.json_schema is not None:
            return StructuredOutputs(json=self.json_schema.schema_)
        return None


class StructuredOutputsRequest(_Body):
    """vLLM's ``structured_outputs`` request field: one of these constraints, and whether
    JSON may have whitespace between its tokens."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def constraint(self) -> StructuredOutputs:
        return StructuredOutputs(json=self.json_, json_object=bool(self.json_object), regex=self.regex,
                                 choice=self.choice, grammar=self.grammar,  # type: ignore[arg-type]
                                 disable_any_whitespace=self.disable_any_whitespace)


# vLLM's older names of the structured-output constraints -> the StructuredOutputs field.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


# Fields of the OpenAI API that change nothing here (storage, billing, tracing, a predicted
# output): accepted, with one logged warning per field, as vLLM's server does.
IGNORED_FIELDS = frozenset({"store", "metadata", "service_tier", "prediction", "safety_identifier",
                            "prompt_cache_key", "web_search_options", "modalities", "audio"})
_warned: set[str] = set()


class _Request(_Body):
    """Fields common to both endpoints."""

    @model_validator(mode="before")
    @classmethod
    def _ignored_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not IGNORED_FIELDS & data.keys():
            return data
        for name in sorted(IGNORED_FIELDS & data.keys() - _warned):
            _warned.add(name)
            logger.warning("request field %r is accepted and ignored: it changes nothing on this server", name)
        return {k: v for k, v in data.items() if k not in IGNORED_FIELDS}

    request_id: str | None = None        # extension (vLLM): the response id's suffix
    priority: int = 0                    # extension (vLLM): only 0; requests are served in order
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None   # extension: keep the last k (-1: max)
    prompt_logprobs: Int64 | None = None  # extension (vLLM): the top N of each prompt token after the first
    skip_special_tokens: bool = True      # extension (vLLM): special tokens left out of the text
    return_token_ids: bool = False        # extension (vLLM): the prompt's and each choice's token ids
    logit_bias: dict[str, float] | None = None   # OpenAI's: {"token id": bias in [-100, 100]}
    allowed_token_ids: list[Int64] | None = None  # extension (vLLM): only these may be sampled
    min_tokens: Int64 = 0                 # extension (vLLM): no stop before this many tokens
    bad_words: list[str] | None = None    # extension (vLLM): words never generated

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keep_some(cls, keep: int | None) -> int | None:
        if keep == 0:
            raise ValueError("must be a number of tokens to keep (>= 1), or -1 for the context's length")
        return keep

    @field_validator("priority")
    @classmethod
    def _first_come_first_served(cls, priority: int) -> int:
        if priority != 0:
            raise ValueError("only priority 0 is served (this server schedules first come, first served, "
                             "as vLLM does without --scheduling-policy priority)")
        return priority

    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 = -1                    # extension
    min_p: float = 0.0                   # extension
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None      # extension
    include_stop_str_in_output: bool = False       # extension
    ignore_eos: bool = False             # extension
    n: Annotated[int, Field(le=MAX_N)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None        # extension
    user: str | None = None              # accepted, unused (an end-user id for the caller's logs)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None   # extension (vLLM)
    guided_json: dict[str, Any] | str | None = None              # extension (vLLM's older names)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "_Request":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    prompt_field: ClassVar[str] = "prompt"   # the field that holds the prompt (error messages name it)

    def completion_limit(self) -> tuple[str, int | None]:
        """The field that sets the completion's length, and its value (None: not sent)."""
        return "max_tokens", self.max_tokens

    def default_max_tokens(self, room: int) -> int:
        """``max_tokens`` when the request sends none (``room``: the context the prompt
        leaves): 16 here, as the OpenAI completions API says."""
        return DEFAULT_MAX_TOKENS

    def num_logprobs(self) -> int | None:
        """Top log-probabilities per token asked for (``SamplingParams.logprobs``)."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        """Top log-probabilities per prompt token asked for (``SamplingParams.prompt_logprobs``)."""
        return self.prompt_logprobs

    def _structured_asked(self) -> list[tuple[str, Callable[[], StructuredOutputs | None]]]:
        """Each field that asks for a structured-output constraint, and how to build it."""
        asked: list[tuple[str, Callable[[], StructuredOutputs | None]]] = []
        if self.response_format is not None and self.response_format.type != "text":
            asked.append(("response_format", self.response_format.constraint))
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", self.structured_outputs.constraint))
        for name, kind in GUIDED_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                asked.append((name, partial(StructuredOutputs, **{kind: value})))
        return asked

    def structured_field(self) -> str | None:
        """The field the structured-output constraint came from (the first, if several)."""
        asked = self._structured_asked()
        return asked[0][0] if asked else None

    def structured_constraint(self) -> StructuredOutputs | None:
        """The structured-output constraint asked for (``response_format``,
        ``structured_outputs`` or a ``guided_*`` field), if any.

        Raises:
            ValueError: more than one is asked for, or the one asked for is malformed
                (the message starts with its field).
        """
        asked = self._structured_asked()
        if len(asked) > 1:
            raise ValueError(f"{asked[0][0]}: a request takes one structured-output constraint, this "
                             f"one has {len(asked)} ({', '.join(name for name, _ in asked)})")
        if not asked:
            return None
        name, build = asked[0]
        try:
            return build()
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """The request's ``SamplingParams``, with ``max_tokens`` as the server resolved it
        (the limit sent, or the default that fits the context).

        Raises:
            ValueError: a sampling value out of range (``SamplingParams`` names it), or a
                structured-output request that is malformed or asks for two constraints.
        """
        bias = None
        if self.logit_bias is not None:
            try:
                bias = {int(t): b for t, b in self.logit_bias.items()}
            except ValueError:
                raise ValueError(f"logit_bias: keys must be token ids, got {sorted(self.logit_bias)!r}") from None
        given = dict(temperature=self.temperature, top_p=self.top_p, n=self.n, seed=self.seed, logit_bias=bias,
                     allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                     presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                     repetition_penalty=self.repetition_penalty, stop=self.stop,
                     stop_token_ids=self.stop_token_ids)
        return SamplingParams(
            max_tokens=max_tokens, top_k=self.top_k, min_tokens=self.min_tokens,
            min_p=self.min_p, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens,
            logprobs=self.num_logprobs(), prompt_logprobs=self.num_prompt_logprobs(),
            structured_outputs=self.structured_constraint(),
            **{k: v for k, v in given.items() if v is not None},
            # A response sent whole needs the engine's output once, at the end (as vLLM's server).
            output_kind="delta" if self.stream else "final_only")


class CompletionRequest(_Request):
    """POST /v1/completions."""

    prompt: PromptInput
    logprobs: Int64 | None = None
    echo: bool = False   # the prompt before the completion (with logprobs: the prompt's logprobs too)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """With ``echo`` and ``logprobs``, the prompt's tokens need them too."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @property
    def prompt_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the prompt scored, nothing generated (how
        lm-eval-harness asks for log-likelihoods)."""
        return self.echo and self.max_tokens == 0


class FunctionCallParam(_Body):
    """The function of a call in an assistant message: its name and arguments (JSON text)."""

    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _arguments_are_a_json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except ValueError as e:
            raise ValueError(f"function.arguments: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError("function.arguments: must be a JSON object")
        return arguments


class ToolCallParam(_Body):
    """A call an earlier assistant turn made (``messages[i].tool_calls[j]``)."""

    id: str
    type: Literal["function"]
    function: FunctionCallParam


class ChatMessage(_Body):
    """One chat turn. ``content`` is text or a list of ``{"type": "text", "text": ...}``
    parts (joined by newlines, as vLLM does); other part types (images, audio, files)
    are refused, as this server serves text models only. An assistant turn may carry the
    ``tool_calls`` it made (its content may then be null: read as "") and the reasoning a reply
    gave (``reasoning``, vLLM's current name, or ``reasoning_content``, its older one, as a
    client appends the reply it got); a ``tool`` turn answers the call named by its
    ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = Field(default=None, min_length=1)
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _calls_need_no_content(cls, data: Any) -> Any:
        # OpenAI clients send an assistant turn that only called tools with content null.
        if isinstance(data, dict) and data.get("content") is None and data.get("tool_calls"):
            return {**data, "content": ""}
        return data

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only an assistant message has them, not a {self.role} message")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("tool_call_id: a tool message needs one (the id of the call it answers), "
                             "and only a tool message has one")
        for field in ("reasoning", "reasoning_content"):
            if getattr(self, field) is not None and self.role != "assistant":
                raise ValueError(f"{field}: only an assistant message has reasoning, not a {self.role} message")
        if None not in (self.reasoning, self.reasoning_content) and self.reasoning != self.reasoning_content:
            raise ValueError("reasoning: differs from reasoning_content (two names of one field: send one)")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, content: Any) -> Any:
        if not isinstance(content, list):
            return content
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if not isinstance(kind, str):
                raise ValueError(f"part {i}: a content part is an object with a string 'type'")
            if kind != "text":
                raise ValueError(f"part {i}: content parts of type {kind!r} are not supported "
                                 "(this server takes text parts only)")
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise ValueError(f"part {i}: a text part is {{\"type\": \"text\", \"text\": <string>}}")
            texts.append(part["text"])
        return "\n".join(texts)

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template reads it: ``developer`` (OpenAI's newer name of
        ``system``) as ``system``; the name, tool calls and tool call id only when
        given; a call's arguments as an object (templates write it with ``tojson``), as vLLM
        hands them over."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = [
                {"id": c.id, "type": c.type,
                 "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:  # the name Qwen3's template reads
            message["reasoning_content"] = reasoning
        return message


class FunctionDefinition(_Body):
    """A tool's function: its name, what it does, and its parameters' JSON schema."""

    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None   # accepted; a forced call always follows the schema


class ChatTool(_Body):
    """One of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    """``tool_choice`` that forces one function: ``{"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = None   # the newer name of max_tokens; wins over it
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None   # default: auto with tools, none without
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None   # extension: template variables
    add_generation_prompt: bool = True       # extension: end with the template's opening of a reply
    continue_final_message: bool = False     # extension: the model continues the final message
    chat_template: str | None = None         # extension: this request's template (a trusting server's)
    reasoning_effort: str | None = None      # OpenAI's: a template variable, as vLLM hands it over
    prompt_field: ClassVar[str] = "messages"

    @model_validator(mode="after")
    def _one_way_to_end_the_prompt(self) -> "ChatCompletionRequest":
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be true with add_generation_prompt true "
                             "(continue the final message, or open a new reply; send add_generation_prompt false)")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the final message must be the assistant's, "
                             f"not the {self.messages[-1].role}'s")
        return self

    @model_validator(mode="after")
    def _prompt_logprobs_whole(self) -> "ChatCompletionRequest":
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not returned by a streamed chat reply (as vLLM); ask without stream")
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: only allowed when logprobs is true")
        return self

    @model_validator(mode="after")
    def _tool_choice_among_tools(self) -> "ChatCompletionRequest":
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: function names must be unique, got {names}")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice: only allowed with tools, and the request gives none")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: function {choice.function.name!r} is not among the tools {names}")
        return self

    def effective_tool_choice(self) -> str | dict[str, Any]:
        """``tool_choice`` as sent, or its default: ``auto`` with tools, ``none`` without."""
        if not self.tools:
            return "none"
        if self.tool_choice is None:
            return "auto"
        return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()

    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` as the chat template reads them (fields not sent left out)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def completion_limit(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def default_max_tokens(self, room: int) -> int:
        """The whole ``room`` left in the context, as vLLM's chat does."""
        return room

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class PromptTokensDetails(BaseModel):
    cached_tokens: int   # prompt tokens the prefix cache served


class Usage(BaseModel):
    """Token counts of one response: every prompt once, every choice's completion tokens
    (an eos or stop token that ended a choice counts, as it was generated);
    ``prompt_tokens_details`` on a server with ``enable_prompt_tokens_details``."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _details_where_given(self, handler: Any) -> dict[str, Any]:  # as vLLM: absent unless enabled
        d = handler(self)
        if d.get("prompt_tokens_details", 0) is None:
            del d["prompt_tokens_details"]
        return d


class CompletionLogprobs(BaseModel):
    """The legacy completions ``logprobs`` object, one entry per completion token."""

    tokens: list[str]
    token_logprobs: list[float | None]          # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]   # where each token's text starts in the choice's text


class PromptLogprob(BaseModel):
    """vLLM's entry of ``prompt_logprobs`` (per prompt token, by token id)."""

    logprob: float
    rank: int          # 1 + how many of the listed tokens are more likely
    decoded_token: str


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    stop_reason: StopReason = None   # vLLM's: the stop token id or stop string that ended it
    logprobs: CompletionLogprobs | None = None


class WholeCompletionChoice(CompletionChoice):
    """A choice of a response sent whole: vLLM's ``prompt_logprobs``, and with
    ``return_token_ids`` its prompt's and its own token ids, beside the rest."""

    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[WholeCompletionChoice]
    usage: Usage


class CompletionStreamResponse(BaseModel):
    """One server-sent event of a streamed completion (``usage`` only with include_usage)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]   # the token's text as UTF-8


class TokenLogprob(BaseModel):
    """A chat completion token, its log-probability and the most likely alternatives."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str   # JSON text


class ToolCall(BaseModel):
    """A call the model made (``message.tool_calls[i]``)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _Reasoning(BaseModel):
    """The reasoning of a reply or delta under both of vLLM's names: ``reasoning`` (current)
    and ``reasoning_content`` (older clients read it); either given sets both."""

    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _both_names(self) -> "_Reasoning":
        text = self.reasoning if self.reasoning is not None else self.reasoning_content
        self.reasoning = self.reasoning_content = text
        return self


class AssistantMessage(_Reasoning):
    """The reply: with the server's parsers, its reasoning and tool calls apart from the
    content (None when the choice has none)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


# A chat choice also ends with "tool_calls": it stopped after calling tools.
ChatFinishReason = Literal["stop", "length", "abort", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: ChatFinishReason | None
    stop_reason: StopReason = None
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = None   # vLLM's, with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None   # vLLM's, with prompt_logprobs
    prompt_token_ids: list[int] | None = None       # vLLM's, with return_token_ids


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed call's part: the first names ``id``, ``type`` and ``function.name`` (with
    ``arguments`` ""), later ones append to ``function.arguments``; ``index`` says which call."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_Reasoning):
    """What a chunk adds to the assistant message (fields left out are unchanged)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    finish_reason: ChatFinishReason | None = None
    stop_reason: StopReason = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (``usage`` only with include_usage)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "minivllm"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's): a completion ``prompt``, or chat ``messages`` rendered as the
    chat API renders them (with ``tools``, ``chat_template_kwargs``,
    ``add_generation_prompt`` and ``continue_final_message``)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    add_special_tokens: bool | None = None   # default: True for a prompt, False for messages (vLLM's)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: send a prompt or messages (one of them)")
        return self

    def chat_request(self) -> "ChatCompletionRequest":
        """The messages as a chat request renders them."""
        return ChatCompletionRequest(model=self.model, messages=self.messages, tools=self.tools,
                                     chat_template_kwargs=self.chat_template_kwargs, chat_template=self.chat_template,
                                     add_generation_prompt=self.add_generation_prompt,
                                     continue_final_message=self.continue_final_message)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[StrictInt]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None   # the request field at fault, when one is
    code: int


class ErrorResponse(BaseModel):
    """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error body for HTTP ``status`` (the one place its shape is built)."""
    info = ErrorInfo(message=message, type=ERROR_TYPES.get(status, "api_error"), param=param,
                     code=status)
    return ErrorResponse(error=info).model_dump()
