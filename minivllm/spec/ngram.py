"""N-gram prompt lookup (vLLM's ``method: "ngram"``): guess that the text repeats itself.

For the context's last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``,
find their latest earlier occurrence; the drafts are the tokens that followed it. The
first n that matches wins (longer n-grams are surer guesses). Host-only numpy: it suits
copy-heavy work (editing a given text or code, quoting a document).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from minivllm.config import SpeculativeConfig


class NgramProposer:
    """``spec.base.Proposer`` by prompt lookup."""

    on_device = False

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.speculative_config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self._arrays: dict[str, np.ndarray] = {}  # the contexts of the last call, by sequence name

    def config(self) -> dict[str, Any]:
        return dataclasses.asdict(self.speculative_config)

    def propose(self, contexts: Sequence[Sequence[int]], max_drafts: Sequence[int],
                names: Sequence[str] = ()) -> list[list[int]]:
        if not names:
            return [self.lookup(np.asarray(c, dtype=np.int64), k) if k > 0 else []
                    for c, k in zip(contexts, max_drafts)]
        # A context only grows: each sequence's int64 copy is kept and extended by the tokens
        # new since the last call (converting a whole list of thousands of tokens, for each
        # of hundreds of sequences, costs more than the lookup). Sequences not asked about
        # this time are forgotten.
        arrays = {}
        out = []
        for context, k, name in zip(contexts, max_drafts, names):
            arrays[name] = tokens = self._extended(self._arrays.get(name), context)
            out.append(self.lookup(tokens, k) if k > 0 else [])
        self._arrays = arrays
        return out

    @staticmethod
    def _extended(tokens: np.ndarray | None, context: Sequence[int]) -> np.ndarray:
        n = 0 if tokens is None else len(tokens)
        if n == len(context):
            return tokens  # type: ignore[return-value]
        if n == 0 or n > len(context):
            return np.asarray(context, dtype=np.int64)
        return np.concatenate([tokens, np.asarray(context[n:], dtype=np.int64)])

    def lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        """At most ``k`` tokens that followed the latest earlier occurrence of the longest
        matching suffix of ``tokens`` (int64 (L,)); [] when none matches.

        One pass over the context finds where its last token occurred before (the ends of
        every candidate match); only those few candidates are compared further."""
        size = len(tokens)
        if size < self.min_n + 1:
            return []
        ends = np.flatnonzero(tokens[self.min_n - 1:size - 1] == tokens[-1]) + self.min_n - 1
        if not ends.size:
            return []
        back = np.arange(self.max_n)                                   # offsets before each end
        before = ends[:, None] - back[None, :]                         # (C, max_n)
        ok = before >= 0
        same = (tokens[np.where(ok, before, 0)] == tokens[size - 1 - back][None, :]) & ok
        run = np.cumprod(same, axis=1).sum(axis=1)                     # matched suffix length per end
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            hits = np.flatnonzero(run >= n)
            if hits.size:
                start = int(ends[hits[-1]]) + 1  # the token after the latest occurrence
                return tokens[start:start + k].tolist()
        return []
