"""The simulator's proposers: what a trace's ``config.speculative`` asks for.

``FakeProposer`` (``{"method": "fake", "num_speculative_tokens": k, "hit_rate": r}``) offers
the true next tokens, each right with probability ``r``: whether a draft is right is a hash
of its context, so a trace replays the same drafts, whatever the scheduling. The truth is
the oracle's completion where the runner gives it (``truth``: so drafts are right under
grammars and token rules too), else the fake model's next token. A wrong draft is another
token, and what follows it continues from it. It also offers fewer than it may, now and then.
With ``"on_device": true`` it stands for a draft model: the fake executor makes
the drafts within the step, the fake model's true tokens under the same hit rate.
Any other method is the product's (``SpeculativeConfig``: n-gram lookup).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
import xxhash

from minivllm.config import SpeculativeConfig
from minivllm.spec.ngram import NgramProposer
from sim.fake_executor import fake_next_token


class FakeProposer:
    """``spec.base.Proposer`` over the fake model, right with a replayable hit rate. With
    ``on_device`` it stands for a draft model: the engine never asks it, and the fake
    executor has it guess within the step (``FakeExecutor(drafter=...)``)."""

    def __init__(self, num_speculative_tokens: int, hit_rate: float, vocab_size: int,
                 truth: Callable[[str, list[int]], int | None] | None = None, on_device: bool = False) -> None:
        if not 0 <= hit_rate <= 1:
            raise ValueError(f"hit_rate must be in [0, 1], got {hit_rate!r}")
        self.num_speculative_tokens = num_speculative_tokens
        self.hit_rate = hit_rate
        self.vocab_size = vocab_size
        self.truth = truth  # (sequence name, context) -> the right next token, None: unknown
        self.on_device = on_device

    def config(self) -> dict[str, Any]:
        out = {"method": "fake", "num_speculative_tokens": self.num_speculative_tokens, "hit_rate": self.hit_rate}
        return {**out, "on_device": True} if self.on_device else out

    def propose(self, contexts: Sequence[Sequence[int]], max_drafts: Sequence[int],
                names: Sequence[str]) -> list[list[int]]:
        if self.on_device:
            raise RuntimeError("drafts made on the device are never asked for (spec/base.py)")
        return [self._drafts(name, list(c), k) for c, k, name in zip(contexts, max_drafts, names)]

    def _drafts(self, name: str, context: list[int], k: int) -> list[int]:
        u = _unit(context, b"how many")
        n = k if u < 0.7 else int(u * 1000) % (k + 1)

        def truth(ctx: list[int]) -> int:
            true = self.truth(name, ctx) if self.truth is not None else None
            return fake_next_token(ctx, self.vocab_size) if true is None else true
        return self.guesses(context, n, truth)

    def guesses(self, context: Sequence[int], n: int, truth: Callable[[list[int]], int]) -> list[int]:
        """``n`` drafts after ``context``, each ``truth`` of the context before it with
        probability ``hit_rate`` (a hash of that context decides), else another token."""
        context = list(context)
        drafts = []
        for _ in range(n):
            true = truth(context)
            u = _unit(context, b"right")
            token = true if u < self.hit_rate else (true + 1 + int(u * 1e6) % (self.vocab_size - 1)) % self.vocab_size
            drafts.append(token)
            context.append(token)
        return drafts


def _unit(context: Sequence[int], salt: bytes) -> float:
    """A number in [0, 1) that only ``context`` and ``salt`` decide."""
    return xxhash.xxh64_intdigest(np.asarray(context, dtype=np.int64).tobytes() + salt) / 2**64


def make_proposer(config: Mapping[str, Any] | None, vocab_size: int,
                  truth: Callable[[str, list[int]], int | None] | None = None
                  ) -> FakeProposer | NgramProposer | None:
    """The proposer a trace's ``speculative`` config names (None: no speculation)."""
    if config is None:
        return None
    if config.get("method") == "fake":
        return FakeProposer(int(config["num_speculative_tokens"]), float(config["hit_rate"]), vocab_size, truth,
                            on_device=bool(config.get("on_device", False)))
    spec = SpeculativeConfig.from_dict(config)
    if spec.method != "ngram":
        raise ValueError(f"a trace's speculative method {spec.method!r} has no stand-in here: its drafts came "
                         "from a model the simulator does not run (the fake proposer stands for one: "
                         "'method': 'fake', 'on_device': true)")
    return NgramProposer(spec)
