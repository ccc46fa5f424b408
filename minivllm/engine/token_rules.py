"""``min_tokens`` and ``bad_words``: token bans the engine writes into a row's token bitmask.

vLLM applies both as logits processors on the device. Here they ride on the grammars'
road (``engine/grammar.py``): a row under a rule is a masked row of its step, and its
bitmask is filled on the host once every token before it is known, so one step in
flight changes nothing. Which rows are masked is decided when the step is planned:

- a row with ``bad_words_token_ids``: every sampled position;
- a row with ``min_tokens``: while its completion has fewer than ``min_tokens`` tokens
  (the count is known at planning; the tokens themselves only at filling).

At filling, a row's banned tokens are cleared from its bitmask (after its grammar's
mask, if it has one). A rule never leaves a row with no token: where it would, the
grammar's mask stands, since the grammar decides where its output may end.
"""

from __future__ import annotations

from typing import Collection, Sequence

import numpy as np

from minivllm.sampling import SamplingParams


def masks_position(params: SamplingParams, num_output_before: int) -> bool:
    """Whether the completion token after ``num_output_before`` others samples under a rule."""
    return bool(params.bad_words_token_ids) or num_output_before < params.min_tokens


def banned_tokens(params: SamplingParams, output: Sequence[int], eos: Collection[int]) -> set[int]:
    """The tokens a rule bans after the completion ``output`` (``eos``: the model's ids)."""
    banned: set[int] = set()
    if len(output) < params.min_tokens:
        banned.update(params.stop_token_ids)
        if not params.ignore_eos:
            banned.update(eos)
    for word in params.bad_words_token_ids:
        k = len(word) - 1  # the tokens before the banned one
        if k == 0 or (len(output) >= k and tuple(output[-k:]) == word[:-1]):
            banned.add(word[-1])
    return banned


def ban(bitmask: np.ndarray, row: int, tokens: Collection[int], vocab_size: int) -> None:
    """Clear ``tokens`` (ids past ``vocab_size`` are never sampled: skipped) from
    ``bitmask[row]`` (int32 (R, W), ``engine/grammar.py``'s layout), unless that would
    leave the row with no token."""
    ids = np.fromiter((t for t in tokens if t < vocab_size), dtype=np.int64)
    if not ids.size:
        return
    words = bitmask[row].view(np.uint32)  # unsigned: bit 31 is a token like any other
    cleared = words.copy()
    np.bitwise_and.at(cleared, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
    full, tail = divmod(vocab_size, 32)
    if cleared[:full].any() or (tail and cleared[full] & np.uint32((1 << tail) - 1)):
        words[:] = cleared
