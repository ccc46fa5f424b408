"""The simulator's proposers: what a trace's ``config.speculative`` asks for.

``FakeProposer`` (``{"method": "fake", "num_speculative_tokens": k, "hit_rate": r}``) offers
the true next tokens, each right with probability ``r``: whether a draft is right is a hash
of its context, so a trace replays the same drafts, whatever the scheduling. The truth is
the oracle's completion where the runner gives it (``truth``: so drafts are right under
grammars and token rules too), else the fake model's next token. A wrong draft is another
token, and what follows it continues from it. It also offers fewer than it may, now and then.
Any other method is the product's (``SpeculativeConfig``: n-gram lookup).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
import xxhash

from minivllm.config import SpeculativeConfig
from minivllm.spec.base import Proposer
from minivllm.spec.ngram import NgramProposer
from sim.fake_executor import fake_next_token


class FakeProposer:
    """``spec.base.Proposer`` over the fake model, right with a replayable hit rate."""

    def __init__(self, num_speculative_tokens: int, hit_rate: float, vocab_size: int,
                 truth: Callable[[str, list[int]], int | None] | None = None) -> None:
        if not 0 <= hit_rate <= 1:
            raise ValueError(f"hit_rate must be in [0, 1], got {hit_rate!r}")
        self.num_speculative_tokens = num_speculative_tokens
        self.hit_rate = hit_rate
        self.vocab_size = vocab_size
        self.truth = truth  # (sequence name, context) -> the right next token, None: unknown

    def config(self) -> dict[str, Any]:
        return {"method": "fake", "num_speculative_tokens": self.num_speculative_tokens, "hit_rate": self.hit_rate}

    def propose(self, contexts: Sequence[Sequence[int]], max_drafts: Sequence[int],
                names: Sequence[str]) -> list[list[int]]:
        return [self._drafts(name, list(c), k) for c, k, name in zip(contexts, max_drafts, names)]

    def _drafts(self, name: str, context: list[int], k: int) -> list[int]:
        u = _unit(context, b"how many")
        n = k if u < 0.7 else int(u * 1000) % (k + 1)
        drafts = []
        for _ in range(n):
            true = self.truth(name, context) if self.truth is not None else None
            if true is None:
                true = fake_next_token(context, self.vocab_size)
            u = _unit(context, b"right")
            token = true if u < self.hit_rate else (true + 1 + int(u * 1e6) % (self.vocab_size - 1)) % self.vocab_size
            drafts.append(token)
            context.append(token)
        return drafts


def _unit(context: Sequence[int], salt: bytes) -> float:
    """A number in [0, 1) that only ``context`` and ``salt`` decide."""
    return xxhash.xxh64_intdigest(np.asarray(context, dtype=np.int64).tobytes() + salt) / 2**64


def make_proposer(config: Mapping[str, Any] | None, vocab_size: int,
                  truth: Callable[[str, list[int]], int | None] | None = None) -> Proposer | None:
    """The proposer a trace's ``speculative`` config names (None: no speculation)."""
    if config is None:
        return None
    if config.get("method") == "fake":
        return FakeProposer(int(config["num_speculative_tokens"]), float(config["hit_rate"]), vocab_size, truth)
    return NgramProposer(SpeculativeConfig.from_dict(config))
