"""Dynamic e4m3 quantization of activations x (M, K), once, for a GEMM that then reads 8-bit
x: one float32 scale per token and 128-column group ("block" mode, the activations of
128x128 block-scaled weights) or per token over its whole row ("channel" mode), by the rule
of ``kernels/fp8.py`` (``scale = max(amax, AMAX_FLOOR) / 448``, ``e4m3(clamp(v / scale))``
through the correctly rounded reciprocal)::

    program (row, g)   grid: M x cdiv(K, 128) ("block"); M x 1 ("channel")

    block:   xt = x[row, g*128 : (g+1)*128]       s = amax(|xt|) / 448
             q[row, cols] = e4m3(xt * (1 / s))    scales[row, g] = s
    channel: a first pass over the row for its amax, then the same per 128 columns

The FP8 GEMM (``kernels/fp8_gemm.py``) takes x from here: quantized once, not inside its K
loop once per column program, which on an H200 was slower (docs/tuning.md, "FP8").

Torch reference: :func:`minivllm.kernels.fp8.quantize_fp8_per_token_group` ("block") and
:func:`minivllm.kernels.fp8.quantize_fp8_per_token` ("channel").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, check_last_dim_contiguous
from minivllm.kernels.fp8 import (
    AMAX_FLOOR, FP8_DTYPE, FP8_E4M3_MAX, FP8_GROUP, ScaleMode, check_scale_mode, e4m3_scales, exact_cast,
    quantize_e4m3,
)

_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _quantize_kernel(
    x_ptr,                    # (M, K) bf16/fp16, last dim contiguous
    q_ptr,                    # (M, K) float8e4nv contiguous
    s_ptr,                    # PER_GROUP: (M, cdiv(K, GROUP)) float32; else (M, 1)
    K, stride_xm,
    PER_GROUP: tl.constexpr,  # one scale per 128 columns ("block"); else one per row
    GROUP: tl.constexpr,
    EXACT_CAST: tl.constexpr,
):
    # The row as a (1, GROUP) tile, so fp8.py's scale and rounding helpers apply as to a GEMM's tiles.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, GROUP)[None, :]
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * K
    if PER_GROUP:
        k = tl.program_id(1) * GROUP + offs
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        scale, inv = e4m3_scales(tl.max(tl.abs(x), axis=1))                    # (1,)
        tl.store(q_row + k, quantize_e4m3(x, inv[:, None], EXACT_CAST), mask=k < K)
        tl.store(s_ptr + row * tl.cdiv(K, GROUP) + tl.program_id(1) + tl.arange(0, 1), scale)
    else:
        amax = tl.zeros((1,), tl.float32)
        for k0 in range(0, K, GROUP):
            k = k0 + offs
            amax = tl.maximum(amax, tl.max(tl.abs(tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)), axis=1))
        scale, inv = e4m3_scales(amax)
        for k0 in range(0, K, GROUP):
            k = k0 + offs
            x = tl.load(x_row + k, mask=k < K, other=0.0)
            tl.store(q_row + k, quantize_e4m3(x, inv[:, None], EXACT_CAST), mask=k < K)
        tl.store(s_ptr + row + tl.arange(0, 1), scale)


def quantize_activations(x: torch.Tensor, mode: ScaleMode) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, scales)`` of activations x (M, K): e4m3 values (M, K) and float32 scales,
    (M, cdiv(K, 128)) for "block", (M, 1) for "channel" (module doc).

    Raises:
        TypeError: x not bf16/fp16.
        ValueError: x not 2-D, a strided last dimension, or an unknown mode.
    """
    check_dtype("x", x, _DTYPES)
    check_scale_mode(mode)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (M, K), got shape {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    m, k = x.shape
    groups = triton.cdiv(k, FP8_GROUP)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(m, groups if mode == "block" else 1, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scales.fill_(AMAX_FLOOR / FP8_E4M3_MAX)
    _quantize_kernel[(m, groups if mode == "block" else 1)](
        x, q, scales, k, x.stride(0), PER_GROUP=mode == "block", GROUP=FP8_GROUP, EXACT_CAST=exact_cast(x))
    return q, scales
