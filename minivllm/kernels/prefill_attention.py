"""Paged causal attention for prefill, chunked prefill and prefix-cache hits.

Sequence b feeds q_len = cu_q[b+1] - cu_q[b] new tokens at positions
kv_len - q_len .. kv_len - 1; the keys/values of *all* kv_len positions (the cached
prefix, earlier chunks and the new tokens, already stored) are read from the paged
cache through the block table, so prefix hits and chunks see the right context::

    positions  0 ........... kv_len-q_len-1 | kv_len-q_len ... kv_len-1
               cached prefix (no new query)  | new tokens (queries, causal)

Grid ``(ceil(max_q_len / BLOCK_Q), B, Hkv)``. GQA is folded into the tile rows:
a program takes BLOCK_Q query tokens times the G = H / Hkv heads of one KV head,
as BLOCK_M = pow2(BLOCK_Q * G) rows (row r = token r // G, head r % G), so each K/V
tile is loaded once for the whole group. Online softmax, fp32 accumulation.
Tiles past a sequence's q_len do no work; the grid comes from the host int
``max_q_len`` so nothing syncs with the device.

Torch reference: :func:`minivllm.kernels.reference.paged_attention_reference`.
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import (
    check_dtype, check_last_dim_contiguous, check_power_of_two, check_same_device, upcast_dot,
)

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr,                                # (T, H, D)
    k_cache_ptr, v_cache_ptr,             # (N, bs, Hkv, D), same strides
    out_ptr,                              # (T, H, D)
    cu_seqlens_q_ptr,                     # (B+1,) int32
    kv_lens_ptr,                          # (B,) int32
    block_tables_ptr,                     # (B, W) int32, -1 padded
    scale_log2,                           # softmax scale * log2(e): scores live in base 2
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cn, stride_cb, stride_ch,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,             # CPU interpreter + bf16: see _launch.upcast_dot
):
    q_tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    token = q_tile * BLOCK_Q + offs_m // GROUP                         # (BLOCK_M,) index in the chunk
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (token < q_len)
    q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)                       # (BLOCK_M, D)
    q_pos = kv_len - q_len + token                                     # (BLOCK_M,) absolute position

    # Keys up to the tile's last query position; none for tiles past q_len.
    kv_end = tl.minimum(kv_len, kv_len - q_len + (q_tile + 1) * BLOCK_Q)
    kv_end = tl.where(q_tile * BLOCK_Q < q_len, kv_end, 0)

    if UPCAST_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)               # running max (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)                             # running sum of exp
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table_row = block_tables_ptr + seq * stride_bt
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + offs_n                                              # (BLOCK_N,)
        valid = pos < kv_end
        # Masked lookups never touch the table's -1 padding; int64: the pool can exceed 2**31 elements.
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        kv_off = block * stride_cn + (pos % BLOCK_SIZE) * stride_cb + kv_head * stride_ch
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # (BLOCK_M, BLOCK_N)
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        # Key 0 is in the first tile and visible to every row (q_pos >= 0 since
        # kv_len >= q_len), so m_new is finite from the first tile on: no -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        p = p.to(v.dtype)  # P @ V runs in the cache dtype (tensor cores); the sum stays fp32
        if UPCAST_DOT:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    # kv_len 0 leaves l_i == 0: those rows get zeros, as in the reference.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _tile_config(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps): q/K/V tiles stay within shared memory."""
    elem = 4 if dtype == torch.float32 else 2
    if head_dim * elem <= 256:       # bf16/fp16 D <= 128, fp32 D <= 64
        return 64, 64, 4
    return 32, 32, 4


def prefill_attention(
    q: torch.Tensor,             # (T, H, D) new tokens' queries, sequences concatenated
    k_cache: torch.Tensor,       # (N, bs, Hkv, D), already holding the new tokens' K/V
    v_cache: torch.Tensor,       # (N, bs, Hkv, D)
    cu_seqlens_q: torch.Tensor,  # (B+1,) int32
    kv_lens: torch.Tensor,       # (B,) int32: cached prefix + new tokens
    block_tables: torch.Tensor,  # (B, W) int32, -1 padded
    scale: float,
    max_q_len: int,              # host int >= every q_len (sizes the grid; no device sync)
) -> torch.Tensor:               # (T, H, D), q's dtype
    """Causal attention of each sequence's new tokens over its whole paged context.

    Rows of sequences with kv_len 0, and rows past ``cu_seqlens_q[-1]``, are zeros.
    The caller guarantees q_len <= kv_len and q_len <= max_q_len per sequence
    (checking would need a device->host sync).

    Raises:
        TypeError: unsupported dtypes (q and caches share one of bf16/fp16/fp32;
            cu_seqlens_q, kv_lens and block_tables are int32).
        ValueError: mismatched shapes, strided last dimensions, H not a multiple of
            Hkv, head_dim or block_size not a power of two, negative max_q_len, or
            tensors on different devices.
    """
    _check_prefill_args(q, k_cache, v_cache, cu_seqlens_q, kv_lens, block_tables, max_q_len)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    batch = kv_lens.shape[0]
    # zeros, not empty: rows that belong to no sequence must not hold garbage.
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or batch == 0 or max_q_len == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps = _tile_config(q.dtype, head_dim)
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    _prefill_kernel[(triton.cdiv(int(max_q_len), block_q), batch, num_kv_heads)](
        q, k_cache, v_cache, out, cu_seqlens_q, kv_lens, block_tables,
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=upcast_dot(q),
        num_warps=num_warps, num_stages=2,
    )
    return out


def _check_prefill_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor, block_tables: torch.Tensor, max_q_len: int,
) -> None:
    """Validate the arguments of :func:`prefill_attention` (raises TypeError / ValueError)."""
    check_dtype("q", q, _FLOAT_DTYPES)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(name, t, (q.dtype,))
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("kv_lens", kv_lens), ("block_tables", block_tables)):
        check_dtype(name, t, (torch.int32,))
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cu_seqlens_q", cu_seqlens_q),
                    ("kv_lens", kv_lens), ("block_tables", block_tables)):
        check_last_dim_contiguous(name, t)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu_seqlens_q,
                      kv_lens=kv_lens, block_tables=block_tables)
    if q.dim() != 3:
        raise ValueError(f"q must be (T, H, D), got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must be (N, block_size, Hkv, D) with equal shapes and strides")
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"q (H={num_heads}, D={head_dim}) does not fit the cache "
                         f"(Hkv={num_kv_heads}, D={cache_dim}): need equal D and H % Hkv == 0")
    check_power_of_two("head_dim", head_dim, minimum=16)
    check_power_of_two("block_size", block_size)
    batch = kv_lens.shape[0] if kv_lens.dim() == 1 else -1
    if (batch < 0 or cu_seqlens_q.shape != (batch + 1,) or block_tables.dim() != 2
            or block_tables.shape[0] != batch):
        raise ValueError(f"need kv_lens (B,), cu_seqlens_q (B+1,), block_tables (B, W); got "
                         f"{tuple(kv_lens.shape)}, {tuple(cu_seqlens_q.shape)}, {tuple(block_tables.shape)}")
    if isinstance(max_q_len, bool) or not isinstance(max_q_len, numbers.Integral) or max_q_len < 0:
        raise ValueError(f"max_q_len must be a host int >= 0, got {max_q_len!r}")
