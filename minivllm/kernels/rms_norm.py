"""RMSNorm of each row, optionally after adding the residual stream to it.

One program per row (token); the whole row sits in registers (hidden sizes up to
``MAX_HIDDEN``). With a residual::

    s   = x + residual                   rounded to x's dtype: the new residual stream
    out = w * (s / sqrt(mean(s^2) + eps))  statistics in fp32, normalised value rounded
                                           to x's dtype before the weight multiply

so it rounds where Hugging Face's Qwen3RMSNorm and ``residual + hidden_states`` do.

The zero-centred norm of Qwen3.5 (:func:`rms_norm_1p`, ``UNIT_OFFSET``) scales by ``1 + w``
and rounds once, as transformers' Qwen3_5RMSNorm does::

    out = ((s / sqrt(mean(s^2) + eps)) * (1 + w))   all in fp32, rounded once to x's dtype

Why a kernel and not ``torch.compile``: with dynamic shapes the compiled function costs
more host time per call (guards, symbolic sizes) than this launch
(``benchmarks/launch_overhead.py`` compares the two), and a prefill step calls it at least
twice a layer outside any CUDA graph, where the host time, not the GPU's, sets the step's
length.

Torch references: :func:`minivllm.kernels.reference.rms_norm_ref`,
:func:`minivllm.kernels.reference.add_rms_norm_ref` and their ``_1p`` twins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, check_same_device, next_pow2, takes_pdl
from minivllm.kernels._norm_act import add_residual, unit_offset_rms_norm_row, weighted_rms_norm_row

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HIDDEN = 16384


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr,                  # (T, N); residual read when HAS_RESIDUAL
    weight_ptr,                           # (N,)
    out_ptr, residual_out_ptr,            # (T, N) contiguous; residual_out written when HAS_RESIDUAL
    stride_x, stride_r,                   # row strides of x and residual (last dim contiguous)
    eps,
    N: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,            # zero-centred weight: scale by 1 + w (Qwen3.5)
    SIGNAL_NEXT: tl.constexpr,            # programmatic dependent launch: let the next kernel start
):
    if SIGNAL_NEXT:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = add_residual(x, r)
        tl.store(residual_out_ptr + row * N + offs, x, mask=mask)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        y = unit_offset_rms_norm_row(x, w, eps, N)
    else:
        y = weighted_rms_norm_row(x, w, eps, N)
    tl.store(out_ptr + row * N + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             pdl: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norm(x)``, or with ``residual`` ``(norm(x + residual), x + residual)``.

    Args:
        x: (..., N) with a contiguous last dimension.
        weight: (N,); the output has the dtype torch's ``weight * x`` would have.
        eps: added to the mean square.
        residual: like ``x`` (same shape and dtype), or None.
        pdl: let the next kernel start early where the device allows programmatic
            dependent launch.

    Raises:
        TypeError: a tensor that is not floating point (bf16, fp16, fp32).
        ValueError: shapes that disagree, a strided last dimension, a hidden size
            above ``MAX_HIDDEN``, or tensors on different devices.
    """
    return _launch(x, weight, eps, residual, pdl, unit_offset=False)


def rms_norm_1p(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
                pdl: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The zero-centred norm ``(1 + weight) * x / rms(x)`` (Qwen3.5), or with ``residual``
    ``(norm_1p(x + residual), x + residual)``; the output in x's dtype, rounded once.

    Arguments and errors as :func:`rms_norm`'s.
    """
    return _launch(x, weight, eps, residual, pdl, unit_offset=True)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, pdl: bool,
            unit_offset: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Check the arguments and run one program per row of ``x`` (..., N)."""
    _check_args(x, weight, residual)
    n = x.shape[-1]
    rows = x.reshape(-1, n)  # a view wherever rows are evenly strided
    # The plain norm's output has the dtype torch's ``weight * x`` would have; the
    # zero-centred one's is x's (its reference rounds the fp32 product to x's dtype).
    out_dtype = x.dtype if unit_offset else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    res_rows = residual.reshape(-1, n) if residual is not None else rows
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else out
    if rows.shape[0]:
        block = next_pow2(n)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res_rows, weight, out, res_out, rows.stride(0), res_rows.stride(0), float(eps),
            N=n, BLOCK_N=block, HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset,
            SIGNAL_NEXT=takes_pdl(pdl, x), num_warps=max(1, min(16, block // 256)),
        )
    return out if residual is None else (out, res_out)


def _check_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    """Validate the arguments of :func:`rms_norm` and :func:`rms_norm_1p` (raises TypeError / ValueError)."""
    check_dtype("x", x, _FLOAT_DTYPES)
    check_dtype("weight", weight, _FLOAT_DTYPES)
    if x.dim() == 0 or x.stride(-1) != 1:
        raise ValueError(f"x must have a contiguous last dimension, got shape {tuple(x.shape)} strides {x.stride()}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must be ({x.shape[-1]},), got {tuple(weight.shape)}")
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"hidden size {x.shape[-1]} exceeds the kernel's MAX_HIDDEN {MAX_HIDDEN}")
    if residual is not None:
        check_dtype("residual", residual, (x.dtype,))
        if residual.shape != x.shape or residual.stride(-1) != 1:
            raise ValueError(f"residual must be like x {tuple(x.shape)} with a contiguous last dimension, "
                             f"got {tuple(residual.shape)} strides {residual.stride()}")
        check_same_device(x=x, weight=weight, residual=residual)
    else:
        check_same_device(x=x, weight=weight)
