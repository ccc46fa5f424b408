"""What the engine hands back: per request, the tokens new since its last output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class RequestOutput:
    """A request's progress, as reported by one ``LLMEngine.step()``.

    ``step()`` returns one for every request that produced tokens in that step
    (streaming), and a last one when the request ends (``finish_reason`` set).

    Attributes:
        request_id: the caller's id.
        prompt_token_ids: the prompt as given.
        token_ids: every completion token so far; once finished, the eos/stop token
            that ended it is included.
        finish_reason: None while the request runs; ``stop`` (eos or a stop token),
            ``length`` (max_tokens or max_model_len) or ``abort`` when it ends.
        text: the decoded completion (front ends fill it; the engine leaves None).
        new_token_ids: the tokens since this request's previous output (the
            streaming delta); their concatenation over all outputs is ``token_ids``.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    text: str | None = None
    new_token_ids: tuple[int, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
