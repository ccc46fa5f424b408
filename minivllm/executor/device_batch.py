"""``DeviceBatch``: one step's inputs on the device, as the model and the graph runner take them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.ops.metadata import AttentionMetadata


@dataclass(frozen=True)
class DeviceBatch:
    """One step's model inputs on the device (shapes as in ``BatchInputs``).

    ``input_ids`` holds -1 where a token is fed by reference; ``prev_rows`` says
    which row of the executor's buffer of last-step samples fills it in
    (``resolve_input_ids``), on the device, so no sampled id goes through the host
    on the way back in.
    """

    input_ids: torch.Tensor       # int64 (T,), -1 where fed by reference
    prev_rows: torch.Tensor       # int64 (T,): row of the previous step's samples, -1 = given
    positions: torch.Tensor       # int64 (T,)
    sample_indices: torch.Tensor  # int64 (S,)
    attn_metadata: AttentionMetadata
    num_seqs: int                 # B (host int)
    table_width: int              # W, the block tables' width (host int)


def resolve_input_ids(input_ids: torch.Tensor, prev_rows: torch.Tensor,
                      prev_sampled: torch.Tensor) -> torch.Tensor:
    """``input_ids`` (T,) with each referenced token taken from ``prev_sampled[prev_rows]``."""
    return torch.where(prev_rows >= 0, prev_sampled[prev_rows.clamp(min=0)], input_ids)


def referenced_tokens(batch: DeviceBatch, prev_sampled: torch.Tensor) -> torch.Tensor:
    """int64 (S,): per sampling row, the id its last token was fed by reference, -1 where given.

    Read before ``prev_sampled`` is overwritten by this step's samples (stream order).
    """
    rows = batch.prev_rows[batch.sample_indices]  # (S,): the sampling rows' last tokens
    return torch.where(rows >= 0, prev_sampled[rows.clamp(min=0)], -1)
