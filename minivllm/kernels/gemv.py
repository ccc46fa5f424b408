"""``y = x W^T (+ b)`` for a few rows of ``x``: the decode step's GEMMs at small batch.

At batch 1-16 a linear layer is a weight stream: every weight is read once and used by at
most 16 rows, so its time is W's bytes over the memory bandwidth. This kernel streams W
once, with no split-K reduction pass::

    program p (grid: cdiv(N, BLOCK_N)) owns output columns [p*BLOCK_N, (p+1)*BLOCK_N)

    W rows of p   ##########....##########   BLOCK_N x K, read in BLOCK_K steps
    x (M rows)    ----------....----------   padded to BLOCK_M = 16 rows (tl.dot's
                                             minimum), re-read from L2 by every program
    acc (fp32)    BLOCK_N x BLOCK_M  += W_tile @ x_tile^T   (tensor cores)

The K loop is one ``tl.dot`` per step, so Triton software-pipelines the W loads
``num_stages`` deep. Accumulation is fp32 and the output is rounded once, as cuBLAS's (with
its bf16 split-K reduction off, which the executor sets). Each output element is one dot
product in a fixed order: deterministic, and the same for any M of one config.

With ``GemvConfig.one_row`` a single row (batch 1) skips the tensor cores and the padding
rows: each program keeps a (BLOCK_N, BLOCK_K) fp32 tile of products and sums it at the end
(W tiles pipelined through ``tl.range``). Its sums run in another order than the tensor-core
path's.

With ``gated`` the input is ``silu(gate) * up`` of x = [gate | up], computed from x as the W
tiles stream (the SiLU-and-mul kernel's ``gated_silu``, so the same bits): the MLP's down
projection at batch <= 16 runs without a launch for its activation.

With an input norm (:func:`rms_norm_gemv`, one row on the one-row path) the input is
RMSNorm(x + residual): each program sums the row's squares first (x and the residual come
from L2 while the first W tile is in flight), program 0 writes x + residual as the new
residual stream, and the main loop normalises each x tile as it streams W (the RMSNorm
kernel's ``normalise`` and ``add_residual``, so its rounding). Only the order of the
mean-square sum differs from the RMSNorm kernel's, so an input element may round one ulp
apart.

There is no split of K, so the caller uses this kernel only where ``cdiv(N, BLOCK_N)``
programs are enough (:func:`gemv_takes`).

With ``pdl=True`` (programmatic dependent launch, where ``_launch.pdl_supported``) each
program loads its first W tile (weights: no previous kernel writes them), then waits
(``griddepcontrol.wait``) before it reads x or writes y; the kernel is launched with
``launch_pdl``, so it may start while the kernel before it still runs. Once its K loop is
done (W streamed; only the sum and the stores are left) it lets the next kernel start, so
where GEMV follows GEMV each one's first tile loads during the previous one's tail. The
sums are the same, in the same order, with or without it. Why it signals after the K loop
rather than at its start: docs/tuning.md, "PDL".

Torch reference: ``torch.nn.functional.linear``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minivllm.kernels._gemv_tiles import input_rstd, one_row_input, w_tile, x_cols
from minivllm.kernels._launch import (
    check_dtype, check_last_dim_contiguous, check_power_of_two, check_same_device, check_tile_config,
    next_pow2, takes_pdl, upcast_dot,
)


MAX_ROWS = 16  # tl.dot's smallest tile side: rows beyond would need a second M tile
MIN_DOT_BLOCK = 16  # tl.dot's smallest tile side: block_n below it serves one row only
NORM_BLOCK_MAX = 2048  # columns per step of rms_norm_gemv's statistics pass (fp32 registers per program)
_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GemvConfig:
    """Tile and launch parameters (a tuning knob, not semantics); ``python3 -m
    benchmarks.gemv`` sweeps them against cuBLAS. The defaults: :func:`default_config`."""

    block_n: int = 16         # output columns (W rows) per program; power of two >= 16 (one_row: >= 1)
    block_k: int = 256        # reduction step; power of two >= 16
    num_warps: int = 4
    num_stages: int = 4       # W tiles in flight per program
    min_programs: int = 32    # fewer programs than this: the caller takes cuBLAS instead
    one_row: bool = False     # one row: CUDA-core products, no tensor cores (see the module doc)

    def __post_init__(self) -> None:
        # one_row: no tl.dot at one row, so narrower column blocks (more programs) are allowed;
        # such a config serves one row only (gemv_takes, gemv).
        check_power_of_two("block_n", self.block_n, minimum=1 if self.one_row else MIN_DOT_BLOCK)
        check_tile_config(self, ("block_k",), ("one_row",))
        if self.min_programs < 1:
            raise ValueError(f"min_programs must be >= 1, got {self.min_programs}")


# Why these tiles: docs/tuning.md, "GEMV tiles".
ONE_ROW_CONFIG = GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=3, one_row=True)
# One row, by W's shape (N, K): the first entry with N <= max_n and K <= max_k (None: any).
# A narrow W wants more, narrower programs (N = 1024 is 64 programs of 16 columns).
_SHORT_K_TILES = GemvConfig(block_n=16, block_k=256, num_warps=4, num_stages=4, one_row=True)
ONE_ROW_BY_SHAPE: tuple[tuple[int | None, int | None, GemvConfig], ...] = (
    (2048, None, GemvConfig(block_n=4, block_k=1024, num_warps=4, num_stages=3, one_row=True)),
    (3072, None, GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=3, one_row=True)),
    (None, 1024, _SHORT_K_TILES),
    (12288, 6144, _SHORT_K_TILES),
)
FEW_ROWS_CONFIG = GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=4)


def default_config(rows: int, n: int | None = None, k: int | None = None) -> GemvConfig:
    """The tiles for ``rows`` rows of x and a W of shape (``n``, ``k``) (None: not known, the
    general one-row tiles): ``ONE_ROW_BY_SHAPE`` at one row, else ``FEW_ROWS_CONFIG``."""
    config = FEW_ROWS_CONFIG if rows > 1 else ONE_ROW_CONFIG
    if rows == 1 and n is not None and k is not None:
        config = next((c for max_n, max_k, c in ONE_ROW_BY_SHAPE
                       if (max_n is None or n <= max_n) and (max_k is None or k <= max_k)), config)
    return config


@triton.jit
def _gemv_kernel(
    x_ptr,                       # (M, K), last dim contiguous; GATED: (M, 2K) = [gate | up]
    w_ptr,                       # (N, K) contiguous
    bias_ptr,                    # (N,) (read only if HAS_BIAS)
    y_ptr,                       # (M, N) contiguous
    r_ptr,                       # NORM + HAS_RESIDUAL: the residual stream (1, K) added to x; else unread
    r_out_ptr,                   # NORM + HAS_RESIDUAL: (1, K) receives x + residual (program 0); else unwritten
    nw_ptr,                      # NORM: the RMSNorm weight (K,); else unread
    M, N, K,
    stride_xm,
    eps,                         # NORM: the RMSNorm epsilon
    HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,    # CPU interpreter + bf16: see _launch.upcast_dot
    ONE_ROW: tl.constexpr,       # M == 1 on CUDA cores (GemvConfig.one_row)
    NUM_STAGES: tl.constexpr,    # ONE_ROW: loads in flight (tl.range pipelining)
    PDL: tl.constexpr,           # launched with launch_pdl: first W tile, wait, ..., signal after the K loop
    GATED: tl.constexpr,         # the input is silu(gate) * up of x = [gate | up] (see gemv's ``gated``)
    NORM: tl.constexpr,          # 0; 1: the input is RMSNorm(x [+ residual]); 2: its zero-centred norm
                                 # (ONE_ROW only; see rms_norm_gemv)
    HAS_RESIDUAL: tl.constexpr,  # NORM: add the residual first, and write the sum to r_out
    NORM_BLOCK: tl.constexpr,    # NORM: columns per step of the statistics pass
):
    tl.static_assert(ONE_ROW or not NORM, "the input norm is on the one-row path only")
    if ONE_ROW:
        _one_row(x_ptr, w_ptr, bias_ptr, y_ptr, r_ptr, r_out_ptr, nw_ptr, N, K, eps, HAS_BIAS, EVEN_N, EVEN_K,
                 BLOCK_N, BLOCK_K, NUM_STAGES, PDL, GATED, NORM, HAS_RESIDUAL, NORM_BLOCK)
        return
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)     # (BLOCK_N,) output columns
    rows = tl.arange(0, BLOCK_M)                                  # (BLOCK_M,) rows of x
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K               # (BLOCK_N, 1)
    x_rows = x_ptr + rows[:, None] * stride_xm                    # (BLOCK_M, 1)
    col_ok = cols < N
    row_ok = rows < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    k_start = 0
    if PDL:  # W does not depend on the previous kernel: its first tile loads before the wait
        w = w_tile(w_rows, offs_k, col_ok, K, EVEN_N, EVEN_K)
        tl.extra.cuda.gdc_wait()
        acc = _tile_dot(w, x_rows, offs_k, row_ok, K, acc, UPCAST_DOT, GATED)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        w = w_tile(w_rows, k0 + offs_k, col_ok, K, EVEN_N, EVEN_K)
        acc = _tile_dot(w, x_rows, k0 + offs_k, row_ok, K, acc, UPCAST_DOT, GATED)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    out = y_ptr + rows[None, :].to(tl.int64) * N + cols[:, None]      # y[m, n] at (n, m)
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=col_ok[:, None] & row_ok[None, :])


@triton.jit
def _tile_dot(w, x_rows, k, row_ok, K, acc, UPCAST_DOT: tl.constexpr, GATED: tl.constexpr):
    """``acc + w @ x[:, k]^T`` for x's (padded) rows at columns ``k``."""
    x = x_cols(x_rows, k[None, :], row_ok[:, None] & (k < K)[None, :], K, GATED)
    if UPCAST_DOT:
        w = w.to(tl.float32)
        x = x.to(tl.float32)
    return tl.dot(w, tl.trans(x), acc)                                # (BLOCK_N, BLOCK_M)


