"""Plan -> flat index arrays, in vectorised numpy, shared by every executor.

For B sequences feeding T tokens in total::

    query_lens       [3, 1, 2]
    cu_seqlens_q     [0, 3, 4, 6]          prefix sums of query_lens
    start_positions  [5, 9, 0]             tokens already cached per sequence
    kv_lens          [8, 10, 2]            start + query: keys each sequence attends to
    cu_seqlens_k     [0, 8, 18, 20]
    positions        [5 6 7 | 9 | 0 1]     start + offset inside the chunk
    slot_mapping     block_table[pos // bs] * bs + pos % bs   (-1 = write nothing)
    block_tables     (B, max_blocks) int32, rows padded with -1

No Python loop runs per token: one loop per sequence fills the padded block table
and everything else is whole-array arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from minivllm.engine.plan import StepPlan


@dataclass(frozen=True)
class BatchInputs:
    """Host-side index arrays for one step (see the module docstring)."""

    input_ids: np.ndarray       # int64 (T,)
    positions: np.ndarray       # int64 (T,)
    slot_mapping: np.ndarray    # int64 (T,)
    cu_seqlens_q: np.ndarray    # int32 (B+1,)
    cu_seqlens_k: np.ndarray    # int32 (B+1,)
    kv_lens: np.ndarray         # int32 (B,)
    block_tables: np.ndarray    # int32 (B, max_blocks), -1 padded
    sample_indices: np.ndarray  # int64 (S,): token row of each sampling sequence's last token
    max_q_len: int
    max_kv_len: int


def padded_block_table(block_tables: tuple[tuple[int, ...], ...], width: int | None = None) -> np.ndarray:
    """Stack ragged block tables into an int32 (B, width) array padded with -1."""
    lens = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=len(block_tables))
    width = int(lens.max(initial=0)) if width is None else width
    if lens.size and lens.max() > width:
        raise ValueError(f"a block table has {int(lens.max())} blocks, more than width {width}")
    out = np.full((len(block_tables), width), -1, dtype=np.int32)
    mask = np.arange(width)[None, :] < lens[:, None]
    # chain.from_iterable flattens in C: no Python frame per block id.
    out[mask] = np.fromiter(chain.from_iterable(block_tables), dtype=np.int32, count=int(lens.sum()))
    return out


def prepare_inputs(plan: StepPlan) -> BatchInputs:
    """Compute positions, slots, cu_seqlens and the padded block table of a plan."""
    q = plan.query_lens.astype(np.int64)
    start = plan.start_positions.astype(np.int64)
    bs = plan.block_size
    cu_q = np.zeros(len(q) + 1, dtype=np.int64)
    np.cumsum(q, out=cu_q[1:])
    kv_lens = start + q
    cu_k = np.zeros(len(q) + 1, dtype=np.int64)
    np.cumsum(kv_lens, out=cu_k[1:])
    total = int(cu_q[-1])
    row = np.repeat(np.arange(len(q)), q)                           # (T,) sequence of each token
    positions = np.arange(total, dtype=np.int64) - cu_q[row] + start[row]
    table = padded_block_table(plan.block_tables)
    block_idx = positions // bs
    if table.shape[1] and np.any(block_idx >= (table[row] >= 0).sum(axis=1)):
        raise ValueError("a block table does not cover the tokens scheduled for its sequence")
    slots = table[row, block_idx].astype(np.int64) * bs + positions % bs
    return BatchInputs(
        input_ids=np.asarray(plan.token_ids, dtype=np.int64),
        positions=positions,
        slot_mapping=slots,
        cu_seqlens_q=cu_q.astype(np.int32),
        cu_seqlens_k=cu_k.astype(np.int32),
        kv_lens=kv_lens.astype(np.int32),
        block_tables=table,
        sample_indices=(cu_q[1:] - 1)[plan.sample],
        max_q_len=int(q.max(initial=0)),
        max_kv_len=int(kv_lens.max(initial=0)),
    )
