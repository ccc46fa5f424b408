"""``y = x W^T`` for one row of x (batch 1) with fp8 weights: W (N, K) float8_e4m3fn read as
8-bit values and dequantized in registers with its scales (``kernels/fp8.py``:
``w ~= w_fp8 * scale``), x (1, K) bf16/fp16 used as it is, fp32 products, y (1, N) in x's
dtype rounded once. The one-row path of ``kernels/gemv.py`` (``_one_row``) at a byte a weight::

    program p (grid: cdiv(N, BLOCK_N)) owns output columns [p*BLOCK_N, (p+1)*BLOCK_N)

    W rows of p   ##########....##########   BLOCK_N x K fp8, read in BLOCK_K steps
    scales        block: s[cols // 128, k // 128] beside each weight (a tile touches
                  BLOCK_N * BLOCK_K / 128 of them: L1 hits); channel: s[cols], after the sum
    x (1 row)     ----------....----------   bf16/fp16, re-read from L2 by every program
    acc (fp32)    BLOCK_N x BLOCK_K  += (w * s) * x          summed over K at the end

Why x is not quantized: batch 1 is bound by the weight bytes; x is K values against N x K
weights, so 16-bit x costs nothing measurable, and it keeps the products as accurate as the
weights allow (no activation rounding on top of the weights').

In block mode each weight is dequantized as the reference dequantizes it (one fp32
product), so the two differ only in the order of the fp32 sum.

The input may be computed as the W tiles stream, as the 16-bit one-row GEMV computes it
(the helpers of ``kernels/_gemv_tiles.py``, so the same rounding): ``gated``, ``silu(gate) * up`` of
x = [gate | up] (the MLP's down projection without an activation launch), or, through
:func:`rms_norm_fp8_gemv`, RMSNorm(x + residual) (a decode layer's residual add and norm
without a launch of their own; program 0 writes x + residual as the new residual stream). With ``pdl=True`` the first
W tile loads before ``griddepcontrol.wait`` and the next kernel may start after the K loop,
as in ``kernels/gemv.py`` (its module doc; ``_launch.pdl_supported``).

Tiles by W's height (``default_config``), from a sweep on an H200 (docs/tuning.md, "FP8"). With
block scales a tile's scales are loaded per row and 128-column group, never per element.

Torch reference: :func:`minivllm.kernels.reference.fp8_gemv_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minivllm.kernels._fp8_tiles import scaled_tile
from minivllm.kernels._gemv_tiles import input_rstd, one_row_input, w_tile
from minivllm.kernels._launch import check_dtype, check_power_of_two, check_tile_config, next_pow2, takes_pdl
from minivllm.kernels.fp8 import FP8_GROUP, ScaleMode
from minivllm.kernels.fp8_gemm import check_args
from minivllm.kernels.gemv import NORM_BLOCK_MAX


@dataclass(frozen=True)
class Fp8GemvConfig:
    """Tile and launch parameters (a tuning knob, not semantics). Defaults by W's height:
    :func:`default_config`."""

    block_n: int = 16         # output columns (W rows) per program; power of two >= 1
    block_k: int = 512        # reduction step; power of two >= 16
    num_warps: int = 4
    num_stages: int = 3       # W tiles in flight per program (tl.range pipelining)

    def __post_init__(self) -> None:
        check_power_of_two("block_n", self.block_n)
        check_tile_config(self, ("block_k",))


# Swept on an H200 at Qwen3-0.6B and -8B shapes (docs/tuning.md, "FP8"), the same in both
# scale modes: 512 columns a step; a narrow W (N <= 2048: 0.6B's o and down, 1024 rows) wants
# more, narrower programs and deeper pipelining, a wide one 16 columns a program.
NARROW_MAX_N = 2048
NARROW_CONFIG = Fp8GemvConfig(block_n=4, block_k=512, num_warps=4, num_stages=5)
WIDE_CONFIG = Fp8GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=3)


def default_config(n: int) -> Fp8GemvConfig:
    """The tiles for a W of ``n`` rows (output columns)."""
    return NARROW_CONFIG if n <= NARROW_MAX_N else WIDE_CONFIG


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,                       # (1, K) bf16/fp16, contiguous
    w_ptr,                       # (N, K) float8e4nv contiguous
    ws_ptr,                      # BLOCK_SCALES: (cdiv(N, GROUP), cdiv(K, GROUP)) float32; else (N,) float32
    y_ptr,                       # (1, N) x's dtype
    r_ptr,                       # NORM + HAS_RESIDUAL: the residual stream (1, K) added to x; else unread
    r_out_ptr,                   # NORM + HAS_RESIDUAL: (1, K) receives x + residual (program 0); else unwritten
    nw_ptr,                      # NORM: the RMSNorm weight (K,); else unread
    N, K,
    eps,                         # NORM: the RMSNorm epsilon
    BLOCK_SCALES: tl.constexpr,  # 128x128 weight blocks; else per output channel
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    NUM_STAGES: tl.constexpr,    # loads in flight (tl.range pipelining)
    PDL: tl.constexpr,           # launched with launch_pdl: first W tile, wait, ..., signal after the K loop
    GATED: tl.constexpr,         # the input is silu(gate) * up of x = [gate | up]
    NORM: tl.constexpr,          # the input is RMSNorm(x [+ residual]) (see rms_norm_fp8_gemv)
    HAS_RESIDUAL: tl.constexpr,  # NORM: add the residual first, and write the sum to r_out
    NORM_BLOCK: tl.constexpr,    # NORM: columns per step of the statistics pass
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K                  # (BLOCK_N, 1)
    ws_rows = ws_ptr + (cols // GROUP) * tl.cdiv(K, GROUP)           # BLOCK_SCALES: (BLOCK_N,)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    rstd = 0.0
    k_start = 0
    if PDL or NORM:  # W's first tile loads before the wait (PDL) or during the statistics pass (NORM)
        w = w_tile(w_rows, offs_k, col_ok, K, EVEN_N, EVEN_K)
        if PDL:
            tl.extra.cuda.gdc_wait()
        if NORM:
            rstd = input_rstd(x_ptr, r_ptr, r_out_ptr, K, eps, HAS_RESIDUAL, NORM_BLOCK)
        acc = _scaled_product(w, ws_rows, x_ptr, r_ptr, nw_ptr, rstd, 0, offs_k, col_ok, K, acc, BLOCK_SCALES,
                              EVEN_K, GROUP, GATED, NORM, HAS_RESIDUAL)
        k_start = BLOCK_K
    for k0 in tl.range(k_start, K, BLOCK_K, num_stages=NUM_STAGES):
        w = w_tile(w_rows, k0 + offs_k, col_ok, K, EVEN_N, EVEN_K)
        acc = _scaled_product(w, ws_rows, x_ptr, r_ptr, nw_ptr, rstd, k0, k0 + offs_k, col_ok, K, acc,
                              BLOCK_SCALES, EVEN_K, GROUP, GATED, NORM, HAS_RESIDUAL)
    if PDL:  # W is streamed: the next GEMV may load its first tile during this one's stores
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=1)                                           # (BLOCK_N,)
    if not BLOCK_SCALES:
        y *= tl.load(ws_ptr + cols, mask=col_ok, other=0.0)
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _scaled_product(w, ws_rows, x_ptr, r_ptr, nw_ptr, rstd, k0, k, col_ok, K, acc, BLOCK_SCALES: tl.constexpr,
                    EVEN_K: tl.constexpr, GROUP: tl.constexpr, GATED: tl.constexpr,
                    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """``acc + w' * x[k]`` for the fp8 tile ``w`` at columns ``k`` = k0 + (0..BLOCK_K)
    (``scaled_tile``), x the input row as GATED / NORM make it (``one_row_input``)."""
    mask = None if EVEN_K else k < K
    x = one_row_input(x_ptr, r_ptr, nw_ptr, rstd, k, mask, K, GATED, NORM, HAS_RESIDUAL)
    return acc + scaled_tile(w, ws_rows, k0, col_ok, K, BLOCK_SCALES, GROUP) * x.to(tl.float32)[None, :]


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, mode: ScaleMode,
             config: Fp8GemvConfig | None = None, *, gated: bool = False, pdl: bool = False) -> torch.Tensor:
    """``x @ W^T`` (1, N) in x's dtype for one row x (1, K) and fp8 W with scales of ``mode``
    (arguments as :func:`minivllm.kernels.fp8_gemm.fp8_gemm`'s; ``config`` None:
    ``default_config(N)``). ``gated``: x is (1, 2K) = [gate | up] and the input is
    ``silu(gate) * up`` (the SiLU-and-mul kernel's rounding). ``pdl``: take part in
    programmatic dependent launch where the device allows it; the same bits either way.

    Raises:
        TypeError: x not bf16/fp16, weight not float8_e4m3fn, or weight_scale not float32.
        ValueError: more than one row, an odd gated width, or anything ``fp8_gemm`` refuses.
    """
    inner = x
    if gated:
        if x.dim() != 2 or x.shape[-1] % 2:
            raise ValueError(f"gated x must be (1, 2K) = [gate | up], got shape {tuple(x.shape)}")
        inner = x[:, : x.shape[1] // 2]
    _check_one_row(inner, weight, weight_scale, mode)
    y = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, weight, weight_scale, mode, y, config, gated=gated, pdl=pdl)
    return y


def rms_norm_fp8_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, weight_scale: torch.Tensor, mode: ScaleMode,
                      config: Fp8GemvConfig | None = None, *, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8_gemv(rms_norm(s)), s)`` for one row x (1, K) and s = x + residual (residual None:
    s = x), in one kernel, as :func:`minivllm.kernels.gemv.rms_norm_gemv` does for 16-bit
    weights (the RMSNorm kernel's rounding; s a new tensor, x itself without a residual).

    Raises:
        TypeError / ValueError: as :func:`fp8_gemv`, or a residual not like x, or a norm weight
            not a contiguous (K,) of x's dtype.
    """
    _check_one_row(x, weight, weight_scale, mode)
    check_dtype("norm_weight", norm_weight, (x.dtype,))
    if norm_weight.shape != (x.shape[1],) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight must be a contiguous ({x.shape[1]},), got shape {tuple(norm_weight.shape)}")
    if residual is not None:
        check_dtype("residual", residual, (x.dtype,))
        if residual.shape != x.shape or residual.stride(1) != 1:
            raise ValueError(f"residual must be like x {tuple(x.shape)}, got shape {tuple(residual.shape)} "
                             f"strides {residual.stride()}")
    y = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
    s = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x
    _launch(x, weight, weight_scale, mode, y, config, norm=(norm_weight, float(eps), residual, s), pdl=pdl)
    return y, s


def _check_one_row(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, mode: ScaleMode) -> None:
    check_args(x, weight, weight_scale, mode)
    if x.shape[0] != 1:
        raise ValueError(f"fp8_gemv takes one row (batch 1), got x of shape {tuple(x.shape)}; more rows: fp8_gemm")


def _launch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, mode: ScaleMode, y: torch.Tensor,
            config: Fp8GemvConfig | None, *, gated: bool = False,
            norm: tuple[torch.Tensor, float, torch.Tensor | None, torch.Tensor] | None = None,
            pdl: bool = False) -> None:
    """Launch the kernel on checked arguments; ``norm``: (norm weight, eps, residual or None,
    the buffer for x + residual)."""
    n, k = weight.shape
    config = config or default_config(n)
    if n == 0:
        return
    use_pdl = takes_pdl(pdl, x) and k > 0
    norm_weight, eps, residual, res_out = norm if norm is not None else (weight_scale, 0.0, None, weight_scale)
    _fp8_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, weight_scale, y, residual if residual is not None else weight_scale, res_out, norm_weight,
        n, k, eps,
        BLOCK_SCALES=mode == "block", EVEN_N=n % config.block_n == 0, EVEN_K=k % config.block_k == 0,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP=FP8_GROUP, NUM_STAGES=config.num_stages,
        PDL=use_pdl, GATED=gated, NORM=norm is not None, HAS_RESIDUAL=residual is not None,
        NORM_BLOCK=min(next_pow2(k), NORM_BLOCK_MAX),
        num_warps=config.num_warps, num_stages=config.num_stages,
        **({"launch_pdl": True} if use_pdl else {}),
    )
