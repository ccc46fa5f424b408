"""Device functions shared by the kernels that read FP8 weights with their scales
(``kernels/fp8_gemv.py``, ``kernels/fused_moe.py``, ``kernels/moe_gemv.py``); this file
launches nothing. The scales are ``kernels/fp8.py``'s: a 128x128 block's (GROUP = 128) or an
output channel's."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scaled_tile(w, ws_rows, k0, col_ok, K, BLOCK_SCALES: tl.constexpr, GROUP: tl.constexpr):
    """The fp8 tile ``w`` (BLOCK_N, BLOCK_K) starting at column ``k0`` in fp32, times its
    block scales (BLOCK_SCALES: the rows' scales at ``ws_rows``, cdiv(K, GROUP) a row); else
    as it is (a channel scale comes after the sum). A tile is one scale group or part of one
    (one scale a row: a (BLOCK_N,) load), or whole groups (a (BLOCK_N, groups) load, the
    tile seen as (BLOCK_N, groups, GROUP)); a power-of-two step is always one or the other.
    (A scale loaded for every element made the GEMV 20-30 times slower on an H200.)"""
    w32 = w.to(tl.float32)
    if BLOCK_SCALES:
        if w.shape[1] <= GROUP:
            w32 = w32 * tl.load(ws_rows + k0 // GROUP, mask=col_ok, other=0.0)[:, None]
        else:
            groups: tl.constexpr = w.shape[1] // GROUP
            g = k0 // GROUP + tl.arange(0, groups)
            s = tl.load(ws_rows[:, None] + g[None, :], mask=col_ok[:, None] & (g < tl.cdiv(K, GROUP))[None, :],
                        other=0.0)
            w32 = tl.reshape(tl.reshape(w32, (w.shape[0], groups, GROUP)) * s[:, :, None], w.shape)
    return w32


@triton.jit
def expert_scale_ptrs(ws_ptr, expert, rows, cols, K, BLOCK_SCALES: tl.constexpr, GROUP: tl.constexpr):
    """Pointers to the scales of rows ``cols`` of ``expert``'s (rows, K) weight: BLOCK_SCALES,
    each row's first 128x128 block scale (the block of column k is k // GROUP further); else
    its channel scale."""
    expert = expert.to(tl.int64)
    if BLOCK_SCALES:
        k_blocks = tl.cdiv(K, GROUP)
        ptrs = ws_ptr + expert * tl.cdiv(rows, GROUP) * k_blocks + (cols // GROUP) * k_blocks
    else:
        ptrs = ws_ptr + expert * rows + cols
    return ptrs