@triton.jit
def _one_row(x_ptr, w_ptr, bias_ptr, y_ptr, r_ptr, r_out_ptr, nw_ptr, N, K, eps, HAS_BIAS: tl.constexpr,
             EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             NUM_STAGES: tl.constexpr, PDL: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
             HAS_RESIDUAL: tl.constexpr, NORM_BLOCK: tl.constexpr):
    """y[0, cols] for one row of x: fp32 products summed over K at the end."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    col_ok = cols < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    rstd = 0.0
    k_start = 0
    if PDL or NORM:  # as in _gemv_kernel; NORM: the first W tile streams during the statistics pass
        w = w_tile(w_rows, offs_k, col_ok, K, EVEN_N, EVEN_K)
        if PDL:
            tl.extra.cuda.gdc_wait()
        if NORM:
            rstd = input_rstd(x_ptr, r_ptr, r_out_ptr, K, eps, HAS_RESIDUAL, NORM_BLOCK)
        acc = _row_product(w, x_ptr, r_ptr, nw_ptr, rstd, offs_k, K, acc, EVEN_K, GATED, NORM, HAS_RESIDUAL)
        k_start = BLOCK_K
    for k0 in tl.range(k_start, K, BLOCK_K, num_stages=NUM_STAGES):
        w = w_tile(w_rows, k0 + offs_k, col_ok, K, EVEN_N, EVEN_K)
        acc = _row_product(w, x_ptr, r_ptr, nw_ptr, rstd, k0 + offs_k, K, acc, EVEN_K, GATED, NORM, HAS_RESIDUAL)
    if PDL:  # W is streamed: the next GEMV may load its first tile during this one's stores
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=1)                                           # (BLOCK_N,)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _row_product(w, x_ptr, r_ptr, nw_ptr, rstd, k, K, acc, EVEN_K: tl.constexpr, GATED: tl.constexpr,
                 NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """``acc + w * x[k]`` (fp32 products, summed over K by the caller at the end); NORM: x[k]
    is the normalised ``x + residual`` (residual at ``r_ptr``, norm weight at ``nw_ptr``)."""
    if EVEN_K:
        x = one_row_input(x_ptr, r_ptr, nw_ptr, rstd, k, None, K, GATED, NORM, HAS_RESIDUAL)
    else:
        x = one_row_input(x_ptr, r_ptr, nw_ptr, rstd, k, k < K, K, GATED, NORM, HAS_RESIDUAL)
    return acc + w.to(tl.float32) * x.to(tl.float32)[None, :]


def gemv_takes(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None, *,
               gated: bool = False, norm_weight: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> bool:
    """Whether :func:`gemv` serves ``F.linear(x, weight)`` (``gated``: ``F.linear(silu_and_mul(x),
    weight)``): x is (M <= 16, K) (gated: (M, 2K)) in bf16/fp16 with W's dtype, W is (N, K)
    contiguous, and N is wide enough for ``config.min_programs`` programs (``config`` None:
    ``default_config(M, N, K)``). With ``norm_weight``: whether :func:`rms_norm_gemv` serves it
    (also one row on the one-row path, a (K,) norm weight of x's dtype, and ``residual``
    None or like x). Host shapes only (no device read: safe inside CUDA-graph capture)."""
    if not (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype in _DTYPES and weight.dtype == x.dtype
            and weight.dim() == 2 and x.shape[1] == weight.shape[1] * (2 if gated else 1)
            and weight.is_contiguous() and x.stride(1) == 1):
        return False
    config = config or default_config(x.shape[0], *weight.shape)
    if config.block_n < MIN_DOT_BLOCK and not (config.one_row and x.shape[0] == 1):
        return False
    if norm_weight is not None and not (
            x.shape[0] == 1 and config.one_row and not gated and norm_weight.dtype == x.dtype
            and norm_weight.shape == (x.shape[1],) and norm_weight.is_contiguous()
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.stride(1) == 1))):
        return False
    return triton.cdiv(weight.shape[0], config.block_n) >= config.min_programs


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, out: torch.Tensor | None = None, *, gated: bool = False,
         pdl: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x (M, K) with M <= 16: (M, N) in x's dtype, with
    ``config`` (None: ``default_config(M, N, K)``), written into ``out`` if given (a contiguous
    (M, N) of x's dtype; returned).

    ``gated``: x is (M, 2K) = [gate | up] and the input is ``silu(gate) * up``, computed
    as the W tiles stream (the SiLU-and-mul kernel's rounding, so the same bits as
    ``gemv(silu_and_mul(x), ...)``): the MLP's down projection without a kernel for
    the activation.

    ``pdl``: this launch takes part in programmatic dependent launch where the device allows
    it (module doc); the result is the same bits either way.

    Raises:
        TypeError: x, weight (and bias) are not one of bf16 / fp16 together.
        ValueError: more than 16 rows, mismatched K (2K when gated), a strided last dimension, a
            non-contiguous weight, a bias not (N,), an ``out`` not a contiguous (M, N), or
            tensors on different devices.
    """
    tensors = _check(x, weight, bias, gated)
    if out is not None:
        check_dtype("out", out, (x.dtype,))
        if out.shape != (x.shape[0], weight.shape[0]) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous ({x.shape[0]}, {weight.shape[0]}), "
                             f"got shape {tuple(out.shape)}")
        tensors["out"] = out
    check_same_device(**tensors)
    config = config or default_config(x.shape[0], *weight.shape)
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device) if out is None else out
    _launch(x, weight, bias, y, config, gated=gated, pdl=pdl)
    return y


