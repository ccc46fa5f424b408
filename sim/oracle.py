"""The unpaged oracle: what every request must produce, whatever the scheduling.

It runs ``fake_next_token`` on the plain token list (no blocks, no batching) and
applies DESIGN.md's finishing rules, so any paging or scheduling bug shows up as
a difference between the engine's output and the oracle's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from minivllm.sampling import SamplingParams
from sim.fake_executor import fake_next_token


@dataclass(frozen=True)
class Expected:
    """The oracle's answer for one request."""

    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" | "length"


def is_stop_token(token: int, params: SamplingParams, eos_token_id: int | None) -> bool:
    """Whether ``token`` ends a request: eos (unless ignored) or one of its stop tokens."""
    if token in params.stop_token_ids:
        return True
    return eos_token_id is not None and not params.ignore_eos and token == eos_token_id


def oracle_generate(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    eos_token_id: int | None,
    max_model_len: int,
    vocab_size: int,
) -> Expected:
    """Generate the completion the fake model gives an unpaged, unbatched request.

    Stops at the first of: eos (unless ``ignore_eos``), a stop token,
    ``max_tokens`` completion tokens, ``max_model_len`` total tokens. The token
    that stops it is included; if the last allowed token is also eos/stop the
    reason is ``stop``.

    Raises:
        ValueError: empty prompt, or a prompt already at ``max_model_len`` (no
            room for one completion token).
    """
    context = list(prompt_token_ids)
    if not context:
        raise ValueError("empty prompt")
    if len(context) >= max_model_len:
        raise ValueError(f"prompt of {len(context)} tokens leaves no room under max_model_len {max_model_len}")
    out: list[int] = []
    while True:
        token = fake_next_token(context, vocab_size)
        out.append(token)
        context.append(token)
        if is_stop_token(token, params, eos_token_id):
            return Expected(tuple(out), "stop")
        if len(out) >= params.max_tokens or len(context) >= max_model_len:
            return Expected(tuple(out), "length")
