"""Masked tile loads shared by the tensor-core GEMMs (``kernels/fp8_gemm.py``,
``kernels/fused_moe.py``); this file launches nothing. Each takes a program's row pointers
and the K columns of one step, and loads 0 where a row or a column is past the end."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def x_tile(x_rows, k, row_ok, K):
    """x at these rows (pointers ``x_rows``, (BLOCK_M, 1)) and columns ``k``, as stored,
    0 where masked off."""
    return tl.load(x_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def wt_tile(w_cols, k, col_ok, K):
    """The (BLOCK_K, BLOCK_N) tile of W^T at rows ``k`` (``w_cols``: W's rows as (1, BLOCK_N)
    pointers), 0 where masked off."""
    return tl.load(w_cols + k[:, None], mask=(k < K)[:, None] & col_ok[None, :], other=0.0)
