"""``y = x W^T`` with 8-bit weights and activations: W (N, K) float8_e4m3fn with its scales,
x (M, K) bf16/fp16 quantized to e4m3 first (dynamic, per token: ``kernels/fp8_quant.py``), fp32
accumulation, y (M, N) in x's dtype rounded once. Scales as ``kernels/fp8.py`` defines them
(``v ~= v_fp8 * scale``; ``scale = max(amax, AMAX_FLOOR) / 448``)::

    xq, xs = quantize_activations(x)    e4m3 (M, K); float32 (M, cdiv(K, 128)) block, (M, 1) channel

    program (i, j) (grid: cdiv(M, BLOCK_M) x cdiv(N, BLOCK_N)) owns y[rows i, cols j]

    for each 128-column group g of K:
        d    = xq[rows, g] @ W[cols, g]^T        (BLOCK_M, BLOCK_N) fp8 x fp8 -> fp32
        acc += d * xs[rows, g][:, None] * s[cols // 128, g][None, :]     block: 128x128 scale_inv

    channel mode: the loop adds up d unscaled (in float32, group by group) and the epilogue multiplies by
    xs[rows][:, None] * s[cols][None, :] once.

x is quantized once, in a launch of its own, not inside the K loop of every column program
(cdiv(N, BLOCK_N) times over): that in-loop road adds a few ALU ops per element beside the
tensor-core dot and lost on an H200 at every size swept (docs/tuning.md, "FP8"; the
experiment: ``lab/fp8_gemm_in_loop.py`` and its line in ``lab/README.md``).

The fp8 ``tl.dot`` needs fp8 tensor cores (compute capability 8.9 or later). The
interpreter's ``tl.dot`` of fp8 operands widens them exactly, so the dot itself needs no
workaround on the CPU.

``scaled_mm_fp8``: the same product through ``torch._scaled_mm``, to hold the kernel against
on a GPU. What ``_scaled_mm`` takes in torch 2.13 (CUDA as aten/src/ATen/native/cuda/
ScaledBlas.cpp checks it; the CPU build as tried): per-tensor and row-wise scales on the
CPU and on CUDA (compute capability 8.9 or >= 9.0); 1x128-by-128x128 block scales on CUDA
only, through cuBLASLt (Hopper, cuBLAS >= 12.9; the 1x128 scales outer-dim-major, no fast
accumulation). On CUDA, K and N must be multiples of 16 in every mode. The CPU refuses
block scales ("Invalid scaling configuration").

Torch reference: :func:`minivllm.kernels.reference.fp8_gemm_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minivllm.kernels._gemm_tiles import wt_tile, x_tile
from minivllm.kernels._launch import check_dtype, check_last_dim_contiguous, check_same_device, check_tile_config
from minivllm.kernels.fp8 import (
    FP8_DTYPE, FP8_GROUP, ScaleMode, check_scale_mode, quantize_fp8_per_token, quantize_fp8_per_token_group,
)
from minivllm.kernels.fp8_quant import quantize_activations

_DTYPES = (torch.bfloat16, torch.float16)
# cuBLASLt's block-scaled GEMM (torch 2.11, CUDA 13, H200) refused one row of x
# (CUBLAS_STATUS_NOT_SUPPORTED) and took 16 and 300: fewer rows are padded with zeros.
_SCALED_MM_MIN_ROWS = 16


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Tile and launch parameters (a tuning knob, not semantics). The reduction step is the
    128-column activation group. Defaults: :func:`default_config`."""

    block_m: int = 64         # rows of x per program; power of two >= 16
    block_n: int = 64         # output columns (W rows) per program; power of two >= 16
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        check_tile_config(self, ("block_m", "block_n"))


# Swept on an H200 at Qwen3-0.6B and -8B shapes, both scale modes (docs/tuning.md, "FP8"):
# above 64 rows 64 x 128 tiles were near the fastest at every shape.
MANY_ROWS_CONFIG = Fp8GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=3)