def rms_norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: GemvConfig | None = None, *, pdl: bool = False,
                  unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(rms_norm(s), weight, bias), s)`` for one row x (1, K) and s = x + residual
    (residual None: s = x), in one kernel: the RMSNorm kernel's rounding (``rms_norm.normalise``
    and ``add_residual``), with the row's statistics summed in the kernel's own order; s is a new
    tensor (x itself when residual is None). A decode layer's residual add + RMSNorm without a
    launch of its own, at batch 1 on the one-row path (``config`` None: ``default_config(1, N, K)``).
    ``pdl`` as in :func:`gemv`. ``unit_offset``: the zero-centred norm of Qwen3.5,
    ``(1 + w) * s / rms(s)`` rounded once (``rms_norm.rms_norm_1p``'s rounding).

    Raises:
        TypeError: x, residual, the weights (and bias) are not one of bf16 / fp16 together.
        ValueError: anything :func:`gemv` refuses, more than one row, a config without
            ``one_row``, a residual not like x, or a norm weight not a contiguous (K,).
    """
    tensors = _check(x, weight, bias, False)
    config = config or default_config(1, *weight.shape)
    if x.shape[0] != 1 or not config.one_row:
        raise ValueError(f"rms_norm_gemv takes one row on the one-row path, got {x.shape[0]} rows "
                         f"and one_row={config.one_row}")
    check_dtype("norm_weight", norm_weight, (x.dtype,))
    if norm_weight.shape != (x.shape[1],) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight must be a contiguous ({x.shape[1]},), got shape {tuple(norm_weight.shape)}")
    tensors["norm_weight"] = norm_weight
    if residual is not None:
        check_dtype("residual", residual, (x.dtype,))
        if residual.shape != x.shape or residual.stride(1) != 1:
            raise ValueError(f"residual must be like x {tuple(x.shape)}, got shape {tuple(residual.shape)} "
                             f"strides {residual.stride()}")
        tensors["residual"] = residual
    check_same_device(**tensors)
    y = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
    s = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x
    _launch(x, weight, bias, y, config, norm=(norm_weight, float(eps), residual, s), pdl=pdl,
            unit_offset=unit_offset)
    return y, s


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> dict[str, torch.Tensor]:
    """Validate x, weight and bias of a GEMV (raises as :func:`gemv` says); returns them by name."""
    check_dtype("x", x, _DTYPES)
    check_dtype("weight", weight, (x.dtype,))
    if x.dim() != 2 or x.shape[0] > MAX_ROWS:
        raise ValueError(f"x must be (M <= {MAX_ROWS}, K), got shape {tuple(x.shape)}")
    in_features = x.shape[1] // 2 if gated else x.shape[1]
    if gated and x.shape[1] % 2:
        raise ValueError(f"gated x must be (M, 2K) = [gate | up], got an odd width {x.shape[1]}")
    if weight.dim() != 2 or weight.shape[1] != in_features or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous (N, {in_features}), got shape {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    check_last_dim_contiguous("x", x)
    tensors = {"x": x, "weight": weight}
    if bias is not None:
        n = weight.shape[0]
        check_dtype("bias", bias, (x.dtype,))
        if bias.shape != (n,) or (n > 1 and bias.stride(0) != 1):
            raise ValueError(f"bias must be a contiguous ({n},), got shape {tuple(bias.shape)}")
        tensors["bias"] = bias
    return tensors


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
            config: GemvConfig, *, gated: bool = False,
            norm: tuple[torch.Tensor, float, torch.Tensor | None, torch.Tensor] | None = None,
            pdl: bool = False, unit_offset: bool = False) -> None:
    """Launch the kernel on checked arguments; ``norm``: (norm weight, eps, residual or None,
    the buffer for x + residual), ``unit_offset``: its weight scales by 1 + w."""
    n, k = weight.shape
    rows = x.shape[0]
    if rows == 0 or n == 0:
        return
    one_row = config.one_row and rows == 1
    if config.block_n < MIN_DOT_BLOCK and not one_row:
        raise ValueError(f"block_n {config.block_n} < {MIN_DOT_BLOCK} serves one row only (one_row), "
                         f"got {rows} rows")
    use_pdl = takes_pdl(pdl, x)
    norm_weight, eps, residual, res_out = norm if norm is not None else (weight, 0.0, None, weight)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else weight, y,
        residual if residual is not None else weight, res_out, norm_weight,
        rows, n, k, x.stride(0), eps,
        HAS_BIAS=bias is not None, EVEN_N=n % config.block_n == 0, EVEN_K=k % config.block_k == 0,
        BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k, UPCAST_DOT=upcast_dot(x),
        ONE_ROW=one_row, NUM_STAGES=config.num_stages, PDL=use_pdl, GATED=gated,
        NORM=0 if norm is None else 2 if unit_offset else 1,
        HAS_RESIDUAL=residual is not None, NORM_BLOCK=min(next_pow2(k), NORM_BLOCK_MAX),
        num_warps=config.num_warps, num_stages=config.num_stages, **({"launch_pdl": True} if use_pdl else {}),
    )
