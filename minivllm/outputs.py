"""What the engine hands back: per request, the tokens new since its last output."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence, Union

FinishReason = Literal["stop", "length", "abort"]
# What ended a request that finished with "stop": the stop token id or the stop string
# (vLLM's ``stop_reason``); None for eos, length and abort.
StopReason = Union[int, str, None]


def text_token_ids(token_ids: Sequence[int], finish_reason: FinishReason | None) -> Sequence[int]:
    """The tokens whose text a completion shows: all but the eos or stop token that ended it
    (``finish_reason`` "stop" without a stop string; a stop string's text is cut by the
    engine). It stays in ``token_ids`` (``docs/design.md``, "Finishing a request")."""
    return token_ids[:-1] if finish_reason == "stop" and token_ids else token_ids


def sequence_name(request_id: str, index: int) -> str:
    """The name of completion ``index`` of a request in the engine's records (``StepRecord``,
    traces): the request id for the first, ``"<id>#<index>"`` for the others (``n > 1``)."""
    return request_id if index == 0 else f"{request_id}#{index}"


@dataclass(slots=True)
class RequestOutput:
    """A request's progress, as reported by one ``LLMEngine.step()``.

    ``step()`` returns one for every request that produced tokens in that step
    (streaming), and a last one when the request ends (``finish_reason`` set);
    a request whose ``output_kind`` is FINAL_ONLY gets the last one only.

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
        index: which of the request's ``n`` completions this is (0 .. n-1); each
            completion is reported on its own, under the same ``request_id``.
        logprobs: with ``SamplingParams.logprobs``, per completion token so far
            (aligned with ``token_ids``), {token id: log-probability} of the top N
            tokens and of the token itself; else None.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, per prompt token,
            the same dict (None for the first token); else None. Complete in every
            output once the prompt has been computed.
        first_token_time: ``time.monotonic()`` when the engine applied the first
            completion token (None before it): a server's time to first token, also
            for requests reported only at the end. Not part of ``==``.
        stop_reason: once finished with ``stop``, the stop token id (one of
            ``stop_token_ids``) or the stop string that ended it; None while running
            and when eos, length or an abort ended it (vLLM's ``stop_reason``).
        num_cached_tokens: prompt tokens the prefix cache served when the request was
            first scheduled (whole blocks; 0 before it, or on a miss), vLLM's name. Not
            part of ``==``: a cache hit gives the same tokens as a miss.
        num_draft_tokens / num_accepted_tokens: speculative decoding, so far: draft tokens
            scored for this completion, and those kept. Not part of ``==``.

    A plain slotted dataclass, as vLLM's ``RequestOutput`` is a plain class: cheaper to
    build than a frozen one, and a streaming engine builds one per request per step
    (``docs/tuning.md``, "Host path"). The engine never changes an output it returned
    (``tests/engine/test_host_path.py``).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    text: str | None = None
    new_token_ids: tuple[int, ...] = ()
    index: int = 0
    logprobs: tuple[dict[int, float], ...] | None = None
    prompt_logprobs: tuple[dict[int, float] | None, ...] | None = None
    first_token_time: float | None = field(default=None, compare=False)
    stop_reason: StopReason = None
    num_cached_tokens: int = field(default=0, compare=False)
    num_draft_tokens: int = field(default=0, compare=False)
    num_accepted_tokens: int = field(default=0, compare=False)

    @property
    def name(self) -> str:
        """``sequence_name(request_id, index)``."""
        return sequence_name(self.request_id, self.index)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
