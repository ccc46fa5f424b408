"""Paged decode attention (one new query token per sequence), flash-decoding style.

Grid ``(Hkv, num_splits, B)``: one program per (KV head, context split, sequence).
A program loads its sequence's Q rows for *all* the query heads of its KV group
(GQA: the G = H / Hkv heads share every K/V load), walks its share of the context
in BLOCK_N-token tiles (a tile may span several KV blocks; each token's block is
looked up in the block table), and keeps an online softmax in fp32::

    context of sequence b (kv_len tokens), num_splits = 3, BLOCK_N = 4:
    | split 0         | split 1         | split 2      |
    | tile  | tile    | tile  | tile    | tile | tile  |   each split: ceil(tiles / 3) tiles

Why split: at batch 8 and Hkv 8 there are only 64 (sequence, head) pairs for 132
SMs; splitting the context gives every SM work. Each split writes its normalised
partial output and log-sum-exp, and :mod:`merge_attention_splits` combines them.
With one split the kernel writes the final output itself.

An FP8 cache (``kernels/fp8.py``) is read as e4m3 tiles, half the bytes, turned into q's
dtype in registers (exact) before the dots; the K scale multiplies the softmax scale and
the V scale the normalised output. ``DecodeConfig.fp16_dots`` turns them into fp16 instead
(one PTX conversion a pair of values, ``cvt.rn.f16x2.e4m3x2``) and q with them: exact for
bf16 q of magnitude 2^-14 to 65504 (fp16 holds bf16's 8 significant bits), and P is rounded
to fp16, finer than bf16. The default for an FP8 cache and 16-bit q, the faster on an H200
(``benchmarks.fp8 --parts attention --sweep``; docs/tuning.md, "FP8").

Tensor-memory boxes (``DecodeConfig.tma``, where ``_launch.tma_allowed``: a cache block
holds whole tiles): a split's whole tiles come as one (BLOCK_N, D) box each of the cache
seen as (N * block_size) rows of Hkv * D, from one block id looked up one tile ahead,
instead of a lookup, an address and a load per token; its partial last tile keeps the
masked pointer loads (slots past a sequence's last key may hold anything). The default
for an FP8 cache, whose kernel is bound by instructions more than bytes; the bf16 one is
at copy speed by pointers already (docs/tuning.md, "FP8").

CUDA-graph capturable: the split count depends on shapes only (batch, KV heads,
block-table width * block size, SM count), never on tensor values, and nothing
syncs with the host. A row with kv_len 0 (graph padding) gets zeros.

Torch reference: :func:`minivllm.kernels.reference.paged_attention_reference`
with ``cu_seqlens_q = arange(B + 1)``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minivllm.kernels.fp8 import check_fp16_dots, check_kv_scales, is_fp8_cache
from minivllm.kernels._launch import (
    LOG2E, check_attention_args, check_host_int, check_tile_config, kv_descriptors, next_pow2, upcast_dot,
)
from minivllm.kernels._softmax import fold_box_tiles, fold_kv_tile, normalize_rows
from minivllm.kernels.merge_attention_splits import merge_attention_splits

# Splits beyond this add merge traffic and barely any parallelism.
MAX_SPLITS = 64
# Split until there are this many (sequence, KV head, split) programs per SM.
# Why 3: docs/tuning.md, "Decode attention splits".
TARGET_PROGRAMS_PER_SM = 3


@dataclass(frozen=True)
class DecodeConfig:
    """Tile and launch parameters of the split kernel (a tuning knob, not semantics)."""

    block_n: int = 64     # context tokens per tile; a power of two >= 16 (tl.dot's minimum)
    num_warps: int = 4
    num_stages: int = 3   # software-pipelining depth of the K/V loads
    fp16_dots: bool = False  # an FP8 cache: widen its tiles (and q) to fp16, not q's dtype (module doc)
    tma: bool = False        # whole tiles by tensor-memory copy where allowed (module doc, tma_allowed)

    def __post_init__(self) -> None:
        check_tile_config(self, ("block_n",), flags=("fp16_dots", "tma"))


@triton.jit
def _attend_tile(q, m_i, l_i, acc, n0, end, table_row, k_cache_ptr, v_cache_ptr, kv_head,
                 stride_cn, stride_cb, stride_ch, scale_log2, offs_n, offs_d, dtype,
                 BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
                 KV_FP8: tl.constexpr, MASKED: tl.constexpr):
    """Fold the BLOCK_N context tokens from ``n0`` into the online softmax; ``MASKED``: the
    tile runs past ``end`` (its tokens there are neither looked up nor loaded)."""
    pos = n0 + offs_n                                              # (BLOCK_N,)
    # int64: the pool can exceed 2**31 elements. Masked lookups never touch the table's -1 padding.
    if MASKED:
        valid = pos < end
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    else:
        block = tl.load(table_row + pos // BLOCK_SIZE).to(tl.int64)
    kv_off = block * stride_cn + (pos % BLOCK_SIZE) * stride_cb + kv_head * stride_ch
    if MASKED:
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :])
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :])
    # Every tile holds >= 1 valid token, so m_i is finite after the first one; a row's last
    # key is end - 1 (the mask hides the tile's tokens past it, loaded as 0).
    last = tl.full([q.shape[0]], end - 1, tl.int32)
    return fold_kv_tile(q, k, v, pos, last, m_i, l_i, acc, scale_log2, MASKED, DOT_PRECISION, UPCAST_DOT,
                        KV_FP8, dtype)


@triton.jit
def _decode_split_kernel(
    q_ptr,                                # (B, H, D)
    k_cache_ptr, v_cache_ptr,             # (N, bs, Hkv, D), same strides
    k_desc, v_desc,                       # USE_TMA: (block_n, D) boxes of the caches as (N*bs, Hkv*D)
    kv_lens_ptr,                          # (B,) int32
    block_tables_ptr,                     # (B, W) int32, -1 padded
    out_ptr,                              # (B, H, D): written only when num_splits == 1
    part_out_ptr,                         # (B, H, S, D) fp32 contiguous: split-normalised output
    part_lse_ptr,                         # (B, H, S) fp32 contiguous: log2-sum-exp2 of the split's scores
    k_scale_ptr, v_scale_ptr,             # KV_FP8: (1,) float32 each; else unread
    scale_log2,                           # softmax scale * log2(e): scores live in base 2
    num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_cn, stride_cb, stride_ch,
    stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    WRITE_FINAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,             # CPU interpreter + bf16: see _launch.upcast_dot
    KV_FP8: tl.constexpr,                 # the cache holds e4m3 values of K / k_scale, V / v_scale
    FP16_DOTS: tl.constexpr,              # KV_FP8: the dots in fp16 (DecodeConfig.fp16_dots)
    USE_TMA: tl.constexpr,                # whole tiles by tensor-memory copy (DecodeConfig.tma)
):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)

    # This split's token range [start, end): an equal share of whole tiles of *this*
    # sequence's context, so short and long sequences both spread over all splits.
    kv_len = tl.load(kv_lens_ptr + seq)
    tiles_per_split = tl.cdiv(tl.cdiv(kv_len, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, kv_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g                                   # (BLOCK_G,)
    head_ok = offs_g < GROUP
    # Padding rows (BLOCK_G > GROUP, tl.dot needs >= 16 rows) are zeros: finite scores.
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_ok[:, None], other=0.0)                      # (BLOCK_G, D)
    dtype = q.dtype
    if FP16_DOTS:
        dtype = tl.float16
        q = q.to(dtype)
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)               # running max (base 2)
    l_i = tl.zeros([BLOCK_G], tl.float32)                             # running sum of exp
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    table_row = block_tables_ptr + seq * stride_bt
    # Whole tiles without masks (a masked load and lookup per token cost the FP8 cache a third
    # of its speed, docs/tuning.md "FP8"), then the split's last, partial tile masked.
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N   # an empty split: start
    if USE_TMA:
        last = tl.full([BLOCK_G], end - 1, tl.int32)
        m_i, l_i, acc = fold_box_tiles(q, last, m_i, l_i, acc, k_desc, v_desc, kv_head * HEAD_DIM, table_row,
                                       start, full_end, scale_log2, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
                                       UPCAST_DOT, KV_FP8, dtype)
    else:
        for n0 in range(start, full_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, n0, end, table_row, k_cache_ptr, v_cache_ptr, kv_head,
                                       stride_cn, stride_cb, stride_ch, scale_log2, offs_n, offs_d, dtype,
                                       BLOCK_SIZE, DOT_PRECISION, UPCAST_DOT, KV_FP8, False)
    if full_end < end:
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, full_end, end, table_row, k_cache_ptr, v_cache_ptr, kv_head,
                                   stride_cn, stride_cb, stride_ch, scale_log2, offs_n, offs_d, dtype,
                                   BLOCK_SIZE, DOT_PRECISION, UPCAST_DOT, KV_FP8, True)

    # An empty split (or kv_len 0) has l_i == 0: output 0, log-sum-exp -inf (weight 0 in the merge).
    # Scores are base 2 (scaled by log2 e), so the split's log-sum-exp is m + log2(l), in base 2.
    has_keys = l_i > 0
    out = normalize_rows(acc, l_i)
    if KV_FP8:
        out = out * tl.load(v_scale_ptr)
    if WRITE_FINAL:
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        row = (seq * NUM_HEADS + heads) * num_splits + split          # (BLOCK_G,) row of (B*H*S)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=head_ok[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=head_ok)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """SM count of a CUDA device (host-side property, no sync); 1 elsewhere (interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int, block_n: int) -> int:
    """Context splits for a decode launch, from shapes only (CUDA-graph safe).

    Enough (sequence, KV head, split) programs for ``TARGET_PROGRAMS_PER_SM`` per SM,
    but never more splits than tiles of the longest possible context
    (``max_context`` = block-table width * block size) nor than ``MAX_SPLITS``.
    ``max_context`` only caps: a CUDA graph captured with the padded width
    max_model_len / block_size gets the same count as an eager call whose table
    holds at least ``splits * block_n`` tokens (e.g. 4 splits at batch 16, Hkv 8,
    132 SMs either way), and the kernel divides each row's *real* kv_len.
    """
    programs = max(1, batch * num_kv_heads)
    wanted = triton.cdiv(TARGET_PROGRAMS_PER_SM * num_sms, programs)
    max_tiles = max(1, triton.cdiv(max_context, block_n))
    return max(1, min(next_pow2(wanted), max_tiles, MAX_SPLITS))


