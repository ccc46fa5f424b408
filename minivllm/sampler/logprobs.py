"""Log-probabilities of given tokens and the top K, from raw logits, and their trip to the host.

Computed in float32 from the raw logits (before penalties, temperature and
filters: vLLM's default ``raw_logprobs``), in slices of ``SLICE_ROWS`` rows so a
long prompt never holds a (P, V) float32 block at once (V = 151,936: 600 KB a row).

The results of a step come down in ONE device->host copy: each block is packed
into an int64 vector (``LogprobTensors.packed``) with the float32 values widened
to float64 and reinterpreted as int64 (exact both ways), so it travels in the same
int64 buffer as the sampled ids. ``LogprobLayout`` is the host's record of which
sequence owns which rows and how many of the K columns it asked for::

    packed (N rows, K columns):  token_logprobs (N) | top_ids (N*K) | top_logprobs (N*K)
    layout:  seq 7 -> rows 0..2, K 5;  seq 9 -> rows 3..3, K 0   (K = the largest asked)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from minivllm.step_types import TokenLogprobs

__all__ = ["SLICE_ROWS", "LogprobLayout", "LogprobTensors", "compute_logprobs", "sliced_logprobs"]

# Rows of logits materialised at a time: bounds the (rows, V) float32 log-softmax.
SLICE_ROWS = 256


@dataclass(frozen=True)
class LogprobTensors:
    """Log-probabilities at N rows, on the device."""

    token_logprobs: torch.Tensor  # float32 (N,): of each row's given token
    top_ids: torch.Tensor         # int64 (N, K): the K most likely tokens, most likely first
    top_logprobs: torch.Tensor    # float32 (N, K)

    @staticmethod
    def cat(parts: Sequence["LogprobTensors"]) -> "LogprobTensors":
        if len(parts) == 1:
            return parts[0]
        return LogprobTensors(torch.cat([p.token_logprobs for p in parts]),
                              torch.cat([p.top_ids for p in parts]),
                              torch.cat([p.top_logprobs for p in parts]))

    def packed(self) -> torch.Tensor:
        """int64 (N * (1 + 2K),): the three flattened, floats as float64 bit patterns."""
        return torch.cat([self.token_logprobs.double().view(torch.int64),
                          self.top_ids.reshape(-1),
                          self.top_logprobs.double().view(torch.int64).reshape(-1)])


def compute_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> LogprobTensors:
    """Log-softmax of ``logits`` (N, V) in float32; each row's ``targets`` (N,) entry and top ``k``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)                     # (N, V)
    token = logprobs.gather(1, targets[:, None])[:, 0]
    if k == 0:  # no topk launch for an empty result
        n = targets.shape[0]
        return LogprobTensors(token, targets.new_empty(n, 0), logprobs.new_empty(n, 0))
    top = logprobs.topk(min(k, logprobs.shape[1]), dim=-1, sorted=True)
    return LogprobTensors(token, top.indices, top.values)


def sliced_logprobs(logits_of: Callable[[slice], torch.Tensor], targets: torch.Tensor, k: int,
                    rows_per_slice: int | None = None) -> LogprobTensors:
    """``compute_logprobs`` over N = len(targets) rows, ``rows_per_slice`` at a time.

    Args:
        logits_of: rows ``s`` (a slice of 0..N) -> their logits (len, V), made on demand
            (e.g. the LM head over those hidden rows only).
        targets: int64 (N,), the token whose log-probability each row reports.
        k: top-K columns.
        rows_per_slice: None: ``SLICE_ROWS`` (read at call time).
    """
    n = targets.shape[0]
    rows_per_slice = rows_per_slice or SLICE_ROWS
    parts = [compute_logprobs(logits_of(slice(a, min(a + rows_per_slice, n))),
                              targets[a:a + rows_per_slice], k)
             for a in range(0, n, rows_per_slice)]
    return LogprobTensors.cat(parts)


@dataclass(frozen=True)
class LogprobLayout:
    """Which sequence owns which rows of a packed ``LogprobTensors``, on the host.

    Sequence i owns the next ``num_rows[i]`` rows and keeps the first ``ks[i]``
    of the block's ``max_k`` columns.
    """

    seq_ids: tuple[int, ...]
    num_rows: tuple[int, ...]
    ks: tuple[int, ...]

    @property
    def max_k(self) -> int:
        return max(self.ks, default=0)

    @property
    def total_rows(self) -> int:
        return sum(self.num_rows)

    @property
    def size(self) -> int:
        """Length of the packed int64 vector."""
        return self.total_rows * (1 + 2 * self.max_k)

    def unpack(self, flat: np.ndarray) -> dict[int, TokenLogprobs]:
        """``flat`` int64 (size,) -> seq id -> its ``TokenLogprobs`` (fresh arrays: ``flat``
        may be a pinned buffer that a later step rewrites)."""
        n, k = self.total_rows, self.max_k
        token = flat[:n].view(np.float64).astype(np.float32)
        ids = flat[n:n + n * k].reshape(n, k)
        top = flat[n + n * k:n + 2 * n * k].view(np.float64).astype(np.float32).reshape(n, k)
        out: dict[int, TokenLogprobs] = {}
        start = 0
        for seq_id, rows, seq_k in zip(self.seq_ids, self.num_rows, self.ks):
            end = start + rows
            out[seq_id] = TokenLogprobs(token_logprobs=token[start:end].copy(),
                                        top_ids=ids[start:end, :seq_k].copy(),
                                        top_logprobs=top[start:end, :seq_k].copy())
            start = end
        return out
