"""Device functions shared by the GEMV kernels (``kernels/gemv.py``, ``kernels/fp8_gemv.py``,
``kernels/moe_gemv.py``); this file launches nothing.

A GEMV program streams a block of W's rows in K steps and keeps fp32 products on the CUDA
cores (or the tensor cores, a few rows of x at a time). The input row it multiplies may be
computed as the W tiles stream: x itself, ``silu(gate) * up`` of x = [gate | up] (the
SiLU-and-mul kernel's ``gated_silu``, so its bits), or RMSNorm(x + residual) from the row's
``rstd`` (the RMSNorm kernel's ``add_residual`` and ``normalise``, so its rounding).
"""

from __future__ import annotations

import triton
import triton.language as tl

from minivllm.kernels._norm_act import add_residual, normalise, normalise_unit_offset
from minivllm.kernels._norm_act import gated_silu


@triton.jit
def w_tile(w_rows, k, col_ok, K, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """This program's (BLOCK_N, BLOCK_K) tile of W at columns ``k``."""
    if EVEN_N and EVEN_K:
        w = tl.load(w_rows + k[None, :])
    else:
        w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & (k < K)[None, :], other=0.0)
    return w


@triton.jit
def masked_load(ptrs, mask):
    """``ptrs``' values, 0 where ``mask`` is False (``mask`` None: every one)."""
    if mask is None:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def x_cols(x_ptrs, k, mask, K, GATED: tl.constexpr):
    """x at columns ``k`` (0 where masked off); GATED: silu(gate) * up of x = [gate | up], gate
    at columns ``k`` and up K columns to the right, rounded as the SiLU-and-mul kernel rounds."""
    x = masked_load(x_ptrs + k, mask)
    if GATED:
        x = gated_silu(x, masked_load(x_ptrs + K + k, mask), x.dtype)
    return x


@triton.jit
def one_row_input(x_ptr, r_ptr, nw_ptr, rstd, k, mask, K, GATED: tl.constexpr, NORM: tl.constexpr,
                  HAS_RESIDUAL: tl.constexpr):
    """The input row at columns ``k``: x, silu(gate) * up (GATED), or NORM: the RMSNorm kernel's
    output for ``x + residual`` given its ``rstd`` (the same rounding: ``rms_norm.normalise``;
    NORM == 2: the zero-centred norm's, ``normalise_unit_offset``)."""
    if NORM:
        s = residual_sum(x_ptr, r_ptr, k, mask, HAS_RESIDUAL)
        w = masked_load(nw_ptr + k, mask).to(tl.float32)
        if NORM == 2:
            x = normalise_unit_offset(s, w, rstd).to(s.dtype)
        else:
            x = normalise(s, w, rstd).to(s.dtype)
    else:
        x = x_cols(x_ptr, k, mask, K, GATED)
    return x


@triton.jit
def residual_sum(x_ptr, r_ptr, k, mask, HAS_RESIDUAL: tl.constexpr):
    """x at columns ``k``, or ``x + residual`` rounded as the RMSNorm kernel rounds it
    (``rms_norm.add_residual``)."""
    x = masked_load(x_ptr + k, mask)
    if HAS_RESIDUAL:
        x = add_residual(x, masked_load(r_ptr + k, mask))
    return x


@triton.jit
def input_rstd(x_ptr, r_ptr, r_out_ptr, K, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """``1 / sqrt(mean(s^2) + eps)`` of the row s = x [+ residual] (fp32 sums, BLOCK columns a
    step; every program computes it, from L2). HAS_RESIDUAL: program 0 also writes s to r_out,
    a buffer no program reads (the new residual stream)."""
    sq = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        s = residual_sum(x_ptr, r_ptr, k, k < K, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            if tl.program_id(0) == 0:
                tl.store(r_out_ptr + k, s, mask=k < K)
        s32 = s.to(tl.float32)
        sq += s32 * s32
    return tl.math.rsqrt(tl.sum(sq, axis=0) / K + eps)
