"""What the engine hands back for a finished request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class RequestOutput:
    """A finished request.

    Attributes:
        request_id: the caller's id.
        prompt_token_ids: the prompt as given.
        token_ids: completion tokens; the eos/stop token that ended it is included.
        finish_reason: ``stop`` (eos or a stop token), ``length`` (max_tokens or
            max_model_len) or ``abort``.
        text: the decoded completion (front ends fill it; the engine leaves None).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    text: str | None = None
