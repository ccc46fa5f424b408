"""The unpaged oracle: what every request must produce, whatever the scheduling.

It runs ``fake_next_token`` on the plain token list (no blocks, no batching) and
applies the finishing rules of ``docs/design.md`` ("Scheduler"), so any paging or
scheduling bug shows up as a difference between the engine's output and the oracle's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from minivllm.engine.grammar import GrammarBackend, allowed_tokens, bitmask_width
from minivllm.sampling import SamplingParams, eos_token_set
from sim.fake_executor import (
    fake_logprob, fake_masked_next_token, fake_next_token, fake_top_logprobs, hybrid_context,
)

# The fake tokenizer: token t reads as one character, FAKE_ALPHABET[t % 10], so short
# stop strings over this alphabet end requests often enough to matter.
FAKE_ALPHABET = "abcdefghij"


def fake_text(token_ids: Sequence[int]) -> str:
    """The fake tokenizer's text of ``token_ids``."""
    return "".join(FAKE_ALPHABET[t % len(FAKE_ALPHABET)] for t in token_ids)


class FakeTextStream:
    """The engine's text stream over the fake tokenizer (one character per token)."""

    def __init__(self, prompt_token_ids: Sequence[int], params: object = None) -> None:
        self.prompt_token_ids = list(prompt_token_ids)

    def add(self, token_ids: Sequence[int]) -> str:
        return fake_text(token_ids)

    @staticmethod
    def encode(text: str) -> list[int]:
        """A text's fake token ids: each letter's first id (spaces and others: none)."""
        return [FAKE_ALPHABET.index(c) for c in text if c in FAKE_ALPHABET]


@dataclass(frozen=True)
class Expected:
    """The oracle's answer for one request."""

    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" | "length"
    text: str | None = None  # for requests with stop strings: the text, cut at the stop string
    # As RequestOutput's: with params.logprobs / params.prompt_logprobs, else None.
    logprobs: tuple[dict[int, float], ...] | None = None
    prompt_logprobs: tuple[dict[int, float] | None, ...] | None = None


def fake_logprobs_dict(context: Sequence[int], token: int, k: int, vocab_size: int) -> dict[int, float]:
    """What the engine reports at one position: the fake top ``k`` and ``token``'s own."""
    d = dict(fake_top_logprobs(context, k, vocab_size))
    d[token] = fake_logprob(context, token, vocab_size)
    return d


def _with_logprobs(e: Expected, prompt: list[int], params: SamplingParams, vocab_size: int,
                   view: Callable[[list[int]], Sequence[int]]) -> Expected:
    lp = plp = None
    if params.logprobs is not None:
        lp = tuple(fake_logprobs_dict(view(prompt + list(e.token_ids[:i])), t, params.logprobs, vocab_size)
                   for i, t in enumerate(e.token_ids))
    if params.prompt_logprobs is not None:
        plp = (None,) + tuple(fake_logprobs_dict(view(prompt[:j]), prompt[j], params.prompt_logprobs, vocab_size)
                              for j in range(1, len(prompt)))
    return Expected(e.token_ids, e.finish_reason, e.text, lp, plp)


def is_stop_token(token: int, params: SamplingParams, eos_token_id: int | Sequence[int] | None) -> bool:
    """Whether ``token`` ends a request: an eos id (unless ignored) or one of its stop tokens."""
    if token in params.stop_token_ids:
        return True
    return not params.ignore_eos and token in eos_token_set(eos_token_id)


