"""Per-head q/k RMSNorm, neox RoPE and the K/V cache write, fused into one kernel.

After the packed QKV projection, a Qwen3 layer needs, per token::

    q = rope(rms_norm(q, q_weight))        -> a new (T, H, D) tensor
    k = rope(rms_norm(k, k_weight))        -> k_cache[slot]
    v                                      -> v_cache[slot]

Families without q/k norm (Qwen2, Llama) pass no weights and get the same kernel
without the norm (``HAS_NORM`` false): RoPE and the cache write in one launch.

Unfused (``qk_norm_rope`` compiled by torch.compile, then a K/V store) that is 7
launches per layer; at batch 1 the launches, not the bytes, set the step time.
Here one program per token reads its whole QKV row once and writes q and the
cache rows, so the step is one launch per layer whatever the batch.

An FP8 cache (``kernels/fp8.py``) gets k and v quantized by the layer's scales as they are
stored (k after its rounding to the model dtype).

Rounding is the unfused path's, step by step (``rms_norm_ref`` then ``rope_ref``):
mean(x^2) in fp32, ``x * rsqrt(mean + eps)`` rounded to the model dtype, times
the weight rounded to the model dtype, then RoPE in fp32 on that value with the
fp32 cos/sin table, rounded once. The kernel is launched without FMA contraction
and with IEEE sqrt/division so that, in fp32, it differs from the eager torch
reference only by the order of the D-term sum of squares (<= 1 ulp).

Torch reference: :func:`minivllm.kernels.reference.qk_norm_rope_store_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, next_pow2
from minivllm.kernels.fp8 import check_kv_scales, check_rope_store_args, exact_cast, is_fp8_cache, store_kv

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Elements of one (heads, D/2) half-tile; bounds registers at large H * D (the head
# loop then takes several chunks). At Qwen3-0.6B (H 16, D 128) all q heads fit one chunk.
_MAX_TILE = 2048


@triton.jit
def _rms_norm_rope(
    x1, x2,                 # (BLOCK_H, D/2) model dtype: the two halves of each head
    w1, w2,                 # (1, D/2) model dtype: the norm weight's halves
    cos, sin,               # (1, D/2) fp32
    eps, HEAD_DIM: tl.constexpr,
):
    """RMSNorm then RoPE of a tile of heads -> the rotated halves in fp32 (not yet rounded)."""
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # Times 1/D, a power of two: exact, as torch's sum / D is (Triton's `/` is approximate).
    mean_sq = (tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) * (1.0 / HEAD_DIM)  # (BLOCK_H,)
    # 1 / sqrt, each correctly rounded, as torch's CPU rsqrt computes it.
    root = tl.sqrt_rn(mean_sq + eps)
    rstd = tl.math.div_rn(tl.full(root.shape, 1.0, tl.float32), root)[:, None]         # (BLOCK_H, 1)
    # HF: `weight * x.to(dtype)`. The product of two bf16/fp16 values is exact in
    # fp32, so multiplying in fp32 and rounding once equals the model-dtype multiply.
    y1 = ((x1f * rstd).to(x1.dtype).to(tl.float32) * w1.to(tl.float32)).to(x1.dtype).to(tl.float32)
    y2 = ((x2f * rstd).to(x1.dtype).to(tl.float32) * w2.to(tl.float32)).to(x1.dtype).to(tl.float32)
    return y1 * cos - y2 * sin, y2 * cos + y1 * sin


@triton.jit
def _maybe_norm_rope(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """``_rms_norm_rope``, or (no norm) RoPE alone of the model-dtype values, in fp32."""
    if HAS_NORM:
        o1, o2 = _rms_norm_rope(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM)
    else:
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        o1, o2 = x1f * cos - x2f * sin, x2f * cos + x1f * sin
    return o1, o2


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr,                              # (T, (H + 2 Hkv) * D): [q heads | k heads | v heads]
    pos_ptr,                              # (T,) int
    q_weight_ptr, k_weight_ptr,           # (D,); read only when HAS_NORM
    cos_sin_ptr,                          # (P, D) fp32: [cos | sin]
    q_out_ptr,                            # (T, H, D) contiguous
    k_cache_ptr, v_cache_ptr,             # (N, bs, Hkv, D), same strides
    slot_ptr,                             # (T,) int, -1 = do not store
    k_scale_ptr, v_scale_ptr,             # KV_FP8: (1,) float32 each; else unread
    eps,
    stride_qkv_t, stride_cs_p,
    stride_cn, stride_cb, stride_ch,      # cache strides: block, offset in block, head
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,             # tokens per KV block
    BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr,  # heads per chunk (powers of two)
    HAS_NORM: tl.constexpr,
    KV_FP8: tl.constexpr,                 # the cache holds e4m3 values (kernels/fp8.py)
    EXACT_CAST: tl.constexpr,             # KV_FP8 off CUDA: see fp8.to_e4m3
):
    HALF: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, HALF)[None, :]                                    # (1, D/2)
    cos = tl.load(cos_sin_ptr + pos * stride_cs_p + offs_d)
    sin = tl.load(cos_sin_ptr + pos * stride_cs_p + HALF + offs_d)
    row = qkv_ptr + token * stride_qkv_t

    # q: all H heads, BLOCK_H at a time, into the dense output.
    qw1 = tl.load(q_weight_ptr + offs_d)
    qw2 = tl.load(q_weight_ptr + HALF + offs_d)
    q_out = q_out_ptr + token * (NUM_HEADS * HEAD_DIM)
    for h0 in tl.static_range(0, NUM_HEADS, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)[:, None]                        # (BLOCK_H, 1)
        mask = (offs_h < NUM_HEADS) & (offs_d < HALF)                       # (BLOCK_H, D/2)
        off = offs_h * HEAD_DIM + offs_d
        x1 = tl.load(row + off, mask=mask, other=0.0)
        x2 = tl.load(row + off + HALF, mask=mask, other=0.0)
        o1, o2 = _maybe_norm_rope(x1, x2, qw1, qw2, cos, sin, eps, HEAD_DIM, HAS_NORM)
        tl.store(q_out + off, o1.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(q_out + off + HALF, o2.to(q_out_ptr.dtype.element_ty), mask=mask)

    # k (normalised, rotated) and v (as is) into the cache slot. A padding row
    # (slot -1) has no heads to store. (Not `(slot >= 0) & ...`: the interpreter
    # rejects a scalar bool in a mask expression.)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    num_store = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    # The cache may hold far more than 2**31 elements: the block offset is int64.
    cache_row = (slot // BLOCK_SIZE) * stride_cn + (slot % BLOCK_SIZE) * stride_cb
    kw1 = tl.load(k_weight_ptr + offs_d)
    kw2 = tl.load(k_weight_ptr + HALF + offs_d)
    k_row = row + NUM_HEADS * HEAD_DIM
    v_row = k_row + NUM_KV_HEADS * HEAD_DIM
    for h0 in tl.static_range(0, NUM_KV_HEADS, BLOCK_HKV):
        offs_h = h0 + tl.arange(0, BLOCK_HKV)[:, None]                      # (BLOCK_HKV, 1)
        mask = (offs_h < num_store) & (offs_d < HALF)
        off = offs_h * HEAD_DIM + offs_d
        cache_off = cache_row + offs_h * stride_ch + offs_d
        x1 = tl.load(k_row + off, mask=mask, other=0.0)
        x2 = tl.load(k_row + off + HALF, mask=mask, other=0.0)
        o1, o2 = _maybe_norm_rope(x1, x2, kw1, kw2, cos, sin, eps, HEAD_DIM, HAS_NORM)
        # Rounded to the model dtype first (the unfused path stores model-dtype k).
        o1 = o1.to(x1.dtype)
        o2 = o2.to(x1.dtype)
        v1 = tl.load(v_row + off, mask=mask)
        v2 = tl.load(v_row + off + HALF, mask=mask)
        _store_pair(k_cache_ptr + cache_off, o1, o2, HALF, mask, k_scale_ptr, KV_FP8, EXACT_CAST)
        _store_pair(v_cache_ptr + cache_off, v1, v2, HALF, mask, v_scale_ptr, KV_FP8, EXACT_CAST)


@triton.jit
def _store_pair(ptr, x1, x2, HALF: tl.constexpr, mask, scale_ptr, KV_FP8: tl.constexpr,
                EXACT_CAST: tl.constexpr):
    """Both halves of a tile of heads into the cache at ``ptr`` (``fp8.store_kv``)."""
    store_kv(ptr, x1, mask, scale_ptr, KV_FP8, EXACT_CAST)
    store_kv(ptr + HALF, x2, mask, scale_ptr, KV_FP8, EXACT_CAST)


def qk_norm_rope_store(
    qkv: torch.Tensor,            # (T, (H + 2 Hkv) * D) the QKV projection's output
    positions: torch.Tensor,      # (T,) int64 (int32 accepted)
    q_weight: torch.Tensor | None,  # (D,) model dtype; None (with k_weight None): no norm
    k_weight: torch.Tensor | None,  # (D,) model dtype
    eps: float,
    cos_sin_cache: torch.Tensor,  # (P, D) float32: [cos | sin]
    k_cache: torch.Tensor,        # (N, bs, Hkv, D)
    v_cache: torch.Tensor,        # (N, bs, Hkv, D)
    slot_mapping: torch.Tensor,   # (T,) int64 (int32 accepted), -1 = do not store
    k_scale: torch.Tensor | None = None,  # FP8 cache: (1,) float32, k ~= stored * k_scale
    v_scale: torch.Tensor | None = None,  # FP8 cache: (1,) float32
) -> torch.Tensor:
    """Normalise (unless the weights are None) and rotate q and k per head, store k
    and v in the paged cache; return q.

    H is read from qkv's width: ``qkv.shape[1] // D - 2 * Hkv`` with Hkv from the
    cache. Returns q as a new dense (T, H, D) tensor in qkv's dtype; k and v are
    written to ``cache[slot // bs, slot % bs]`` (cast to the cache dtype; an FP8 cache:
    quantized by the scale, ``kernels/fp8.py``) and not returned. Positions and slots are not bounds-checked (that would sync the host).

    Raises:
        TypeError: a tensor has an unsupported dtype (weights must match qkv's,
            the table must be float32, positions/slots integer) or eps is not a number.
        ValueError: shapes disagree, D is not a power of two >= 2, a last dimension
            is strided, caches differ in shape or strides, devices differ, only
            one of the weights is None, or an FP8 cache comes without its scales.
    """
    has_norm = q_weight is not None or k_weight is not None
    if has_norm and (q_weight is None or k_weight is None):
        raise ValueError("q_weight and k_weight must both be tensors (q/k norm) or both None (RoPE only)")
    _check_args(qkv, positions, q_weight, k_weight, eps, cos_sin_cache, k_cache, v_cache, slot_mapping)
    k_scale, v_scale = check_kv_scales(k_cache, k_scale, v_scale)
    num_tokens = qkv.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = qkv.shape[1] // head_dim - 2 * num_kv_heads
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    half = head_dim // 2
    block_h = min(next_pow2(num_heads), max(1, _MAX_TILE // half))
    block_hkv = min(next_pow2(num_kv_heads), max(1, _MAX_TILE // half))
    _qk_norm_rope_store_kernel[(num_tokens,)](
        # Without norm the weight pointers are qkv's (loaded, in bounds, never used).
        qkv, positions, q_weight if has_norm else qkv, k_weight if has_norm else qkv, cos_sin_cache,
        q, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        float(eps), qkv.stride(0), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=block_h, BLOCK_HKV=block_hkv, HAS_NORM=has_norm, KV_FP8=is_fp8_cache(k_cache), EXACT_CAST=exact_cast(qkv),
        num_warps=4 if block_h * half >= 1024 else 1,
        # a*b - c*d as two rounded products, as eager torch computes RoPE.
        enable_fp_fusion=False,
    )
    return q


def _check_args(
    qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
    eps: float, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Validate the arguments of :func:`qk_norm_rope_store` (raises TypeError / ValueError);
    weights that are None (no norm) are not checked."""
    weights = {name: t for name, t in (("q_weight", q_weight), ("k_weight", k_weight)) if t is not None}
    check_dtype("qkv", qkv, _FLOAT_DTYPES)
    for name, t in weights.items():
        check_dtype(name, t, (qkv.dtype,))
    num_kv_heads, head_dim = check_rope_store_args(eps, positions, slot_mapping, cos_sin_cache, k_cache, v_cache,
                                                   qkv=qkv, **weights)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache must be (P, {head_dim}), got {tuple(cos_sin_cache.shape)}")
    for name, t in weights.items():
        if t.shape != (head_dim,):
            raise ValueError(f"{name} must be ({head_dim},), got {tuple(t.shape)}")
    width = qkv.shape[1] if qkv.dim() == 2 else -1
    if width % head_dim or width // head_dim <= 2 * num_kv_heads or num_kv_heads == 0:
        raise ValueError(f"qkv must be (T, (H + 2*Hkv) * D) with H >= 1, Hkv {num_kv_heads}, D {head_dim}; "
                         f"got {tuple(qkv.shape)}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.shape != qkv.shape[:1]:
            raise ValueError(f"{name} must be ({qkv.shape[0]},), got {tuple(t.shape)}")
