"""Online softmax shared by the attention kernels (Triton device functions, inlined).

A kernel walks a row's keys tile by tile and keeps, per query row, the running
maximum ``m`` of its (base-2) scores, the running sum ``l`` of ``2**(s - m)`` and
the unnormalised output ``acc = sum 2**(s - m) v``. When a tile raises the
maximum, the old sum and output are rescaled by ``alpha = 2**(m_old - m_new)``::

    m_new = max(m, max_j s_j)
    l     = l * alpha + sum_j 2**(s_j - m_new)
    acc   = acc * alpha + P @ V          P = 2**(s - m_new), rounded to V's dtype

The output is ``acc / l`` at the end. Scores are in base 2 (the caller folds
log2(e) into the softmax scale) because exp2 is one hardware instruction.

:func:`fold_box_tiles` is the walk both kernels share where whole tiles come as
tensor-memory boxes of the paged cache, one block id each.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(
    s,                             # (M, N) fp32 raw scores q.k; masked keys are -inf
    v,                             # (N, D) values in the cache dtype
    m_i,                           # (M,) fp32 running max of the base-2 scores
    l_i,                           # (M,) fp32 running sum of 2**(scaled s - m_i)
    acc,                           # (M, D) fp32 unnormalised output
    scale_log2,                    # softmax scale * log2(e) (> 0)
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,      # CPU interpreter + bf16: see _launch.upcast_dot
):
    """Fold one tile of scores and values into the running state; returns (m_i, l_i, acc).

    The scale is applied here, inside one FMA per score (``s * scale - m``), not as a
    separate pass over the tile; max(s) * scale == max(s * scale) since scale > 0.
    Invariant the caller keeps: after this step every row's ``m`` is finite, i.e. a
    row sees at least one key in its first tile (otherwise alpha = 2**(-inf + inf)
    would be NaN). Later tiles may mask a row completely: its p is 0 and alpha 1.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * scale_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # P @ V runs in the cache dtype (tensor cores); the sum l_i above stays fp32.
    p = p.to(v.dtype)
    if UPCAST_DOT:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def normalize_rows(acc, l_i):
    """``acc / l`` per row, (M, D); a row that saw no key (l == 0, acc == 0) gives zeros."""
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


@triton.jit
def fold_kv_tile(q, k, v, pos, q_pos, m_i, l_i, acc, scale_log2,
                 MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
                 KV_FP8: tl.constexpr, DTYPE: tl.constexpr):
    """One K/V tile (keys at ``pos``) into the online softmax (:func:`online_softmax_step`);
    MASKED: each row sees only keys at or before its position ``q_pos`` (a decode row: the
    last context position); KV_FP8: the tile's e4m3 values first become DTYPE (the
    model's; the scales are applied by the caller). Returns (m_i, l_i, acc)."""
    if KV_FP8:
        k = k.to(DTYPE)
        v = v.to(DTYPE)
    if UPCAST_DOT:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)          # (M, BLOCK_N), unscaled
    if MASKED:
        # A real row's q_pos < end, so this also hides the keys past `end` (loaded as 0).
        s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
    return online_softmax_step(s, v, m_i, l_i, acc, scale_log2, DOT_PRECISION, UPCAST_DOT)


@triton.jit
def fold_box_tiles(q, q_pos, m_i, l_i, acc, k_desc, v_desc, desc_col, table_row, start, end, scale_log2,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   UPCAST_DOT: tl.constexpr, KV_FP8: tl.constexpr, DTYPE: tl.constexpr):
    """Fold the keys [start, end), whole tiles that every row sees (no mask), into the online
    softmax: each tile one (BLOCK_N, D) box of a cache seen as (N * block_size) rows of
    Hkv * D (``desc_col``: this KV head's column), from one block id (a tile lies inside one
    block: BLOCK_SIZE % BLOCK_N == 0). The ids are looked up one tile ahead, so the copies
    need not wait on them. Returns (m_i, l_i, acc)."""
    offs_n = tl.arange(0, BLOCK_N)
    block = tl.load(table_row + start // BLOCK_SIZE, mask=start < end, other=0)
    for n0 in range(start, end, BLOCK_N):
        row = block * BLOCK_SIZE + n0 % BLOCK_SIZE
        k = k_desc.load([row, desc_col])
        v = v_desc.load([row, desc_col])
        block = tl.load(table_row + (n0 + BLOCK_N) // BLOCK_SIZE, mask=n0 + BLOCK_N < end, other=0)
        m_i, l_i, acc = fold_kv_tile(q, k, v, n0 + offs_n, q_pos, m_i, l_i, acc, scale_log2, False,
                                     DOT_PRECISION, UPCAST_DOT, KV_FP8, DTYPE)
    return m_i, l_i, acc
