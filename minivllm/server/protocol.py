"""OpenAI API request and response models (pydantic v2).

Requests forbid unknown fields, so a misspelt or unsupported option is a 400 and
never silently ignored. Fields of the OpenAI API that this server does not
implement yet are declared only to be refused with a message naming them.
Sampling values are checked once, by ``SamplingParams`` (``to_sampling_params``).
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator

from minivllm.outputs import FinishReason
from minivllm.sampling import SamplingParams

# A completion prompt: text, several texts, token ids, or several token-id lists.
PromptInput = Union[str, list[str], list[StrictInt], list[list[StrictInt]]]

# Fields of the OpenAI API that are refused (400) unless left at a value that asks
# for nothing (OpenAI clients send those as defaults).
UNSUPPORTED_FIELDS = ("stop", "logprobs", "presence_penalty", "frequency_penalty")


def _asks_for_nothing(field: str, value: Any) -> bool:
    if value is None:
        return True
    if field == "stop":
        return value == []
    if field == "logprobs":
        return value is False  # logprobs=0 still asks for the sampled token's logprob
    return value == 0.0  # a penalty of 0 is no penalty


class _Request(BaseModel):
    """Fields common to both endpoints."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                      # extension
    min_p: float = 0.0                   # extension
    seed: int | None = None
    stream: bool = False
    stop_token_ids: list[StrictInt] = Field(default_factory=list)  # extension
    ignore_eos: bool = False             # extension
    n: int = 1
    stop: str | list[str] | None = None
    logprobs: bool | int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n={n}: n>1 is not supported yet (only n=1)")
        return n

    @field_validator(*UNSUPPORTED_FIELDS)
    @classmethod
    def _not_supported_yet(cls, value: Any, info: ValidationInfo) -> Any:
        if not _asks_for_nothing(info.field_name, value):
            raise ValueError(f"{info.field_name} is not supported yet")
        return value

    def to_sampling_params(self) -> SamplingParams:
        """The request's ``SamplingParams``.

        Raises:
            ValueError: a sampling value out of range (``SamplingParams`` names it).
        """
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              min_p=self.min_p, max_tokens=self.max_tokens, seed=self.seed,
                              ignore_eos=self.ignore_eos, stop_token_ids=tuple(self.stop_token_ids))


class CompletionRequest(_Request):
    """POST /v1/completions."""

    prompt: PromptInput


class ChatMessage(BaseModel):
    """One chat turn, as the chat template reads it."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)


class Usage(BaseModel):
    """Token counts of one response."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamResponse(BaseModel):
    """One server-sent event of a streamed completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason | None


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


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]


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
    code: int


class ErrorResponse(BaseModel):
    """The OpenAI error body: ``{"error": {"message", "type", "code"}}``."""

    error: ErrorInfo