def oracle_generate(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    eos_token_id: int | Sequence[int] | None,
    max_model_len: int,
    vocab_size: int,
    next_token: Callable[[list[int]], int] | None = None,
    grammar_backend: GrammarBackend | None = None,
    hybrid: bool = False,
) -> Expected:
    """Generate the completion the fake model gives an unpaged, unbatched request.

    ``next_token`` replaces the hash model (``fake_next_token``), e.g. by the
    recorded model of a live trace (``sim.fake_executor.recorded_next_token``).
    A request with ``structured_outputs`` samples under its grammar's mask from
    ``grammar_backend`` (``fake_masked_next_token``), position by position; so does
    a position under a token rule (``bad_words_token_ids``: every one; ``min_tokens``:
    the first ``min_tokens``), over the tokens the rule leaves. With ``hybrid`` the model
    is the hybrid fake model's: every context is seen followed by its fold
    (``sim.fake_executor.hybrid_context``).

    Stops at the first of: eos (unless ``ignore_eos``), a stop token, a stop
    string in the (fake) text (not one that ends within the first ``min_tokens``
    tokens), ``max_tokens`` completion tokens,
    ``max_model_len`` total tokens. The token that stops it is included; if the
    last allowed token is also eos/stop the reason is ``stop``. A stop string cuts
    the text before it (after it with ``include_stop_str_in_output``); an eos or
    stop token adds nothing to the text.

    Raises:
        ValueError: empty prompt, or a prompt already at ``max_model_len`` (no
            room for one completion token).
    """
    view: Callable[[list[int]], Sequence[int]] = hybrid_context if hybrid else (lambda context: context)
    if next_token is None:
        next_token = lambda context: fake_next_token(view(context), vocab_size)  # noqa: E731
    if params.structured_outputs is not None or params.min_tokens or params.bad_words_token_ids:
        if params.structured_outputs is not None and grammar_backend is None:
            raise ValueError("a request with structured_outputs needs a grammar backend")
        next_token = _masked_model(grammar_backend, params, vocab_size, len(prompt_token_ids),
                                   eos_token_set(eos_token_id), next_token, view)
    e = _generate(list(prompt_token_ids), params, eos_token_id, max_model_len, next_token)
    return _with_logprobs(e, list(prompt_token_ids), params, vocab_size, view)


def _masked_model(backend: GrammarBackend | None, params: SamplingParams, vocab_size: int, num_prompt: int,
                  eos: frozenset[int], unmasked: Callable[[list[int]], int],
                  view: Callable[[list[int]], Sequence[int]]) -> Callable[[list[int]], int]:
    """The fake model under the request's grammar and token rules: mask, pick, advance the
    matcher; ``unmasked`` at a position neither masks."""
    matcher = backend.matcher(params.structured_outputs) if params.structured_outputs is not None else None
    mask = np.empty((1, bitmask_width(vocab_size)), dtype=np.int32)
    every = np.arange(vocab_size)

    def next_token(context: list[int]) -> int:
        out = context[num_prompt:]
        if matcher is None and not params.bad_words_token_ids and len(out) >= params.min_tokens:
            return unmasked(context)
        allowed = every
        if matcher is not None:
            matcher.fill_bitmask(mask, 0)
            allowed = allowed_tokens(mask[0], vocab_size)
        banned = set()
        if len(out) < params.min_tokens:
            banned |= set(params.stop_token_ids) | (set() if params.ignore_eos else eos)
        for word in params.bad_words_token_ids:
            k = len(word) - 1
            if len(out) >= k and out[len(out) - k:] == list(word[:-1]):
                banned.add(word[-1])
        left = allowed[~np.isin(allowed, list(banned))]
        token = fake_masked_next_token(view(context), left if len(left) else allowed, vocab_size)
        assert matcher is None or matcher.accept_token(token)
        return token
    return next_token


def _generate(prompt: list[int], params: SamplingParams, eos_token_id: int | Sequence[int] | None, max_model_len: int,
              next_token: Callable[[list[int]], int]) -> Expected:
    context = list(prompt)
    if not context:
        raise ValueError("empty prompt")
    if len(context) >= max_model_len:
        raise ValueError(f"prompt of {len(context)} tokens leaves no room under max_model_len {max_model_len}")
    out: list[int] = []
    text = "" if params.stop else None
    eos = eos_token_set(eos_token_id)  # once, not per token
    while True:
        token = next_token(context)
        out.append(token)
        context.append(token)
        if is_stop_token(token, params, eos):
            return Expected(tuple(out), "stop", text)
        if text is not None:
            text += fake_text([token])
            ends = [] if len(out) <= params.min_tokens else [
                (len(text) - len(s), s) for s in params.stop if text.endswith(s)]  # one char per token
            if ends:
                i, s = min(ends)
                return Expected(tuple(out), "stop", text[:i + len(s)] if params.include_stop_str_in_output
                                else text[:i])
        if len(out) >= params.max_tokens or len(context) >= max_model_len:
            return Expected(tuple(out), "length", text)
