"""What the engine needs of a grammar engine: a matcher per constrained sequence.

The engine never imports torch, nor the grammar library (``xgrammar`` imports torch); it
talks to a ``GrammarBackend`` passed in. The product's backend is
``minivllm.structured.XGrammarBackend``; the simulator's is ``sim.grammar.FakeGrammarBackend``
(a small regex matcher over the fake vocabulary).

A token bitmask is xgrammar's layout: int32 ``(rows, cdiv(vocab_size, 32))``; token ``t`` is
allowed in a row iff bit ``t % 32`` of word ``t // 32`` is set. An unconstrained row has
every bit set (-1).

How a mask reaches the device with one step in flight (``LLMEngine.step``)::

    step() call k:  schedule N+1 | submit N+1 | wait for N, apply N (matchers accept N's tokens)
                    | fill N+1's masks | handle.set_token_bitmask
    device:         ... N ...........|... N+1's forward ....................| N+1's sampler

The forward of N+1 runs while the host waits for N and fills the masks; only the sampler of
N+1 waits for them.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from minivllm.sampling import StructuredOutputs

ALL_ALLOWED = -1  # an int32 bitmask word with every bit set


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def allowed_tokens(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """int64 ids of the tokens one bitmask row (int32 (W,)) allows, ascending."""
    bits = np.unpackbits(row.astype("<i4").view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


class GrammarMatcher(Protocol):
    """One sequence's position in its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) if the grammar does not allow it."""
        ...

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32 (R, W)); eos is allowed
        only where the grammar may end, and only eos once it has ended."""
        ...

    def is_terminated(self) -> bool:
        """Whether the grammar has ended (it accepted an eos token)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding: drafts are
        tried against the grammar, then the matcher goes back to the known tokens)."""
        ...


class GrammarBackend(Protocol):
    """Compiles ``StructuredOutputs`` against one vocabulary and hands out matchers."""

    vocab_size: int  # bitmask rows cover this many token ids

    def matcher(self, spec: StructuredOutputs) -> GrammarMatcher:
        """A fresh matcher at the start of ``spec``'s grammar (compiled grammars may be cached).

        Raises:
            ValueError: the grammar is invalid or of a kind this backend does not support.
        """
        ...

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: np.ndarray, rows: list[int]) -> None:
        """Fill ``bitmask[rows[i]]`` from ``matchers[i]`` (this backend's): one call per step."""
        ...


def fill_each(matchers: list[GrammarMatcher], bitmask: np.ndarray, rows: list[int]) -> None:
    """``fill_bitmasks`` one matcher at a time (a backend without a batched fill)."""
    for matcher, row in zip(matchers, rows):
        matcher.fill_bitmask(bitmask, row)
