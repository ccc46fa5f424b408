"""Qwen3.5's attention input in one kernel: zero-centred q/k RMSNorm per head, RoPE of the
first R dims, and the K/V cache write.

Per token::

    q = rope_R(rms_norm_1p(q, q_weight))    -> a new (T, H, D) tensor
    k = rope_R(rms_norm_1p(k, k_weight))    -> k_cache[slot]     (slot -1: nothing stored)
    v                                       -> v_cache[slot]

q, k and v come as separate (T, heads, D) views: Qwen3.5's q_proj interleaves each head's
query and gate rows, so q's heads are 2 D apart in the projection's output.

RoPE here is rotate-half over the first R = ``cos_sin_cache.shape[1]`` dims (R = D / 4 in
Qwen3.5): dim d < R/2 pairs with d + R/2, and dims R..D pass through. One program per token
holds each tile of heads whole (D wide) and loads every dim's rotation partner a second time
(from cache), so the pass-through dims need no tile of their own::

    head:  [ 0 .. R/2 | R/2 .. R | R .. D ]
    out:     y*c - y'*s  y*c + y'*s   y          y' = the partner's normalised value

Rounding is the unfused path's (``rms_norm_1p_ref`` then ``partial_rope_ref``): mean(x^2)
in fp32, ``(x * rsqrt(mean + eps)) * (1 + w)`` in fp32 rounded once to the model dtype,
then RoPE in fp32 with the fp32 table, rounded once. Launched without FMA contraction and
with IEEE sqrt/division, so in fp32 it differs from the reference only by the order of the
D-term sum of squares. k is rounded to the model dtype before the store (an FP8 cache
quantizes that value by the layer's scale, ``fp8.store_kv``). Slot -1 is masked in the
kernel, never filtered on the host: no sync, so a CUDA graph may hold the launch.

Torch reference: :func:`minivllm.kernels.reference.qk_norm_1p_rope_store_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, next_pow2
from minivllm.kernels.fp8 import check_kv_scales, check_rope_store_args, exact_cast, is_fp8_cache, store_kv

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Elements of one (heads, D) tile; bounds registers at large H * D (the head loop then takes
# several chunks).
_MAX_TILE = 2048


@triton.jit
def _norm_1p_rope(
    row, stride_h, offs_h, mask,          # the token's heads: row + offs_h * stride_h + d
    offs_d, partner, rotated,             # (1, D): dims, their rotation partners, d < R
    w, w_partner,                         # (1, D) fp32: 1 + weight, at offs_d and at partner
    cos, sin,                             # (1, D) fp32; sin negated where d < R/2
    eps, HEAD_DIM: tl.constexpr,
):
    """Zero-centred RMSNorm then partial RoPE of a tile of heads, in fp32 (not yet rounded)."""
    x = tl.load(row + offs_h * stride_h + offs_d, mask=mask, other=0.0)
    xp = tl.load(row + offs_h * stride_h + partner, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    # Times 1/D, a power of two: exact, as torch's sum / D is (Triton's `/` is approximate);
    # 1 / sqrt, each correctly rounded, as torch's CPU rsqrt computes it.
    mean_sq = tl.sum(x32 * x32, axis=1) * (1.0 / HEAD_DIM)                    # (BLOCK_H,)
    root = tl.sqrt_rn(mean_sq + eps)
    rstd = tl.math.div_rn(tl.full(root.shape, 1.0, tl.float32), root)[:, None]
    y = ((x32 * rstd) * w).to(x.dtype).to(tl.float32)
    yp = ((xp.to(tl.float32) * rstd) * w_partner).to(x.dtype).to(tl.float32)
    return tl.where(rotated, y * cos + yp * sin, y)


@triton.jit
def _qk_norm_1p_rope_store_kernel(
    q_ptr, k_ptr, v_ptr,                  # (T, H, D), (T, Hkv, D), (T, Hkv, D); last dim contiguous
    pos_ptr,                              # (T,) int
    q_weight_ptr, k_weight_ptr,           # (D,) zero-centred
    cos_sin_ptr,                          # (P, R) fp32: [cos | sin]
    q_out_ptr,                            # (T, H, D) contiguous
    k_cache_ptr, v_cache_ptr,             # (N, bs, Hkv, D), same strides
    slot_ptr,                             # (T,) int, -1 = do not store
    k_scale_ptr, v_scale_ptr,             # KV_FP8: (1,) float32 each; else unread
    eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs_p,
    stride_cn, stride_cb, stride_ch,      # cache strides: block, offset in block, head
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,             # R: the rotated leading dims of each head
    BLOCK_SIZE: tl.constexpr,             # tokens per KV block
    BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr,  # heads per chunk (powers of two)
    KV_FP8: tl.constexpr,                 # the cache holds e4m3 values (kernels/fp8.py)
    EXACT_CAST: tl.constexpr,             # KV_FP8 off CUDA: see fp8.to_e4m3
):
    HALF_R: tl.constexpr = ROTARY_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)[None, :]                                 # (1, D)
    first = offs_d < HALF_R
    rotated = offs_d < ROTARY_DIM
    partner = tl.where(first, offs_d + HALF_R, tl.where(rotated, offs_d - HALF_R, offs_d))
    freq = tl.where(first, offs_d, offs_d - HALF_R)
    cos = tl.load(cos_sin_ptr + pos * stride_cs_p + freq, mask=rotated, other=1.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs_p + HALF_R + freq, mask=rotated, other=0.0)
    sin = tl.where(first, -sin, sin)          # x1*c - x2*s as x1*c + x2*(-s): the same bits

    # q: all H heads, BLOCK_H at a time, into the dense output.
    qw = 1.0 + tl.load(q_weight_ptr + offs_d).to(tl.float32)
    qw_partner = 1.0 + tl.load(q_weight_ptr + partner).to(tl.float32)
    q_out = q_out_ptr + token * (NUM_HEADS * HEAD_DIM)
    for h0 in tl.static_range(0, NUM_HEADS, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)[:, None]                         # (BLOCK_H, 1)
        mask = (offs_h < NUM_HEADS) & (offs_d < HEAD_DIM)                    # (BLOCK_H, D)
        o = _norm_1p_rope(q_ptr + token * stride_qt, stride_qh, offs_h, mask, offs_d, partner, rotated,
                          qw, qw_partner, cos, sin, eps, HEAD_DIM)
        tl.store(q_out + offs_h * HEAD_DIM + offs_d, o.to(q_out_ptr.dtype.element_ty), mask=mask)

    # k (normalised, rotated) and v (as is) into the cache slot. A padding row (slot -1) has
    # no heads to store. (Not `(slot >= 0) & ...`: the interpreter rejects a scalar bool in
    # a mask expression.)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    num_store = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    # The cache may hold far more than 2**31 elements: the block offset is int64.
    cache_row = (slot // BLOCK_SIZE) * stride_cn + (slot % BLOCK_SIZE) * stride_cb
    kw = 1.0 + tl.load(k_weight_ptr + offs_d).to(tl.float32)
    kw_partner = 1.0 + tl.load(k_weight_ptr + partner).to(tl.float32)
    for h0 in tl.static_range(0, NUM_KV_HEADS, BLOCK_HKV):
        offs_h = h0 + tl.arange(0, BLOCK_HKV)[:, None]                       # (BLOCK_HKV, 1)
        mask = (offs_h < num_store) & (offs_d < HEAD_DIM)
        cache_off = cache_row + offs_h * stride_ch + offs_d
        o = _norm_1p_rope(k_ptr + token * stride_kt, stride_kh, offs_h, mask, offs_d, partner, rotated,
                          kw, kw_partner, cos, sin, eps, HEAD_DIM)
        # Rounded to the model dtype first (the unfused path stores model-dtype k).
        store_kv(k_cache_ptr + cache_off, o.to(k_ptr.dtype.element_ty), mask, k_scale_ptr, KV_FP8, EXACT_CAST)
        v = tl.load(v_ptr + token * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
        store_kv(v_cache_ptr + cache_off, v, mask, v_scale_ptr, KV_FP8, EXACT_CAST)


def qk_norm_1p_rope_store(
    q: torch.Tensor,              # (T, H, D), last dim contiguous (a view of the projection)
    k: torch.Tensor,              # (T, Hkv, D)
    v: torch.Tensor,              # (T, Hkv, D)
    positions: torch.Tensor,      # (T,) int64 (int32 accepted)
    q_weight: torch.Tensor,       # (D,) zero-centred: the scale is 1 + q_weight
    k_weight: torch.Tensor,       # (D,)
    eps: float,
    cos_sin_cache: torch.Tensor,  # (P, R) float32: [cos | sin], R <= D the rotated dims
    k_cache: torch.Tensor,        # (N, bs, Hkv, D)
    v_cache: torch.Tensor,        # (N, bs, Hkv, D)
    slot_mapping: torch.Tensor,   # (T,) int64 (int32 accepted), -1 = do not store
    k_scale: torch.Tensor | None = None,  # FP8 cache: (1,) float32, k ~= stored * k_scale
    v_scale: torch.Tensor | None = None,  # FP8 cache: (1,) float32
) -> torch.Tensor:
    """Zero-centred RMSNorm of q and k per head, RoPE of their first R dims, k and v stored in
    the paged cache; returns q as a new dense (T, H, D) tensor in q's dtype.

    k and v go to ``cache[slot // bs, slot % bs]`` (cast to the cache dtype; an FP8 cache:
    quantized by the scale, ``kernels/fp8.py``). Positions and slots are not bounds-checked
    (that would sync the host).

    Raises:
        TypeError: a tensor has an unsupported dtype (k and v must have q's, the table must be
            float32, positions/slots integer) or eps is not a number.
        ValueError: shapes disagree, D is not a power of two >= 2, R is odd or above D, a
            last dimension is strided, caches differ in shape or strides, devices differ, or
            an FP8 cache comes without its scales.
    """
    _check_args(q, k, v, positions, q_weight, k_weight, eps, cos_sin_cache, k_cache, v_cache, slot_mapping)
    k_scale, v_scale = check_kv_scales(k_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    block_h = min(next_pow2(num_heads), max(1, _MAX_TILE // head_dim))
    block_hkv = min(next_pow2(num_kv_heads), max(1, _MAX_TILE // head_dim))
    _qk_norm_1p_rope_store_kernel[(num_tokens,)](
        q, k, v, positions, q_weight, k_weight, cos_sin_cache, out, k_cache, v_cache, slot_mapping,
        k_scale, v_scale, float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, ROTARY_DIM=cos_sin_cache.shape[1],
        BLOCK_SIZE=block_size, BLOCK_H=block_h, BLOCK_HKV=block_hkv,
        KV_FP8=is_fp8_cache(k_cache), EXACT_CAST=exact_cast(q),
        num_warps=4 if block_h * head_dim >= 1024 else 1,
        # a*b - c*d as two rounded products, as eager torch computes RoPE.
        enable_fp_fusion=False,
    )
    return out


def _check_args(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor,
    k_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """Validate the arguments of :func:`qk_norm_1p_rope_store` (raises TypeError / ValueError)."""
    check_dtype("q", q, _FLOAT_DTYPES)
    for name, t in (("k", k), ("v", v)):
        check_dtype(name, t, (q.dtype,))
    for name, t in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_dtype(name, t, _FLOAT_DTYPES)
    num_kv_heads, head_dim = check_rope_store_args(eps, positions, slot_mapping, cos_sin_cache, k_cache, v_cache,
                                                   q=q, k=k, v=v, q_weight=q_weight, k_weight=k_weight)
    _check_shapes(q, k, v, positions, slot_mapping, q_weight, k_weight, num_kv_heads, head_dim)
    rotary = cos_sin_cache.shape[1] if cos_sin_cache.dim() == 2 else -1
    if rotary < 2 or rotary % 2 or rotary > head_dim:
        raise ValueError(f"cos_sin_cache must be (P, R) with R even and 2 <= R <= {head_dim}, "
                         f"got {tuple(cos_sin_cache.shape)}")


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  slot_mapping: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  num_kv_heads: int, head_dim: int) -> None:
    """q (T, H, D), k and v (T, Hkv, D), positions and slots (T,), weights (D,) against the cache's Hkv, D."""
    if q.dim() != 3 or q.shape[1] == 0 or q.shape[2] != head_dim:
        raise ValueError(f"q must be (T, H, {head_dim}) with H >= 1, got {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.shape != (q.shape[0], num_kv_heads, head_dim):
            raise ValueError(f"{name} must be ({q.shape[0]}, {num_kv_heads}, {head_dim}), got {tuple(t.shape)}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.shape != q.shape[:1]:
            raise ValueError(f"{name} must be ({q.shape[0]},), got {tuple(t.shape)}")
    for name, t in (("q_weight", q_weight), ("k_weight", k_weight)):
        if t.shape != (head_dim,):
            raise ValueError(f"{name} must be ({head_dim},), got {tuple(t.shape)}")
