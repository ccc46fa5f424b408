"""What the attention ops read each step, built by the executor and passed to every forward
as an explicit argument (no forward context)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one step, on the model's device.

    B sequences feed T tokens (shapes as in ``minivllm/executor/inputs.py``).
    """

    # int64 (T,): cache slot of each fed token (-1 = write nothing).
    slot_mapping: torch.Tensor
    # int32 (B+1,): prefix sums of the tokens fed per sequence.
    cu_seqlens_q: torch.Tensor
    # int32 (B,): keys each sequence attends to (cached + fed).
    kv_lens: torch.Tensor
    # int32 (B, W): block ids per sequence, -1 padded.
    block_tables: torch.Tensor
    # Most tokens fed by one sequence (a host int: kernels size their grid by it).
    max_q_len: int
    # Every sequence feeds exactly one token (T == B): the decode kernel applies.
    is_decode: bool
    # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim): all layers' K/V.
    kv_cache: torch.Tensor
    # int32 (capacity, 2): the prefill kernel's work list (its map mode: a grid that does not
    # depend on the batch, for CUDA graphs of prefill steps); None: the grid from max_q_len.
    tile_map: torch.Tensor | None = None