@functools.lru_cache(maxsize=None)  # a few (dtype, head_dim) pairs; called every layer of every step
def default_config(dtype: torch.dtype, head_dim: int, fp8_cache: bool = False, block_size: int = 0) -> DecodeConfig:
    """Tiles of at most 16 KiB of K (or V) per program, 32 to 64 tokens by pointers; an FP8
    cache's widened to fp16 for 16-bit q, as 64-token boxes where its blocks hold them (a
    ``block_size`` multiple of 64), else 128-token pointer tiles. From sweeps on an H200
    (docs/tuning.md, "FP8")."""
    if fp8_cache and block_size and block_size % 64 == 0:
        return DecodeConfig(block_n=64, fp16_dots=dtype != torch.float32, tma=True)
    item = 1 if fp8_cache else 4 if dtype == torch.float32 else 2
    block_n = max(32, min(128 if fp8_cache else 64, 16384 // (head_dim * item)))
    return DecodeConfig(block_n=block_n, fp16_dots=fp8_cache and dtype != torch.float32)


def decode_attention(
    q: torch.Tensor,             # (B, H, D)
    k_cache: torch.Tensor,       # (N, bs, Hkv, D)
    v_cache: torch.Tensor,       # (N, bs, Hkv, D)
    kv_lens: torch.Tensor,       # (B,) int32, 0 = padding row -> zeros
    block_tables: torch.Tensor,  # (B, W) int32, -1 padded
    scale: float,
    config: DecodeConfig | None = None,
    *,
    num_splits: int | None = None,
    pdl: bool = False,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:               # (B, H, D), q's dtype
    """Attention of each sequence's single new token over its whole paged context.

    Args:
        config: tile/launch parameters; None picks :func:`default_config`.
        num_splits: context splits per sequence; None picks one from shapes
            (:func:`choose_num_splits`), so a captured CUDA graph stays valid.
        pdl: the merge of the splits lets the next kernel start early where the device
            allows programmatic dependent launch (:func:`merge_attention_splits`).
        k_scale, v_scale: an FP8 cache's (1,) float32 scales (``kernels/fp8.py``);
            not read for a cache in q's dtype.

    Raises:
        TypeError: unsupported dtypes (q and caches must share one of bf16/fp16/fp32;
            kv_lens and block_tables int32), or a config that is not a DecodeConfig.
        ValueError: mismatched shapes, strided last dimensions, H not a multiple of
            Hkv, head_dim or block_size not a power of two, a bad scale or
            num_splits, tensors on different devices, an FP8 cache without scales, or
            ``fp16_dots`` without an FP8 cache and a bf16/fp16 q.
    """
    check_attention_args(q, k_cache, v_cache, kv_lens, block_tables, scale)
    k_scale, v_scale = check_kv_scales(k_cache, k_scale, v_scale)
    if num_splits is not None:
        check_host_int("num_splits", num_splits, minimum=1)
    if config is not None and not isinstance(config, DecodeConfig):
        raise TypeError(f"config must be a DecodeConfig or None, got {type(config).__name__}")
    if config is not None:
        check_fp16_dots(config.fp16_dots, q, k_cache)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    config = config or default_config(q.dtype, head_dim, is_fp8_cache(k_cache), block_size)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size,
                                       num_sms(q.device), config.block_n)
    num_splits = int(num_splits)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    part_out = part_lse = out  # unused placeholders when one split writes `out` directly
    if num_splits > 1:
        part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    group = num_heads // num_kv_heads
    use_tma, k_desc, v_desc = kv_descriptors(k_cache, v_cache, config.block_n, config.tma)
    _decode_split_kernel[(num_kv_heads, num_splits, batch)](
        q, k_cache, v_cache, k_desc, v_desc, kv_lens, block_tables, out, part_out, part_lse, k_scale, v_scale,
        scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, BLOCK_G=max(16, next_pow2(group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=config.block_n,
        WRITE_FINAL=num_splits == 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=upcast_dot(q), KV_FP8=is_fp8_cache(k_cache), FP16_DOTS=config.fp16_dots,
        USE_TMA=use_tma, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_splits > 1:
        merge_attention_splits(part_out, part_lse, out, pdl=pdl)
    return out
