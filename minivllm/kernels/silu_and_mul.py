"""The gated activation of the MLP: ``silu(gate) * up`` for ``x = [gate | up]``.

Grid ``(T, cdiv(I, BLOCK))``: each program reads BLOCK gates and the BLOCK ups
I columns to their right, and writes BLOCK outputs. Rounding as torch in x's
dtype: ``silu(gate)`` computed in fp32 as ``g / (1 + exp(-g))`` and rounded, then
multiplied by ``up`` and rounded (Hugging Face's ``act_fn(gate) * up``).

Why a kernel and not ``torch.compile``: with dynamic shapes the compiled function costs
more host time per call than this launch, and its kernel streams far below copy bandwidth
(``benchmarks/launch_overhead.py`` compares the host times).

Torch reference: :func:`minivllm.kernels.reference.silu_and_mul_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, next_pow2, takes_pdl
from minivllm.kernels._norm_act import gated_silu

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,                                # (T, 2I), last dim contiguous
    out_ptr,                              # (T, I) contiguous
    stride_x,
    I: tl.constexpr, BLOCK: tl.constexpr,
    SIGNAL_NEXT: tl.constexpr,            # programmatic dependent launch: let the next kernel start
):
    if SIGNAL_NEXT:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * I + cols, gated_silu(gate, up, out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x`` (..., 2I); returns (..., I) in x's dtype.
    ``pdl``: let the next kernel start early where the device allows programmatic dependent
    launch.

    Raises:
        TypeError: x is not floating point (bf16, fp16, fp32).
        ValueError: an odd last dimension, or a strided one.
    """
    check_dtype("x", x, _FLOAT_DTYPES)
    if x.dim() == 0 or x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be (..., 2I) with a contiguous last dimension, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    inner = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty((*x.shape[:-1], inner), dtype=x.dtype, device=x.device)
    if rows.shape[0] and inner:
        block = min(1024, next_pow2(inner))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inner, block))](
            rows, out, rows.stride(0), I=inner, BLOCK=block, SIGNAL_NEXT=takes_pdl(pdl, x),
            num_warps=4 if block >= 512 else 1)
    return out
