"""Paged causal attention for prefill, chunked prefill and prefix-cache hits.

Sequence b feeds q_len = cu_q[b+1] - cu_q[b] new tokens at positions
kv_len - q_len .. kv_len - 1; the keys/values of *all* kv_len positions (the cached
prefix, earlier chunks and the new tokens, already stored) are read from the paged
cache through the block table, so prefix hits and chunks see the right context::

    positions  0 ........... kv_len-q_len-1 | kv_len-q_len ... kv_len-1
               cached prefix (no new query)  | new tokens (queries, causal)

GQA is folded into the tile rows: a program takes BLOCK_Q query tokens times the
G = H / Hkv heads of one KV head, as BLOCK_M = pow2(BLOCK_Q * G) rows (row r =
token r // G, head r % G), so each K/V tile is loaded once for the whole group.

Each q tile walks its keys in two loops (online softmax, fp32 accumulation)::

    keys  0 ............ full_end ...... kv_end
          | unmasked tiles | masked tiles |      full_end = (first position + 1)
          (every key seen  (the diagonal:         rounded down to BLOCK_N
           by every row)    causal mask)

so only the one or two tiles on the diagonal pay for the mask, and the loop
stops at the tile's last query position (causal tile skipping).

TMA path (``PrefillConfig.tma``, where ``_launch.tma_allowed``): when a cache block holds
whole key tiles (block_size a multiple of BLOCK_N; the engine's CUDA default of 64
does), an unmasked tile is one (BLOCK_N, D) box of the cache seen as a 2-D array of
(N * block_size) rows of Hkv * D, fetched by the tensor-memory copy engine from one
block id, instead of BLOCK_N x D pointers. The diagonal's tiles come as boxes too where
all their keys exist (below kv_len; the causal mask hides the later ones); a sequence's
partial last tile keeps masked pointer loads, as slots past its last key may hold
anything. Rows are int32 coordinates: a pool of under 2**31 token slots. With
``PrefillConfig.tma_io`` the Q tile is one (BLOCK_Q, G, D) box of q seen as (T, H, D),
whose row-major order is the tile's row order (token r // G, head r % G), and a tile
whose rows are all real is stored as one box of the output: fewer instructions per tile
than BLOCK_M x D pointers.

An FP8 cache (``kernels/fp8.py``) comes as e4m3 tiles (by pointer or TMA box alike),
turned into q's dtype in registers (exact) before the dots; the K scale multiplies the
softmax scale and the V scale the normalised output. ``PrefillConfig.fp16_dots`` turns
them into fp16 instead, and q with them, as the decode kernel does (its module doc says
when that is exact); the default for an FP8 cache and 16-bit q.

Grid: one program per (KV head, sequence, q tile) plus one extra "sequence" B
whose programs zero the output rows that belong to no sequence (before
``cu_q[0]`` or past ``cu_q[B]``), so the output is ``torch.empty`` and no memset
pass runs. With ``heavy_first`` the q tile is the slowest grid axis, reversed:
the tiles with the most keys (each sequence's last) start first and the short
ones fill the tail of the launch. Tiles past a sequence's q_len do no work; the
grid comes from the host int ``max_q_len`` so nothing syncs with the device.

Map mode (``tile_map``, built on the host by :func:`build_tile_map`): the grid is
(capacity, Hkv) and each program reads its (sequence, q tile) from the map, in the
same heavy-first order; rows of -1 idle. The grid no longer depends on the batch,
which is what capturing a prefill step in a CUDA graph needs (the map, like the
other metadata, then lives in a static buffer). Not used by the engine yet.

Torch reference: :func:`minivllm.kernels.reference.paged_attention_reference`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from minivllm.kernels.fp8 import check_fp16_dots, check_kv_scales, is_fp8_cache
from minivllm.kernels._launch import (
    LOG2E, TensorDescriptor, check_attention_args, check_dtype, check_host_int, check_tile_config,
    check_same_device, kv_descriptors, next_pow2, tma_rows_allowed, upcast_dot,
)
from minivllm.kernels._softmax import fold_box_tiles, fold_kv_tile, normalize_rows


@dataclass(frozen=True)
class PrefillConfig:
    """Tile and launch parameters of the prefill kernel (a tuning knob, not semantics)."""

    block_m: int = 128        # query rows per tile (tokens x GQA group); power of two >= 16
    block_n: int = 64         # keys per tile; power of two >= 16 (tl.dot's minimum)
    num_warps: int = 8
    num_stages: int = 3       # software-pipelining depth of the K/V loads
    heavy_first: bool = True  # q tiles on the slowest grid axis, longest first (see module doc)
    tma: bool = True          # K/V tiles by tensor-memory copy where allowed (see tma_allowed)
    tma_io: bool = True       # the Q tile and whole output tiles too, where allowed (see tma_io_allowed)
    fp16_dots: bool = False   # an FP8 cache: widen its tiles (and q) to fp16, not q's dtype (module doc)

    def __post_init__(self) -> None:
        check_tile_config(self, ("block_m", "block_n"), ("heavy_first", "tma", "tma_io", "fp16_dots"))


# Default configs, first matching row wins: (fp32?, head_dim <=, max_q_len >=, config).
# 16-bit: tiles of 64 rows (32 tokens x G 2) x 64 keys, every tile by TMA, in one of two grid
# orders: chunks under 2,048 tokens per head (heavy_first off: the tiles of one (sequence,
# KV head) side by side, sharing its K/V in L2), longer chunks heavy first. fp32 is for
# exactness, not speed (tl.dot "ieee" runs on FMA units): tiles that do not spill.
# Why these tiles and the 2,048 boundary: docs/tuning.md, "Prefill attention tiles".
CONFIG_TABLE: tuple[tuple[bool, int, int, PrefillConfig], ...] = (
    (False, 128, 2048, PrefillConfig(64, 64, num_warps=4, num_stages=3)),
    (False, 128, 0, PrefillConfig(64, 64, num_warps=4, num_stages=3, heavy_first=False)),
    (False, 256, 0, PrefillConfig(64, 32, num_warps=4, num_stages=2)),
    (True, 64, 0, PrefillConfig(64, 32, num_warps=8, num_stages=2)),
    (True, 256, 0, PrefillConfig(16, 32, num_warps=8, num_stages=2)),
)
_FALLBACK_CONFIG = PrefillConfig(16, 16, num_warps=4, num_stages=1)
# Each default with its dots in fp16, built once (default_config runs every layer of every step).
_FP16_DOTS = {c: dataclasses.replace(c, fp16_dots=True) for c in (*(row[3] for row in CONFIG_TABLE), _FALLBACK_CONFIG)}
_MAX_GRID_YZ = 65535


def default_config(dtype: torch.dtype, head_dim: int, max_q_len: int, fp8_cache: bool = False) -> PrefillConfig:
    """The table's config for this dtype, head_dim and longest chunk (see ``CONFIG_TABLE``);
    over an FP8 cache with 16-bit q, its dots in fp16 (docs/tuning.md, "FP8")."""
    fp32 = dtype == torch.float32
    config = _FALLBACK_CONFIG
    for is_fp32, max_dim, min_q, row in CONFIG_TABLE:
        if is_fp32 == fp32 and head_dim <= max_dim and max_q_len >= min_q:
            config = row
            break
    return _FP16_DOTS[config] if fp8_cache and not fp32 else config


@triton.jit
def _pointer_tile(k_ptr, v_ptr, block, pos, end, stride_cn, stride_cb,
                  HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """The K and V rows of positions ``pos`` (in cache blocks ``block``) by pointer loads;
    MASKED: zeros at positions from ``end`` on."""
    offs_d = tl.arange(0, HEAD_DIM)
    # int64: the pool can exceed 2**31 elements.
    kv_off = (block.to(tl.int64) * stride_cn + (pos % BLOCK_SIZE) * stride_cb)[:, None] + offs_d[None, :]
    if MASKED:
        in_range = pos < end
        k = tl.load(k_ptr + kv_off, mask=in_range[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + kv_off)
        v = tl.load(v_ptr + kv_off)
    return k, v


@triton.jit
def _attend_kv_range(
    q, q_pos, m_i, l_i, acc,              # (M, D) queries, (M,) positions, softmax state
    k_ptr, v_ptr,                         # caches, already offset to this KV head
    k_desc, v_desc, desc_col,             # USE_TMA: (N*bs, Hkv*D) descriptors, this KV head's column
    table_row,                            # this sequence's block-table row
    start, end, kv_len, scale_log2, stride_cn, stride_cb,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,                 # False: every key in [start, end) is visible to every row
    USE_TMA: tl.constexpr,                # tiles come by tensor-memory copy (BLOCK_SIZE % BLOCK_N == 0)
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    KV_FP8: tl.constexpr, DTYPE: tl.constexpr,  # see fold_kv_tile (_softmax.py)
):
    """Fold the keys [start, end) into the online softmax; returns (m_i, l_i, acc)."""
    offs_n = tl.arange(0, BLOCK_N)
    if USE_TMA and MASKED:
        # The diagonal (one or two tiles: not worth pipelining). A tile whose keys all exist
        # (below kv_len: the chunk's later tokens are stored too) comes as one box, the
        # causal mask hiding the keys past each row; only a sequence's partial last tile,
        # whose slots past kv_len may hold anything, takes masked pointer loads.
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + offs_n
            if n0 + BLOCK_N <= kv_len:
                row = tl.load(table_row + n0 // BLOCK_SIZE) * BLOCK_SIZE + n0 % BLOCK_SIZE
                k = k_desc.load([row, desc_col])
                v = v_desc.load([row, desc_col])
            else:
                block = tl.load(table_row + pos // BLOCK_SIZE, mask=pos < end, other=0)
                k, v = _pointer_tile(k_ptr, v_ptr, block, pos, end, stride_cn, stride_cb, HEAD_DIM, BLOCK_SIZE, True)
            m_i, l_i, acc = fold_kv_tile(q, k, v, pos, q_pos, m_i, l_i, acc, scale_log2, True, DOT_PRECISION,
                                       UPCAST_DOT, KV_FP8, DTYPE)
        return m_i, l_i, acc
    if USE_TMA:
        # Every key of the unmasked range exists, so no tile needs the pointer fallback above.
        return fold_box_tiles(q, q_pos, m_i, l_i, acc, k_desc, v_desc, desc_col, table_row, start, end, scale_log2,
                              BLOCK_SIZE, BLOCK_N, DOT_PRECISION, UPCAST_DOT, KV_FP8, DTYPE)
    # Block ids are looked up one tile ahead (loop-carried): the K/V loads' addresses then do
    # not wait on a load of the same iteration, so the pipeliner can issue them stages ahead.
    # Masked lookups never touch the table's -1 padding or the next row.
    block = tl.load(table_row + (start + offs_n) // BLOCK_SIZE, mask=start + offs_n < end, other=0)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n                                              # (BLOCK_N,)
        k, v = _pointer_tile(k_ptr, v_ptr, block, pos, end, stride_cn, stride_cb, HEAD_DIM, BLOCK_SIZE, MASKED)
        block = tl.load(table_row + (pos + BLOCK_N) // BLOCK_SIZE, mask=pos + BLOCK_N < end, other=0)
        m_i, l_i, acc = fold_kv_tile(q, k, v, pos, q_pos, m_i, l_i, acc, scale_log2, MASKED, DOT_PRECISION,
                                   UPCAST_DOT, KV_FP8, DTYPE)
    return m_i, l_i, acc


@triton.jit
def _attend_q_tile(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, q_desc, o_desc, out_ptr, table_row, cu_seqlens_q_ptr, kv_lens_ptr,
    k_scale_ptr, v_scale_ptr, seq, kv_head, q_tile, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cn, stride_cb,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr, TMA_IO: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    KV_FP8: tl.constexpr, FP16_DOTS: tl.constexpr,
):
    """Attention of one q tile (BLOCK_Q tokens x GROUP heads) of one sequence; writes its rows."""
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q < q_len:
        kv_len = tl.load(kv_lens_ptr + seq)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        token = q_tile * BLOCK_Q + offs_m // GROUP                     # (BLOCK_M,) index in the chunk
        head = kv_head * GROUP + offs_m % GROUP
        row_ok = (offs_m < BLOCK_Q * GROUP) & (token < q_len)
        first_row = q_start + q_tile * BLOCK_Q
        if TMA_IO:
            # One (BLOCK_Q, GROUP, D) box of q as (T, H, D); row r of the tile is token r // G,
            # head r % G, which is the box's row-major order. Tokens past q_len (another
            # sequence's, or zeros past T) fill rows whose output is never stored.
            q = tl.reshape(q_desc.load([first_row, kv_head * GROUP, 0]), (BLOCK_M, HEAD_DIM))
        else:
            q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh
                        + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # (BLOCK_M, D)
        dtype = q.dtype
        if FP16_DOTS:
            dtype = tl.float16
            q = q.to(dtype)
        if KV_FP8:
            scale_log2 = scale_log2 * tl.load(k_scale_ptr)
        if UPCAST_DOT:
            q = q.to(tl.float32)
        prefix = kv_len - q_len                                        # cached tokens before the chunk
        q_pos = prefix + token                                         # (BLOCK_M,) absolute positions
        # Keys every row sees: up to the tile's first position, whole tiles only. Keys
        # the tile needs at all: up to its last position. Clamped for q_len > kv_len
        # (a caller error) so the loops stay empty rather than read before the context.
        full_end = tl.maximum(prefix + q_tile * BLOCK_Q + 1, 0) // BLOCK_N * BLOCK_N
        kv_end = tl.minimum(prefix + (q_tile + 1) * BLOCK_Q, kv_len)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        # The first tile holds key 0, visible to every row (q_pos >= 0): m_i is finite after it.
        desc_col = kv_head * HEAD_DIM
        m_i, l_i, acc = _attend_kv_range(q, q_pos, m_i, l_i, acc, k_ptr, v_ptr, k_desc, v_desc, desc_col,
                                         table_row, 0, full_end, kv_len, scale_log2, stride_cn, stride_cb,
                                         HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, USE_TMA, DOT_PRECISION, UPCAST_DOT,
                                         KV_FP8, dtype)
        m_i, l_i, acc = _attend_kv_range(q, q_pos, m_i, l_i, acc, k_ptr, v_ptr, k_desc, v_desc, desc_col,
                                         table_row, full_end, kv_end, kv_len, scale_log2, stride_cn, stride_cb,
                                         HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, USE_TMA, DOT_PRECISION, UPCAST_DOT,
                                         KV_FP8, dtype)
        out = normalize_rows(acc, l_i)                                 # kv_len 0: zeros
        if KV_FP8:
            out = out * tl.load(v_scale_ptr)
        out = out.to(out_ptr.dtype.element_ty)
        if TMA_IO and (q_tile + 1) * BLOCK_Q <= q_len:                 # every row real: one box
            o_desc.store([first_row, kv_head * GROUP, 0], tl.reshape(out, (BLOCK_Q, GROUP, HEAD_DIM)))
        else:
            tl.store(out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh
                     + offs_d[None, :], out, mask=row_ok[:, None])


@triton.jit
def _zero_rows(
    out_ptr, start, stop, kv_head, first_tile, num_tiles, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Zero tokens [start, stop) x this KV head's GROUP heads; program ``first_tile`` of
    ``num_tiles`` takes every num_tiles-th chunk of BLOCK_Q tokens (grid-stride loop)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + offs_m % GROUP
    zeros = tl.zeros([BLOCK_M, HEAD_DIM], out_ptr.dtype.element_ty)
    first = start + first_tile * BLOCK_Q
    stride = num_tiles * BLOCK_Q
    for i in range(0, tl.cdiv(stop - first, stride)):
        token = first + i * stride + offs_m // GROUP
        ok = (offs_m < BLOCK_Q * GROUP) & (token < stop)
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 zeros, mask=ok[:, None])


@triton.jit(do_not_specialize=["num_tokens"])
def _prefill_kernel(
    q_ptr,                                # (T, H, D)
    k_cache_ptr, v_cache_ptr,             # (N, bs, Hkv, D), same strides
    k_desc, v_desc,                       # USE_TMA: descriptors of the caches as (N*bs, Hkv*D); else unread
    q_desc, o_desc,                       # TMA_IO: descriptors of q and out as (T, H, D); else unread
    out_ptr,                              # (T, H, D)
    cu_seqlens_q_ptr,                     # (B+1,) int32
    kv_lens_ptr,                          # (B,) int32
    block_tables_ptr,                     # (B, W) int32, -1 padded
    tile_map_ptr,                         # (capacity, 2) int32 (sequence, q tile), -1 rows idle; USE_MAP
    k_scale_ptr, v_scale_ptr,             # KV_FP8: (1,) float32 each; else unread
    scale_log2,                           # softmax scale * log2(e): scores live in base 2
    num_tokens,                           # T (not specialised: one compile for every batch)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cn, stride_cb, stride_ch,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAVY_FIRST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,             # CPU interpreter + bf16: see _launch.upcast_dot
    USE_MAP: tl.constexpr,                # grid (capacity, Hkv): each program reads its tile from the map
    USE_TMA: tl.constexpr,                # K/V tiles by tensor-memory copy (see PrefillConfig.tma)
    TMA_IO: tl.constexpr,                 # the Q tile and whole output tiles too (PrefillConfig.tma_io)
    KV_FP8: tl.constexpr,                 # the cache holds e4m3 values of K / k_scale, V / v_scale
    FP16_DOTS: tl.constexpr,              # KV_FP8: the dots in fp16 (PrefillConfig.fp16_dots)
):
    if USE_MAP:
        entry = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = tl.load(tile_map_ptr + 2 * entry)
        if seq >= 0:
            _attend_q_tile(q_ptr, k_cache_ptr + kv_head * stride_ch, v_cache_ptr + kv_head * stride_ch,
                           k_desc, v_desc, q_desc, o_desc, out_ptr,
                           block_tables_ptr + seq * stride_bt, cu_seqlens_q_ptr, kv_lens_ptr, k_scale_ptr, v_scale_ptr,
                           seq, kv_head, tl.load(tile_map_ptr + 2 * entry + 1), scale_log2,
                           stride_qt, stride_qh, stride_ot, stride_oh, stride_cn, stride_cb,
                           GROUP, BLOCK_Q, BLOCK_M, HEAD_DIM, BLOCK_SIZE, BLOCK_N, USE_TMA, TMA_IO, DOT_PRECISION,
                           UPCAST_DOT, KV_FP8, FP16_DOTS)
        return
    # Grid (Hkv, B+1, tiles) when HEAVY_FIRST, else (tiles, Hkv, B+1); q tiles reversed either way.
    if HEAVY_FIRST:
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
        num_seqs = tl.num_programs(1) - 1
        num_tiles = tl.num_programs(2)
        q_tile = num_tiles - 1 - tl.program_id(2)
    else:
        kv_head = tl.program_id(1)
        seq = tl.program_id(2)
        num_seqs = tl.num_programs(2) - 1
        num_tiles = tl.num_programs(0)
        q_tile = num_tiles - 1 - tl.program_id(0)
    if seq == num_seqs:
        _zero_rows(out_ptr, 0, tl.load(cu_seqlens_q_ptr), kv_head, q_tile, num_tiles, stride_ot, stride_oh,
                   GROUP, BLOCK_Q, BLOCK_M, HEAD_DIM)
        _zero_rows(out_ptr, tl.load(cu_seqlens_q_ptr + num_seqs), num_tokens, kv_head, q_tile, num_tiles,
                   stride_ot, stride_oh, GROUP, BLOCK_Q, BLOCK_M, HEAD_DIM)
    else:
        _attend_q_tile(q_ptr, k_cache_ptr + kv_head * stride_ch, v_cache_ptr + kv_head * stride_ch,
                       k_desc, v_desc, q_desc, o_desc, out_ptr,
                       block_tables_ptr + seq * stride_bt, cu_seqlens_q_ptr, kv_lens_ptr, k_scale_ptr, v_scale_ptr,
                       seq, kv_head, q_tile, scale_log2,
                       stride_qt, stride_qh, stride_ot, stride_oh, stride_cn, stride_cb,
                       GROUP, BLOCK_Q, BLOCK_M, HEAD_DIM, BLOCK_SIZE, BLOCK_N, USE_TMA, TMA_IO, DOT_PRECISION,
                       UPCAST_DOT, KV_FP8, FP16_DOTS)


def prefill_attention(
    q: torch.Tensor,             # (T, H, D) new tokens' queries, sequences concatenated
    k_cache: torch.Tensor,       # (N, bs, Hkv, D), already holding the new tokens' K/V
    v_cache: torch.Tensor,       # (N, bs, Hkv, D)
    cu_seqlens_q: torch.Tensor,  # (B+1,) int32
    kv_lens: torch.Tensor,       # (B,) int32: cached prefix + new tokens
    block_tables: torch.Tensor,  # (B, W) int32, -1 padded
    scale: float,
    max_q_len: int,              # host int >= every q_len (sizes the grid; no device sync)
    *,
    config: PrefillConfig | None = None,
    tile_map: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:               # (T, H, D), q's dtype
    """Causal attention of each sequence's new tokens over its whole paged context.

    Rows of sequences with kv_len 0, and rows outside ``cu_seqlens_q[0]:cu_seqlens_q[-1]``,
    are zeros. The caller guarantees q_len <= kv_len and q_len <= max_q_len per sequence
    (checking would need a device->host sync).

    Args:
        config: tile/launch parameters; None picks :func:`default_config`.
        tile_map: (capacity, 2) int32 from :func:`build_tile_map` with this config's
            ``block_q`` (:func:`tile_rows`): the grid is then (capacity, Hkv), fixed by
            the map's size rather than by the batch, so a CUDA graph captured for one
            capacity replays for any batch that fits (``max_q_len`` is then unused).
            Rows outside every sequence are left as they are (``torch.empty``): give
            padding rows a sequence of their own with kv_len 0, whose rows are zeros.
        k_scale, v_scale: an FP8 cache's (1,) float32 scales (``kernels/fp8.py``); not
            read for a cache in q's dtype.

    Raises:
        TypeError: unsupported dtypes (q and caches share one of bf16/fp16/fp32;
            cu_seqlens_q, kv_lens and block_tables are int32), or a config that is
            not a PrefillConfig.
        ValueError: mismatched shapes, strided last dimensions, H not a multiple of
            Hkv, head_dim or block_size not a power of two, a bad scale, negative
            max_q_len, tensors on different devices, an FP8 cache without scales, or
            ``fp16_dots`` without an FP8 cache and a bf16/fp16 q.
    """
    check_attention_args(q, k_cache, v_cache, kv_lens, block_tables, scale, cu_seqlens_q=cu_seqlens_q)
    k_scale, v_scale = check_kv_scales(k_cache, k_scale, v_scale)
    check_host_int("max_q_len", max_q_len, minimum=0)
    if config is not None and not isinstance(config, PrefillConfig):
        raise TypeError(f"config must be a PrefillConfig or None, got {type(config).__name__}")
    if config is not None:
        check_fp16_dots(config.fp16_dots, q, k_cache)
    if tile_map is not None:
        check_dtype("tile_map", tile_map, (torch.int32,))
        if tile_map.dim() != 2 or tile_map.shape[1] != 2 or not tile_map.is_contiguous():
            raise ValueError(f"tile_map must be a contiguous (capacity, 2) tensor, got {tuple(tile_map.shape)}")
        check_same_device(q=q, tile_map=tile_map)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    config = config or default_config(q.dtype, head_dim, int(max_q_len), is_fp8_cache(k_cache))
    group = num_heads // num_kv_heads
    block_m, block_q = _tile_shape(config, group)
    heavy_first = config.heavy_first
    use_tma, k_desc, v_desc = kv_descriptors(k_cache, v_cache, config.block_n, config.tma)
    tma_io = config.tma_io and block_q * group == block_m and tma_io_allowed(q) and tma_io_allowed(out)
    q_desc, o_desc = q, out                            # unread without TMA_IO
    if tma_io:
        q_desc, o_desc = (TensorDescriptor(t, list(t.shape), list(t.stride()), [block_q, group, head_dim])
                          for t in (q, out))
    if tile_map is not None:
        grid: tuple[int, ...] = (max(1, tile_map.shape[0]), num_kv_heads)
    else:
        # >= 1 tile even when max_q_len is 0: the extra sequence's programs still zero the rows.
        tiles = max(1, triton.cdiv(int(max_q_len), block_q))
        seqs = kv_lens.shape[0] + 1
        # CUDA caps grid axes 1 and 2 at 65535: a longer chunk puts its tiles on axis 0.
        heavy_first = heavy_first and tiles <= _MAX_GRID_YZ
        grid = (num_kv_heads, seqs, tiles) if heavy_first else (tiles, num_kv_heads, seqs)
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_desc, v_desc, q_desc, o_desc, out, cu_seqlens_q, kv_lens, block_tables,
        tile_map if tile_map is not None else cu_seqlens_q,  # unread without the map
        k_scale, v_scale, scale * LOG2E, num_tokens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=config.block_n,
        HEAVY_FIRST=heavy_first,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=upcast_dot(q), USE_MAP=tile_map is not None, USE_TMA=use_tma, TMA_IO=tma_io,
        KV_FP8=is_fp8_cache(k_cache), FP16_DOTS=config.fp16_dots,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def tma_io_allowed(t: torch.Tensor) -> bool:
    """Whether (BLOCK_Q, G, D) boxes of q or out, (T, H, D) with contiguous rows of D, can
    come or go by tensor-memory copy: aligned base and strides (``tma_rows_allowed``)."""
    return (t.stride(2) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
            and tma_rows_allowed(t, t.stride(1) * t.element_size()))


def _tile_shape(config: PrefillConfig, group: int) -> tuple[int, int]:
    """(BLOCK_M rows, BLOCK_Q tokens) of a tile: BLOCK_M = BLOCK_Q x GQA group, padded to a power of two."""
    block_m = max(config.block_m, next_pow2(group))
    return block_m, block_m // group


def tile_rows(config: PrefillConfig, num_heads: int, num_kv_heads: int) -> int:
    """Tokens per q tile (BLOCK_Q) for ``config`` at this GQA ratio: what :func:`build_tile_map` needs."""
    return _tile_shape(config, num_heads // num_kv_heads)[1]


def build_tile_map(q_lens: np.ndarray, block_q: int, capacity: int) -> np.ndarray:
    """The (capacity, 2) int32 work list of the map mode: one (sequence, q tile) row per tile
    of every sequence, the tiles with the most keys first (each sequence's last tile, in
    descending tile order, as the grid's heavy-first order), then rows of -1 (idle programs).

    Raises:
        ValueError: more tiles than ``capacity``.
    """
    q_lens = np.asarray(q_lens, dtype=np.int64)
    tiles = -(-q_lens // block_q)
    total = int(tiles.sum())
    if total > capacity:
        raise ValueError(f"the batch has {total} q tiles of {block_q} tokens, the map holds {capacity}")
    seq = np.repeat(np.arange(len(q_lens), dtype=np.int32), tiles)
    first = np.repeat(np.cumsum(tiles) - tiles, tiles)
    tile = (np.arange(total) - first).astype(np.int32)
    order = np.argsort(-tile, kind="stable")
    out = np.full((capacity, 2), -1, dtype=np.int32)
    out[:total, 0] = seq[order]
    out[:total, 1] = tile[order]
    return out
