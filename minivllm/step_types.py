"""Plain per-sequence data of a step, shared by the engine and the layers.

``TokenHistory`` travels in a ``StepPlan`` to the penalty layer, ``TokenLogprobs``
comes back from the logprobs layer in a ``StepResult``. They live here, outside
``minivllm.engine`` and ``minivllm.layers``, so that neither package imports the
other. Frozen numpy data only: no torch (the engine never imports it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["TokenHistory", "TokenLogprobs"]


@dataclass(frozen=True)
class TokenHistory:
    """A sequence's known tokens, for penalties: the prompt, then the completion."""

    token_ids: np.ndarray  # int64 (L,), read-only
    num_prompt_tokens: int


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at P positions (from the raw logits, float32).

    token_logprobs: float32 (P,), of the token at each position (the sampled one,
        or the prompt's next token).
    top_ids / top_logprobs: int64 / float32 (P, K), the K most likely tokens,
        most likely first (K = the request's ``logprobs`` / ``prompt_logprobs``).
    """

    token_logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    def as_dicts(self, token_ids: "np.ndarray | list[int]") -> list[dict[int, float]]:
        """Per position, {token: logprob} of the top K and of the position's token."""
        out = []
        for tok, lp, ids, lps in zip(np.asarray(token_ids).tolist(), self.token_logprobs.tolist(),
                                     self.top_ids.tolist(), self.top_logprobs.tolist()):
            d = dict(zip(ids, lps))
            d[tok] = lp
            out.append(d)
        return out
