"""The torch sampler: greedy, temperature, top-k, top-p and min-p, per row, in one batch.

Per-row settings travel as tensors (``SamplingTensors``), so one batch mixes
greedy and random rows with different filters and the device never waits on
the host per sequence; the only sync is reading the sampled ids at the end.

Random rows use the Gumbel-max trick: ``argmax(logits / T + g)`` with
``g = -log(-log(U))`` draws from ``softmax(logits / T)``; a filtered-out token
has logit ``-inf`` and, because ``U`` is strictly inside (0, 1) so ``g`` is
finite, can never win. (It is the exponential race ``argmax(p / E)`` in log space.)

Seeded rows draw ``U`` from a counter-based hash of (seed, position of the token
being sampled, vocab index) instead of a generator's stream, so a request's
tokens depend only on its own seed and positions, not on the batch it shares,
the order of rows or the steps it was chunked into. Unseeded rows use the
executor's ``torch.Generator``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import nn

from minivllm.sampling import SamplingParams

_MASK32 = 0xFFFFFFFF
_UNIFORM_BITS = 23  # U = (k + 0.5) / 2**23 is exact in float32 and strictly in (0, 1)
# As in vLLM, a temperature this small is treated as greedy: dividing by it
# could overflow float32 logits to inf (and inf - inf is nan).
GREEDY_TEMPERATURE = 1e-5


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding [0, 2**32).

    Multipliers are odd and < 2**31, so products stay below 2**63: no int64
    overflow on any device.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def _splitmix64(x: int) -> int:
    """Host-side 64-bit mix of a Python int (splitmix64 finaliser)."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def row_key(seed: int, position: int) -> tuple[int, int]:
    """Two 32-bit keys for the token sampled at ``position`` by a request seeded ``seed``."""
    k = _splitmix64(_splitmix64(seed & 0xFFFFFFFFFFFFFFFF) ^ position)
    return k & _MASK32, k >> 32


def hashed_uniform(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counter-based uniforms: (R, 2) int64 keys -> (R, vocab_size) float32 strictly in (0, 1)."""
    v = _mix32(torch.arange(vocab_size, device=keys.device, dtype=torch.int64))  # (V,)
    x = _mix32(v[None, :] ^ keys[:, :1])                                          # (R, V)
    x = _mix32(x ^ keys[:, 1:])
    return ((x >> (32 - _UNIFORM_BITS)).float() + 0.5) / float(1 << _UNIFORM_BITS)


def _generator_uniform(rows: int, vocab_size: int, device: torch.device,
                       generator: torch.Generator | None) -> torch.Tensor:
    bits = torch.randint(0, 1 << _UNIFORM_BITS, (rows, vocab_size), device=device, generator=generator)
    return (bits.float() + 0.5) / float(1 << _UNIFORM_BITS)


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling settings of S sampling rows, on the logits' device.

    The ``any_*`` / ``all_greedy`` flags are host bools, known from the params
    without touching the device, so unused filters cost nothing.
    """

    temperature: torch.Tensor   # float32 (S,): 1 on greedy rows (their result is argmax anyway)
    top_k: torch.Tensor         # int64 (S,): vocab size where disabled
    top_p: torch.Tensor         # float32 (S,): +inf where disabled (top_p == 1)
    log_min_p: torch.Tensor     # float32 (S,): log(min_p), -inf where disabled
    greedy: torch.Tensor        # bool (S,)
    seeded_rows: torch.Tensor   # int64 (R,): rows with a per-request seed
    seed_keys: torch.Tensor     # int64 (R, 2): ``row_key`` of each seeded row
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @staticmethod
    def build(params: Sequence[SamplingParams], positions: Sequence[int] | np.ndarray,
              vocab_size: int, device: torch.device | str) -> "SamplingTensors":
        """Gather per-row settings on the host and move them to ``device`` once.

        Args:
            params: sampling params of each sampling row.
            positions: per row, the position the sampled token will take (the
                counter of seeded rows: the sequence's length before it).
            vocab_size: V; a disabled or larger top_k becomes V.
            device: where the logits live.

        Raises:
            ValueError: ``params`` and ``positions`` differ in length.
        """
        if len(params) != len(positions):
            raise ValueError(f"{len(params)} sampling params for {len(positions)} positions")
        greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p if p.top_p < 1 else math.inf for p in params]
        log_min_p = [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params]
        seeded = [i for i, p in enumerate(params) if p.seed is not None and not greedy[i]]
        keys = [row_key(params[i].seed, int(positions[i])) for i in seeded]  # type: ignore[arg-type]

        def dev(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return SamplingTensors(
            temperature=dev([1.0 if g else float(p.temperature) for g, p in zip(greedy, params)], torch.float32),
            top_k=dev(top_k, torch.int64),
            top_p=dev(top_p, torch.float32),
            log_min_p=dev(log_min_p, torch.float32),
            greedy=dev(greedy, torch.bool),
            seeded_rows=dev(seeded, torch.int64),
            seed_keys=dev(keys, torch.int64).reshape(len(seeded), 2),
            all_greedy=all(greedy),
            any_top_k=any(k < vocab_size for k, g in zip(top_k, greedy) if not g),
            any_top_p=any(p < 1 for p, g in zip(top_p, greedy) if not g),
            any_min_p=any(m > -math.inf for m, g in zip(log_min_p, greedy) if not g),
        )


def apply_filters(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Set every token outside a row's top-k, top-p or min-p set to ``-inf``.

    Top-k first; top-p over the distribution renormalised to the top-k set
    (as vLLM does); min-p keeps tokens with ``p >= min_p * p_max``, i.e.
    ``logit >= max_logit + log(min_p)``, which renormalisation does not change.

    Args:
        logits: (S, V) float32, already divided by the temperature.
        t: the rows' settings.

    Returns:
        (S, V) the filtered logits (a new tensor when any filter applies).
    """
    if t.any_top_k or t.any_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (S, V) each
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        keep = ranks[None, :] < t.top_k[:, None]
        if t.any_top_p:
            probs = sorted_logits.masked_fill(~keep, -math.inf).softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            # The most likely token always stays: its mass_before is 0 < top_p.
            keep &= mass_before < t.top_p[:, None]
        keep = torch.zeros_like(keep).scatter_(1, order, keep)  # back to vocab order
        logits = logits.masked_fill(~keep, -math.inf)
    if t.any_min_p:
        floor = logits.max(dim=-1, keepdim=True).values + t.log_min_p[:, None]
        logits = logits.masked_fill(logits < floor, -math.inf)
    return logits


class Sampler(nn.Module):
    """Samples one token per row of logits.

    Args:
        generator: the stream of unseeded random rows (the executor's).
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.generator = generator

    def forward(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """Sample from ``logits`` (S, V) -> token ids (S,) int64; greedy rows get exactly argmax."""
        logits = logits.float()
        greedy_ids = logits.argmax(dim=-1)
        if t.all_greedy:
            return greedy_ids
        scaled = apply_filters(logits / t.temperature[:, None], t)
        u = _generator_uniform(logits.shape[0], logits.shape[1], logits.device, self.generator)
        if t.seeded_rows.numel():
            u[t.seeded_rows] = hashed_uniform(t.seed_keys, logits.shape[1])
        gumbel = -torch.log(-torch.log(u))
        sampled = (scaled + gumbel).argmax(dim=-1)
        return torch.where(t.greedy, greedy_ids, sampled)
