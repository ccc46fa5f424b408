"""Presence, frequency and repetition penalties (vLLM's semantics), batched, no host sync.

For a row with history ``prompt + completion`` (the completion counted with the
token fed by reference this step, which the plan's history cannot hold yet)::

    logit[t] = logit[t] / r   if t in prompt or completion and logit[t] > 0
    logit[t] = logit[t] * r   if t in prompt or completion and logit[t] <= 0
    logit[t] -= frequency * count_in_completion(t) + presence * (count_in_completion(t) > 0)

applied to the raw logits before temperature and the filters, to greedy rows too.

Only the R rows that have penalties are touched. Their token counts are built on
the device in one ``index_add_`` of the histories, flattened on the host into
indices of a (2, R, V) table: ``[0]`` counts the prompt, ``[1]`` the completion::

    row 0  prompt [5 5 9] completion [7]    token_index  (0*R+0)*V+5, (0*R+0)*V+5, (0*R+0)*V+9, (1*R+0)*V+7
    row 1  prompt [2]     completion [2 3]               (0*R+1)*V+2, (1*R+1)*V+2, (1*R+1)*V+3

The host side (``PenaltyInputs``, numpy) and the device side (``PenaltyTensors``)
are separate so that the executor can send the arrays up with its other inputs
in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Sequence

import numpy as np
import torch

from minivllm.sampling import SamplingParams
from minivllm.step_types import TokenHistory

__all__ = ["PenaltyInputs", "PenaltyTensors", "apply_penalties"]

_PENALTIES = attrgetter("presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass(frozen=True)
class PenaltyInputs:
    """The penalties of R rows of the logits, on the host.

    Attributes:
        rows: int64 (R,), the rows of the (S, V) logits that have penalties.
        token_index: int64 (N,), every known token of those rows as an index of the
            flattened (2, R, V) count table (see the module docstring).
        values: float32 (3, R), presence | frequency | repetition penalty per row.
        any_repetition: some row has a repetition penalty other than 1.
        any_additive: some row has a presence or frequency penalty other than 0.
    """

    rows: np.ndarray
    token_index: np.ndarray
    values: np.ndarray
    any_repetition: bool
    any_additive: bool

    @staticmethod
    def gather(rows: Sequence[int] | np.ndarray, histories: Sequence[TokenHistory],
               params: Sequence[SamplingParams], vocab_size: int) -> "PenaltyInputs":
        """Flatten the R histories into count-table indices (one concatenation, no per-token loop).

        Args:
            rows: per penalised row, its row of the logits.
            histories: per penalised row, its known tokens (prompt, then completion).
            params: per penalised row, its sampling params.
            vocab_size: V.

        Raises:
            ValueError: lengths differ, or a history holds a token outside [0, V).
        """
        r = len(rows)
        if len(histories) != r or len(params) != r:
            raise ValueError(f"{r} penalised rows, {len(histories)} histories, {len(params)} params")
        lens = np.fromiter((h.token_ids.shape[0] for h in histories), dtype=np.int64, count=r)
        n = int(lens.sum())
        tokens = np.concatenate([h.token_ids for h in histories] or [np.zeros(0)])
        tokens = tokens.astype(np.int64, copy=False)                            # (N,)
        if n and (tokens.min() < 0 or tokens.max() >= vocab_size):
            raise ValueError(f"a penalty history holds a token outside [0, {vocab_size})")
        num_prompt = np.fromiter((h.num_prompt_tokens for h in histories), dtype=np.int64, count=r)
        starts = np.cumsum(lens) - lens
        row = np.repeat(np.arange(r, dtype=np.int64), lens)                      # (N,)
        completion = np.arange(n, dtype=np.int64) >= np.repeat(starts + num_prompt, lens)
        values = np.array([_PENALTIES(p) for p in params], dtype=np.float32).reshape(r, 3).T
        return PenaltyInputs(
            rows=np.asarray(rows, dtype=np.int64),
            token_index=(completion * r + row) * vocab_size + tokens,
            values=np.ascontiguousarray(values),
            any_repetition=bool((values[2] != 1).any()),
            any_additive=bool((values[:2] != 0).any()),
        )

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """int64 arrays to upload: rows (R,), token_index (N,), values as float64 bit patterns (3, R)."""
        return self.rows, self.token_index, self.values.astype(np.float64).view(np.int64)

    def on_device(self, uploaded: Sequence[torch.Tensor],
                  referenced: torch.Tensor | None = None) -> "PenaltyTensors":
        """The device side, from ``arrays()`` as uploaded (same order and shapes, int64).

        Args:
            uploaded: the three arrays of ``arrays()`` on the device.
            referenced: int64 (S,) over all rows of the logits: the token each row
                was fed by reference this step (a completion token, absent from its
                history), -1 where none.
        """
        rows, token_index, bits = uploaded
        presence, frequency, repetition = bits.view(torch.float64).float().unbind(0)
        return PenaltyTensors(
            rows=rows, token_index=token_index, presence=presence, frequency=frequency,
            repetition=repetition, referenced=None if referenced is None else referenced[rows],
            any_repetition=self.any_repetition, any_additive=self.any_additive)


@dataclass(frozen=True)
class PenaltyTensors:
    """The penalties of R rows on the logits' device (see ``PenaltyInputs``)."""

    rows: torch.Tensor                # int64 (R,)
    token_index: torch.Tensor         # int64 (N,)
    presence: torch.Tensor            # float32 (R,)
    frequency: torch.Tensor           # float32 (R,)
    repetition: torch.Tensor          # float32 (R,)
    referenced: torch.Tensor | None   # int64 (R,): completion token fed by reference, -1 = none
    any_repetition: bool
    any_additive: bool


def _token_counts(p: PenaltyTensors, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt counts, completion counts), float32 (R, V) each, built on the device."""
    r = p.rows.shape[0]
    counts = torch.zeros(2 * r * vocab_size, dtype=torch.float32, device=p.rows.device)
    counts.index_add_(0, p.token_index, torch.ones_like(p.token_index, dtype=torch.float32))
    if p.referenced is not None:
        # Counted where it is a real token (>= 0); the others add 0 to a harmless slot.
        index = (r + torch.arange(r, device=p.rows.device)) * vocab_size + p.referenced.clamp(min=0)
        counts.index_add_(0, index, (p.referenced >= 0).float())
    prompt, completion = counts.view(2, r, vocab_size).unbind(0)
    return prompt, completion


def apply_penalties(logits: torch.Tensor, p: PenaltyTensors) -> torch.Tensor:
    """The penalised logits: a new float32 (S, V) tensor; ``logits`` stays raw (for logprobs).

    Float32, whatever the logits' dtype: in bf16 a penalty of 0.1 on a logit of 20
    would round away.
    """
    vocab = logits.shape[1]
    prompt, completion = _token_counts(p, vocab)
    x = logits[p.rows].float()                                   # (R, V), a copy
    if p.any_repetition:
        r = p.repetition[:, None]
        seen = prompt.add_(completion) > 0                      # in prompt or completion
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if p.any_additive:
        present = completion > 0
        x.sub_(completion.mul_(p.frequency[:, None]))
        x.sub_(p.presence[:, None] * present)
    out = logits.to(torch.float32, copy=True)
    out[p.rows] = x
    return out
