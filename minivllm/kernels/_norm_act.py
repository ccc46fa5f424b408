"""Device helpers of the norms and the gated activation, shared by the kernels that fuse them
(RMSNorm, the all-reduce + norm, the GEMV's input norm and SiLU-and-mul, the expert kernels);
this file launches nothing."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def weighted_rms_norm_row(x, w, eps, N: tl.constexpr):
    """``w * (x / sqrt(mean(x^2) + eps))`` of one row ``x`` (its own dtype, padded with
    zeros past N), ``w`` in fp32: statistics in fp32, the normalised value rounded to
    x's dtype before the weight multiply. Returns fp32 (the caller casts once)."""
    x32 = x.to(tl.float32)
    return normalise(x, w, tl.math.rsqrt(tl.sum(x32 * x32, axis=0) / N + eps))


@triton.jit
def unit_offset_rms_norm_row(x, w, eps, N: tl.constexpr):
    """``(1 + w) * (x / sqrt(mean(x^2) + eps))`` of one row ``x`` (zero padded past N), ``w``
    in fp32: the zero-centred norm of Qwen3.5, all in fp32 with no rounding between (the
    caller casts once), as transformers' Qwen3_5RMSNorm."""
    x32 = x.to(tl.float32)
    return normalise_unit_offset(x, w, tl.math.rsqrt(tl.sum(x32 * x32, axis=0) / N + eps))


@triton.jit
def normalise(x, w, rstd):
    """``w * (x * rstd)`` for x in its own dtype, w and rstd in fp32: the normalised value
    rounded to x's dtype before the weight multiply (the rounding of Hugging Face's
    Qwen3RMSNorm). Returns fp32."""
    return w * (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)


@triton.jit
def normalise_unit_offset(x, w, rstd):
    """``(1 + w) * (x * rstd)`` for x in its own dtype, w and rstd in fp32, with no rounding
    between (``unit_offset_rms_norm_row``'s given its ``rstd``). Returns fp32."""
    return (x.to(tl.float32) * rstd) * (1.0 + w)


@triton.jit
def add_residual(x, r):
    """``x + r`` rounded once to x's dtype, as torch's add in that dtype (the new residual
    stream)."""
    return (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)


@triton.jit
def gated_silu(gate, up, dtype: tl.constexpr):
    """``silu(gate) * up`` rounded to ``dtype`` as ``silu_and_mul.py``'s doc says (the activation kernel,
    the GEMV that applies it to its input and the expert kernels: the same bits everywhere)."""
    gate = gate.to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(dtype)