def default_config(rows: int) -> Fp8GemmConfig:
    """The tiles for ``rows`` rows of x: up to 64 the smallest row block (16, 32 or 64) that
    holds them and 64 columns, above it ``MANY_ROWS_CONFIG``."""
    if rows > 64:
        return MANY_ROWS_CONFIG
    return Fp8GemmConfig(block_m=16 if rows <= 16 else 32 if rows <= 32 else 64)


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,                  # (M, K) e4m3, contiguous: x quantized (fp8_quant.quantize_activations)
    xs_ptr,                 # x's float32 scales, (M, cdiv(K, GROUP)) (BLOCK_SCALES) or (M, 1)
    w_ptr,                  # (N, K) float8e4nv contiguous
    ws_ptr,                 # BLOCK_SCALES: (cdiv(N, GROUP), cdiv(K, GROUP)) float32; else (N,) float32
    y_ptr,                  # (M, N) contiguous, the unquantized x's dtype
    M, N, K,
    stride_xm,
    BLOCK_SCALES: tl.constexpr,  # 128x128 weight blocks with per-group activation scales; else per channel
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm              # (BLOCK_M, 1)
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * K                      # (1, BLOCK_N): W^T tiles
    offs_k = tl.arange(0, GROUP)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if BLOCK_SCALES:
        ws_rows = ws_ptr + (cols // GROUP) * tl.cdiv(K, GROUP)           # (BLOCK_N,)
        for k0 in range(0, K, GROUP):
            xq = x_tile(x_rows, k0 + offs_k, row_ok, K)
            xs = tl.load(xs_ptr + rows * tl.cdiv(K, GROUP) + k0 // GROUP, mask=row_ok, other=0.0)
            d = tl.dot(xq, wt_tile(w_cols, k0 + offs_k, col_ok, K))
            ws = tl.load(ws_rows + k0 // GROUP, mask=col_ok, other=0.0)
            acc += d * xs[:, None] * ws[None, :]
    else:
        for k0 in range(0, K, GROUP):
            # Added in float32 per group, not accumulated inside the dot: Hopper's fp8 MMA
            # accumulates with fewer bits than float32, which over all of a long K (8B's down
            # projection, K = 12288) put outputs 0.03 off (docs/tuning.md, "FP8").
            acc += tl.dot(x_tile(x_rows, k0 + offs_k, row_ok, K), wt_tile(w_cols, k0 + offs_k, col_ok, K))
        xs = tl.load(xs_ptr + rows, mask=row_ok, other=0.0)
        acc = acc * xs[:, None] * tl.load(ws_ptr + cols, mask=col_ok, other=0.0)[None, :]
    out = y_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, mode: ScaleMode,
             config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """``x @ W^T`` (M, N) in x's dtype for fp8 W with scales of ``mode`` (module doc), x
    quantized per token (and 128-column group in block mode) first.

    Args:
        x: (M, K) bf16 / fp16 with a contiguous last dimension.
        weight: (N, K) float8_e4m3fn, contiguous.
        weight_scale: float32, contiguous: "block": (cdiv(N, 128), cdiv(K, 128)), a checkpoint's
            ``weight_scale_inv``; "channel": (N,).
        mode: "block" or "channel".
        config: tiles (None: ``default_config(M)``).

    Raises:
        TypeError: x not bf16/fp16, weight not float8_e4m3fn, or weight_scale not float32.
        ValueError: an unknown mode, shapes that disagree (the scale's for its mode), a
            strided or non-contiguous operand, or tensors on different devices.
    """
    check_args(x, weight, weight_scale, mode)
    config = config or default_config(x.shape[0])
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    xq, x_scales = quantize_activations(x, mode)
    _fp8_gemm_kernel[(triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n))](
        xq, x_scales, weight, weight_scale, y, m, n, k, xq.stride(0),
        BLOCK_SCALES=mode == "block", BLOCK_M=config.block_m, BLOCK_N=config.block_n, GROUP=FP8_GROUP,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y


def scaled_mm_fp8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  mode: ScaleMode) -> torch.Tensor:
    """What :func:`fp8_gemm` computes, through ``torch._scaled_mm``: x quantized in torch as the
    kernel quantizes it, then the vendor scaled GEMM (arguments as :func:`fp8_gemm`'s).

    Raises:
        TypeError, ValueError: as :func:`fp8_gemm`.
        NotImplementedError: block scales off CUDA, where ``_scaled_mm`` has no block-wise
            mode (module doc); on CUDA, torch raises where the device or cuBLAS lacks it.
    """
    check_args(x, weight, weight_scale, mode)
    rows = x.shape[0]
    if mode == "block":
        if x.device.type != "cuda":
            raise NotImplementedError(f"torch._scaled_mm scales 1x128 x 128x128 blocks on CUDA only (cuBLASLt, "
                                      f"Hopper); on {x.device.type} it takes per-tensor and row-wise scales")
        # One row's (1, K/128) scales read as row-major, refused: fewer rows are padded.
        padded = F.pad(x, (0, 0, 0, max(_SCALED_MM_MIN_ROWS - rows, 0)))
        x_fp8, x_scale = quantize_fp8_per_token_group(padded)
        # (M, cdiv(K, 128)) outer-dim-major, and W's (cdiv(N, 128), cdiv(K, 128)) seen from W^T.
        scale_a, scale_b = x_scale.t().contiguous().t(), weight_scale.t()
    else:
        x_fp8, scale_a = quantize_fp8_per_token(x)
        scale_b = weight_scale[None, :]
    return torch._scaled_mm(x_fp8, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=x.dtype)[:rows]


def check_args(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, mode: ScaleMode) -> None:
    """Validate an FP8 product's x (M, K), fp8 weight (N, K) and its float32 scale of ``mode``
    (raises as :func:`fp8_gemm` says); shared with the one-row GEMV."""
    check_dtype("x", x, _DTYPES)
    check_dtype("weight", weight, (FP8_DTYPE,))
    check_dtype("weight_scale", weight_scale, (torch.float32,))
    check_scale_mode(mode)
    if x.dim() != 2:
        raise ValueError(f"x must be (M, K), got shape {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    k = x.shape[1]
    if weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous (N, {k}), got shape {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    n = weight.shape[0]
    want = (triton.cdiv(n, FP8_GROUP), triton.cdiv(k, FP8_GROUP)) if mode == "block" else (n,)
    if tuple(weight_scale.shape) != want or not weight_scale.is_contiguous():
        raise ValueError(f"weight_scale of mode {mode!r} must be a contiguous {want}, got shape "
                         f"{tuple(weight_scale.shape)} strides {weight_scale.stride()}")
    check_same_device(x=x, weight=weight, weight_scale=weight_scale)
