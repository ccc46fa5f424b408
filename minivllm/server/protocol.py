"""OpenAI API request and response models (pydantic v2), and the server's config.

Requests forbid unknown fields and are strict about types (``"16"`` is not an
int, ``1`` is not a bool), so a misspelt option or a wrong type is a 400 and
never silently ignored or coerced. A field of the OpenAI API that this server
does not implement is declared only to be refused with a message naming it.
Sampling values are checked once, by ``SamplingParams`` (``to_sampling_params``);
only what has no ``SamplingParams`` counterpart (``top_logprobs``,
``stream_options``) is checked here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from minivllm.outputs import FinishReason
from minivllm.sampling import MAX_LOGPROBS, MAX_N, SamplingParams

# A completion prompt: text, several texts, token ids, or several token-id lists.
PromptInput = Union[str, list[str], list[StrictInt], list[list[StrictInt]]]

# JSON integers are unbounded; the sampler packs these into int64 arrays.
Int64 = Annotated[int, Field(ge=-(1 << 63), le=(1 << 63) - 1)]

# OpenAI's own limit on n (the engine's, SamplingParams): each choice is a sequence.

DEFAULT_MAX_TOKENS = 16
DEFAULT_MAX_BODY_BYTES = 1 << 20

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
               404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 500: "internal_server_error"}


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server answers (the engine's options live in the ``LLM``).

    Attributes:
        model_name: the name clients send as ``model`` (another name is a 404).
        api_key: when set, every route but ``/health`` requires
            ``Authorization: Bearer <api_key>``.
        max_body_bytes: largest request body accepted; a larger one is a 413.
    """

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name must be a non-empty string, got {self.model_name!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be None or a non-empty string")
        b = self.max_body_bytes
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"max_body_bytes must be an int >= 1, got {b!r}")


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage (no choices)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class _Request(BaseModel):
    """Fields common to both endpoints. None means "the default", as OpenAI clients send it."""

    model_config = ConfigDict(extra="forbid", strict=True)

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

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "_Request":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def completion_limit(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        """Top log-probabilities per token asked for (``SamplingParams.logprobs``)."""
        return None

    def to_sampling_params(self) -> SamplingParams:
        """The request's ``SamplingParams``.

        Raises:
            ValueError: a sampling value out of range (``SamplingParams`` names it).
        """
        limit = self.completion_limit()
        given = dict(temperature=self.temperature, top_p=self.top_p, n=self.n, seed=self.seed,
                     presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                     repetition_penalty=self.repetition_penalty, stop=self.stop,
                     stop_token_ids=self.stop_token_ids)
        return SamplingParams(
            max_tokens=DEFAULT_MAX_TOKENS if limit is None else limit, top_k=self.top_k,
            min_p=self.min_p, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=self.num_logprobs(), **{k: v for k, v in given.items() if v is not None},
            # A response sent whole needs the engine's output once, at the end (as vLLM's server).
            output_kind="delta" if self.stream else "final_only")


class CompletionRequest(_Request):
    """POST /v1/completions."""

    prompt: PromptInput
    logprobs: Int64 | None = None
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo=true is not supported")
        return echo

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    """One chat turn, as the chat template reads it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = None   # the newer name of max_tokens; wins over it
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: only allowed when logprobs is true")
        return self

    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class Usage(BaseModel):
    """Token counts of one response: every prompt once, every choice's completion tokens
    (an eos or stop token that ended a choice counts, as it was generated)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions ``logprobs`` object, one entry per completion token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]   # where each token's text starts in the choice's text


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    """What a chunk adds to the assistant message (fields left out are unchanged)."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    finish_reason: FinishReason | None = None
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
