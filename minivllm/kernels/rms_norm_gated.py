"""The Gated DeltaNet's output norm: ``weight * rms_norm(x) * silu(gate)`` per head.

x and gate are (T, H, V) (the delta rule's output and the z slice of the input projection,
a strided view); the norm runs over each head's V values. Grid ``(T * cdiv(H, BLOCK_H),)``:
each program normalises BLOCK_H heads of one token. Rounding as the reference, step by step::

    n   = x / sqrt(mean(x^2) + eps)    statistics in fp32, rounded to x's dtype
    y   = weight * n                   rounded to the dtype of torch's ``weight * n``
    out = y * silu(gate)               fp32 (silu of the fp32 gate), rounded once to x's dtype

Why a kernel: the reference is about a dozen eager launches per linear-attention layer, each
a pass over (T, H, V); here one pass, and no host work beyond the launch.

Torch reference: :func:`minivllm.kernels.reference.rms_norm_gated_ref`.
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, check_last_dim_contiguous, check_same_device, next_pow2
from minivllm.kernels._norm_act import normalise

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Elements of one (BLOCK_H, BLOCK_V) tile: bounds registers at many heads.
_MAX_TILE = 2048


@triton.jit
def _rms_norm_gated_kernel(
    x_ptr, gate_ptr,                      # (T, H, V), last dim contiguous
    weight_ptr,                           # (V,)
    out_ptr,                              # (T, H, V) contiguous, x's dtype
    stride_xt, stride_xh, stride_gt, stride_gh,
    eps,
    NUM_HEADS: tl.constexpr, V: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr,  # powers of two
    ROUND_PRODUCT: tl.constexpr,          # torch's weight * n has x's dtype: round it there
):
    head_blocks: tl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    pid = tl.program_id(0)
    token = (pid // head_blocks).to(tl.int64)
    offs_h = (pid % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]   # (BLOCK_H, 1)
    offs_v = tl.arange(0, BLOCK_V)[None, :]                                    # (1, BLOCK_V)
    mask = (offs_h < NUM_HEADS) & (offs_v < V)
    x = tl.load(x_ptr + token * stride_xt + offs_h * stride_xh + offs_v, mask=mask, other=0.0)
    g = tl.load(gate_ptr + token * stride_gt + offs_h * stride_gh + offs_v, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + offs_v, mask=offs_v < V, other=0.0).to(tl.float32)
    x32 = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x32 * x32, axis=1) / V + eps)[:, None]        # (BLOCK_H, 1)
    y = normalise(x, w, rstd)
    if ROUND_PRODUCT:
        y = y.to(x.dtype).to(tl.float32)
    out = y * (g / (1.0 + tl.exp(-g)))
    tl.store(out_ptr + token * (NUM_HEADS * V) + offs_h * V + offs_v, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rms_norm(x) * silu(gate)`` over the last dimension; a new tensor like x.

    Args:
        x: (..., V) with a contiguous last dimension; rows may be strided views.
        gate: x's shape, any float dtype, a contiguous last dimension.
        weight: (V,).
        eps: added to the mean square.

    Raises:
        TypeError: a tensor that is not bf16, fp16 or fp32, or eps not a number.
        ValueError: shapes that disagree, a strided last dimension, or tensors on
            different devices.
    """
    _check_args(x, gate, weight, eps)
    v = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    # (..., H, V) as (T, H, V): a view wherever the leading dims are evenly strided.
    heads = x.shape[-2] if x.dim() >= 2 else 1
    x3, g3 = x.reshape(-1, heads, v), gate.reshape(-1, heads, v)
    block_v = next_pow2(v)
    block_h = min(next_pow2(heads), max(1, _MAX_TILE // block_v))
    grid = (x3.shape[0] * triton.cdiv(heads, block_h),)
    _rms_norm_gated_kernel[grid](
        x3, g3, weight, out, x3.stride(0), x3.stride(1), g3.stride(0), g3.stride(1), float(eps),
        NUM_HEADS=heads, V=v, BLOCK_H=block_h, BLOCK_V=block_v,
        ROUND_PRODUCT=torch.promote_types(x.dtype, weight.dtype) == x.dtype,
        num_warps=4 if block_h * block_v >= 1024 else 1,
    )
    return out


def _check_args(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """Validate the arguments of :func:`rms_norm_gated` (raises TypeError / ValueError)."""
    for name, t in (("x", x), ("gate", gate), ("weight", weight)):
        check_dtype(name, t, _FLOAT_DTYPES)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a number, got {type(eps).__name__}")
    for name, t in (("x", x), ("gate", gate)):
        check_last_dim_contiguous(name, t)
    if gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must be ({x.shape[-1]},), got {tuple(weight.shape)}")
    check_same_device(x=x, gate=gate, weight=weight)
