"""``y = x W^T (+ b)`` for a few rows of ``x``: the decode step's GEMMs at small batch.

At batch 1-16 a linear layer is a weight stream: every weight is read once and used
by at most 16 rows, so the time is the weight bytes over the memory bandwidth. On
the H200 cuBLAS reached 3.2 TB/s over the decode GEMMs of Qwen3-8B at TP=2 (2.5 TB/s
on ``o_proj``, 2.7 on ``qkv_proj`` plus a split-K reduction kernel) where a copy
reaches about 4.2 (BENCHMARKS.md, sixth session). This kernel streams W once, with
no split-K reduction pass::

    program p (grid: cdiv(N, BLOCK_N)) owns output columns [p*BLOCK_N, (p+1)*BLOCK_N)

    W rows of p   ##########....##########   BLOCK_N x K, read in BLOCK_K steps
    x (M rows)    ----------....----------   padded to BLOCK_M = 16 rows (tl.dot's
                                             minimum), re-read from L2 by every program
    acc (fp32)    BLOCK_N x BLOCK_M  += W_tile @ x_tile^T   (tensor cores)

The K loop is one ``tl.dot`` per step, so Triton software-pipelines the W loads
``num_stages`` deep (``cp.async`` on sm_90, checked by compiling for it), or, with
``GemvConfig.tma``, fetches each W tile as one tensor-memory-copy box (the box is
zero-filled past N and K, so no masks). Accumulation is fp32 and the output is rounded once, as
cuBLAS's (with its bf16 split-K reduction off, which the executor sets). Each output
element is one dot product in a fixed order: deterministic, and the same for any M of
one config (so for 2-16 rows under the defaults).

With ``GemvConfig.one_row`` a single row (batch 1) skips the tensor cores and the padding
rows: each program keeps a (BLOCK_N, BLOCK_K) fp32 tile of products and sums it at the
end (W tiles still pipelined by ``cp.async``, through ``tl.range``; less shared memory:
26 KB at 16 x 256, 4 stages). Its sums run in another order than the tensor-core path's.

With ``gated`` the input is ``silu(gate) * up`` of x = [gate | up], computed from x as the W
tiles stream (the SiLU-and-mul kernel's ``gated_silu``, so the same bits): the MLP's down
projection at batch <= 16 runs without a launch for its activation.

With an input norm (:func:`rms_norm_gemv`, one row on the one-row path) the input is
RMSNorm(x + residual): each program sums the row's squares first (x and the residual are 2-8
KB, from L2; the first W tile is already in flight), program 0 writes x + residual as the
new residual stream, and the main loop normalises each x tile as it streams W (the RMSNorm
kernel's ``normalise`` and ``add_residual``, so its rounding). The decode layer's two norms
then need no launch of their own at batch 1 (``RMSNorm.into``). Only the order of the
mean-square sum differs from the RMSNorm kernel's, so an input element may round one ulp
apart.

Under tensor parallelism at batch 1 the same kernel carries the all-reduce between a
row-parallel layer and the norm after it (``kernels/_push_all_reduce.py``): with ``push``
each program also stores its output tile into every peer's inbox and counts it there; with
``reduce`` the normed GEMV's input is the sum of the ranks' rows in its inbox, which each
program waits for after its first W tile is in flight. No all-reduce kernel, no barrier.

There is no split of K, so the caller uses this kernel only where ``cdiv(N, BLOCK_N)``
programs are enough (:func:`gemv_takes`).

With programmatic dependent launch (``_launch.pdl``: Hopper; on by default with one rank,
``MINIVLLM_PDL`` 0 / 1 overrides, off under tensor parallelism until timed on two GPUs)
each program loads its first W tile before anything that a previous kernel writes (the
same sums, in the same order: ``GemvConfig.prefetch``), the kernel is launched with
``launch_pdl`` and may start while the kernel before it still runs, and it waits
(``griddepcontrol.wait``) before reading x or writing y. The kernels before it let it
start early: RMSNorm, the attention merge, SiLU-and-mul and the fused all-reduce at
their start, a GEMV once its K loop is done (its W streamed; only the sum and the
stores are left), so at batch 1, where GEMV follows GEMV (the norm and the activation
are inside them), each one's first tile loads during the previous one's tail. With
``MINIVLLM_PDL_L2_MB`` it also asks L2 for that much of W first (column 0 on).

Timed on one H200 (``benchmarks.throughput --async on``, batch-1 ms/token, median of 3-5
generations; BENCHMARKS.md). Ninth and tenth sessions, before GEMVs signalled (so only the
RMSNorm / merge / SiLU kernels let a GEMV start early): a 24 MB L2 prefetch made the 0.6B
graph step 1.16 -> 1.64 ms; 8 MB 1.26; the early start alone +1% to -7% end to end: off.
Thirteenth session: a GEMV letting the next start *at its start* lost at 8B shapes (0.6B
0.968 -> 0.948, but 8B 4.483 -> 4.568 and one TP=2 rank's share of 8B 2.725 -> 3.228: the
early programs hold SM slots through the whole predecessor); *after its K loop* it won:
0.6B 0.967 -> 0.920, 8B 4.486 -> 4.471, the TP=2 rank's share 2.724 -> 2.719 (one quiet
call), offline-256 unchanged (25,240 / 25,391 against 23,731 / 25,374 tok/s). Five later
0.6B runs a side were noisy (medians 0.93-1.08 with, 0.97-1.05 without and 1.72 in a
first run, the noise moving both alike in time); their fastest generations: 0.921, 0.924,
0.924, 0.961, 1.013 with, 0.970, 0.971, 0.973, 0.979 and a first run's 1.690 without. L2 prefetch on top: 2 MB no
change, 8 MB slower (2.791, 4.499). So PDL is on with one rank, without the L2 prefetch.

Default tiles (:func:`default_config`), from ``python3 -m benchmarks.gemv`` on one H200
(BENCHMARKS.md, eighth session; L2 flushed, in CUDA graphs; ratios of cuBLAS's time over
the 12 decode GEMMs of Qwen3-0.6B, Qwen3-8B and 8B at TP=2): one row takes the CUDA-core
path, 16 x 512, 4 warps, 3 stages (0.31-0.99, all twelve faster); 2-16 rows take 32 x 256,
4 warps, 4 stages (0.64-1.06; the two slower are gate_up of 0.6B and 8B at TP=1). The
first default, 16 x 256 tensor-core tiles for every M, was slower than cuBLAS on eleven of
the twelve at one row (up to 1.32x) and cost 0.6 ms a batch-1 token on 8B. At one row the
tiles now also follow W's shape (``ONE_ROW_BY_SHAPE``, tenth session): a narrow W (N <= 2048,
Qwen3-0.6B's o and down projections) takes programs of 4 columns, 256 programs instead of 64,
which the CUDA-core path allows (it has no ``tl.dot`` and its 16-column minimum). A W up to
12288 x 6144 (Qwen3-8B's qkv, its o, gate_up and down at TP=2) takes 16 x 256 tiles, 4 stages
(eleventh session: 1.3 us less on the TP=2 gate_up, 0.7 on the 8B qkv).

Torch reference: ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import (
    TensorDescriptor, check_dtype, check_last_dim_contiguous, check_power_of_two, check_same_device,
    check_tile_config, next_pow2, pdl, tma_rows_allowed, upcast_dot,
)
from minivllm.kernels._push_all_reduce import PushChannel, push_tile, pushed_sum, wait_pushed
from minivllm.kernels.rms_norm import add_residual, normalise
from minivllm.kernels.silu_and_mul import gated_silu


MAX_ROWS = 16  # tl.dot's smallest tile side: rows beyond would need a second M tile
MIN_DOT_BLOCK = 16  # tl.dot's smallest tile side: block_n below it serves one row only
NORM_BLOCK_MAX = 2048  # columns per step of rms_norm_gemv's statistics pass (fp32 registers per program)
# With PDL, how many MB of W the programs ask L2 for before the previous kernel ends
# (a larger W has its first columns prefetched, which all programs read first). Default 0:
# none. Timed with 24 (half the H200's 50 MB L2) and 8 MB: slower than PDL without it
# (module doc).
L2_PREFETCH_ENV = "MINIVLLM_PDL_L2_MB"
_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GemvConfig:
    """Tile and launch parameters (a tuning knob, not semantics); ``python3 -m
    benchmarks.gemv`` sweeps them against cuBLAS. The defaults: :func:`default_config`."""

    block_n: int = 16         # output columns (W rows) per program; power of two >= 16 (one_row: >= 1)
    block_k: int = 256        # reduction step; power of two >= 16
    num_warps: int = 4
    num_stages: int = 4       # W tiles in flight per program
    min_programs: int = 32    # fewer programs than this: cuBLAS instead (N = 1024 at 32 x 256 still won)
    tma: bool = False         # W tiles by tensor-memory copy (Hopper+; the interpreter emulates it)
    one_row: bool = False     # one row: CUDA-core products, no tensor cores (see the module doc)
    # The first W tile before the wait for the previous kernel, and the launch with PDL where
    # possible (module doc). None: both exactly when _launch.pdl says PDL is on; False: neither.
    prefetch: bool | None = None

    def __post_init__(self) -> None:
        # one_row: no tl.dot at one row, so narrower column blocks (more programs) are allowed;
        # such a config serves one row only (gemv_takes, gemv).
        check_power_of_two("block_n", self.block_n, minimum=1 if self.one_row else MIN_DOT_BLOCK)
        check_tile_config(self, ("block_k",), ("tma", "one_row"))
        if not (self.prefetch is None or isinstance(self.prefetch, bool)):
            raise ValueError(f"prefetch must be None or a bool, got {self.prefetch!r}")
        if self.min_programs < 1:
            raise ValueError(f"min_programs must be >= 1, got {self.min_programs}")


ONE_ROW_CONFIG = GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=3, one_row=True)
# One row, by W's shape (N, K): the first entry with N <= max_n and K <= max_k (None: any).
# Narrow W wants more, narrower programs (N = 1024: 64 programs of 16 columns on 132 SMs).
# From ``python3 -m benchmarks.gemv --rows 1`` (tenth session, one H200, us in CUDA graphs,
# L2 flushed; ONE_ROW_CONFIG's time in brackets): 0.6B o 3.41 (3.94), down 4.00 (4.91);
# 8B TP=2 qkv 8.86 (9.09); 0.6B qkv 4.33 (4.67), gate_up 5.32 (5.75).
# Eleventh session, three sweeps, median us (``--models 8b,8b-tp2``): 16 x 256, 4 stages also for
# W up to 12288 x 6144: 8B qkv 14.73 (15.43), 8B TP=2 gate_up 26.71 (27.99), o 6.60 (6.73), down
# 15.18 (15.14); not for the larger 8B gate_up (51.77 against 50.89) and down (27.29, 26.84).
_SHORT_K_TILES = GemvConfig(block_n=16, block_k=256, num_warps=4, num_stages=4, one_row=True)
ONE_ROW_BY_SHAPE: tuple[tuple[int | None, int | None, GemvConfig], ...] = (
    (2048, None, GemvConfig(block_n=4, block_k=1024, num_warps=4, num_stages=3, one_row=True)),
    (3072, None, GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=3, one_row=True)),
    (None, 1024, _SHORT_K_TILES),
    (12288, 6144, _SHORT_K_TILES),
)
FEW_ROWS_CONFIG = GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=4)


def default_config(rows: int, n: int | None = None, k: int | None = None) -> GemvConfig:
    """The measured tiles for ``rows`` rows of x and a W of shape (``n``, ``k``) (None: not
    known, the general one-row tiles; see the module doc). Their ``prefetch`` is None: under
    programmatic dependent launch they prefetch and launch with it (module doc)."""
    config = FEW_ROWS_CONFIG if rows > 1 else ONE_ROW_CONFIG
    if rows == 1 and n is not None and k is not None:
        config = next((c for max_n, max_k, c in ONE_ROW_BY_SHAPE
                       if (max_n is None or n <= max_n) and (max_k is None or k <= max_k)), config)
    return config


@triton.jit
def _gemv_kernel(
    x_ptr,                       # (M, K), last dim contiguous; GATED: (M, 2K) = [gate | up]
    w_ptr,                       # (N, K) contiguous
    w_desc,                      # USE_TMA: descriptor of W with (BLOCK_N, BLOCK_K) boxes; else unread
    bias_ptr,                    # (N,) (read only if HAS_BIAS)
    y_ptr,                       # (M, N) contiguous
    r_ptr,                       # NORM + HAS_RESIDUAL: the residual stream (1, K) added to x; else unread
    r_out_ptr,                   # NORM + HAS_RESIDUAL: (1, K) receives x + residual (program 0); else unwritten
    nw_ptr,                      # NORM: the RMSNorm weight (K,); else unread
    inbox_ptrs,                  # PUSH: (WORLD,) int64, every rank's inbox; else unread
    pad_ptrs,                    # PUSH or REDUCE: (WORLD,) int64, every rank's int32 signal pad; else unread
    slot_offset,                 # PUSH: this rank's slot in every inbox (elements)
    pad_at, half,                # PUSH or REDUCE: the push counters in the pads, and this call's pair
    M, N, K,
    stride_xm,
    l2_end,                      # PDL: W columns [0, l2_end) of this program's rows are prefetched into L2
    eps,                         # NORM: the RMSNorm epsilon
    HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,    # CPU interpreter + bf16: see _launch.upcast_dot
    USE_TMA: tl.constexpr,
    ONE_ROW: tl.constexpr,       # M == 1 on CUDA cores (GemvConfig.one_row)
    NUM_STAGES: tl.constexpr,    # ONE_ROW: loads in flight (tl.range pipelining)
    PREFETCH: tl.constexpr,      # the first W tile is loaded before anything else (GemvConfig.prefetch)
    PDL: tl.constexpr,           # launched with launch_pdl: wait for the previous kernel after that load
    GATED: tl.constexpr,         # the input is silu(gate) * up of x = [gate | up] (see gemv's ``gated``)
    NORM: tl.constexpr,          # the input is RMSNorm(x [+ residual]) (ONE_ROW only; see rms_norm_gemv)
    HAS_RESIDUAL: tl.constexpr,  # NORM: add the residual first, and write the sum to r_out
    NORM_BLOCK: tl.constexpr,    # NORM: columns per step of the statistics pass
    PUSH: tl.constexpr,          # ONE_ROW: y is this rank's partial sum, pushed to every peer (_push_all_reduce)
    REDUCE: tl.constexpr,        # NORM: x is WORLD pushed partial rows (WORLD, K); the input is their sum
    RANK: tl.constexpr, WORLD: tl.constexpr,  # PUSH or REDUCE: this rank, the group's size
    SIGNAL_NEXT: tl.constexpr,   # PDL (_launch.pdl): let the next kernel start once this one's K loop is done
):
    tl.static_assert(ONE_ROW or not (NORM or PUSH), "the input norm and the push are on the one-row path only")
    if ONE_ROW:
        _one_row(x_ptr, w_ptr, bias_ptr, y_ptr, r_ptr, r_out_ptr, nw_ptr, inbox_ptrs, pad_ptrs, slot_offset,
                 pad_at, half, N, K, l2_end, eps, HAS_BIAS, EVEN_N, EVEN_K, BLOCK_N, BLOCK_K, NUM_STAGES,
                 PREFETCH, PDL, GATED, NORM, HAS_RESIDUAL, NORM_BLOCK, PUSH, REDUCE, RANK, WORLD, SIGNAL_NEXT)
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
    if PREFETCH:  # W does not depend on the previous kernel: read it before the wait
        if PDL:
            _prefetch_l2(w_ptr, N, K, l2_end, BLOCK_N)
        w = _w_tile(w_rows, w_desc, 0, offs_k, col_ok, K, USE_TMA, EVEN_N, EVEN_K, BLOCK_N)
        if PDL:
            tl.extra.cuda.gdc_wait()
        acc = _tile_dot(w, x_rows, offs_k, row_ok, K, acc, UPCAST_DOT, GATED)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        w = _w_tile(w_rows, w_desc, k0, k0 + offs_k, col_ok, K, USE_TMA, EVEN_N, EVEN_K, BLOCK_N)
        acc = _tile_dot(w, x_rows, k0 + offs_k, row_ok, K, acc, UPCAST_DOT, GATED)
    if SIGNAL_NEXT:
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    out = y_ptr + rows[None, :].to(tl.int64) * N + cols[:, None]      # y[m, n] at (n, m)
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=col_ok[:, None] & row_ok[None, :])


@triton.jit
def _w_tile(w_rows, w_desc, k0, k, col_ok, K, USE_TMA: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """This program's (BLOCK_N, BLOCK_K) tile of W at columns ``k`` (starting at ``k0``)."""
    if USE_TMA:
        w = w_desc.load([tl.program_id(0) * BLOCK_N, k0])
    elif EVEN_N and EVEN_K:
        w = tl.load(w_rows + k[None, :])
    else:
        w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & (k < K)[None, :], other=0.0)
    return w


@triton.jit
def _x_cols(x_ptrs, k, mask, K, GATED: tl.constexpr):
    """x at columns ``k`` (0 where masked off); GATED: silu(gate) * up of x = [gate | up], gate
    at columns ``k`` and up K columns to the right, rounded as the SiLU-and-mul kernel rounds."""
    x = _masked_load(x_ptrs + k, mask)
    if GATED:
        x = gated_silu(x, _masked_load(x_ptrs + K + k, mask), x.dtype)
    return x


@triton.jit
def _masked_load(ptrs, mask):
    """``ptrs``' values, 0 where ``mask`` is False (``mask`` None: every one)."""
    if mask is None:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def _tile_dot(w, x_rows, k, row_ok, K, acc, UPCAST_DOT: tl.constexpr, GATED: tl.constexpr):
    """``acc + w @ x[:, k]^T`` for x's (padded) rows at columns ``k``."""
    x = _x_cols(x_rows, k[None, :], row_ok[:, None] & (k < K)[None, :], K, GATED)
    if UPCAST_DOT:
        w = w.to(tl.float32)
        x = x.to(tl.float32)
    return tl.dot(w, tl.trans(x), acc)                                # (BLOCK_N, BLOCK_M)


@triton.jit
def _prefetch_l2(w_ptr, N, K, l2_end, BLOCK_N: tl.constexpr):
    """Ask L2 for columns [0, l2_end) of this program's W rows, one ``prefetch`` per
    128-byte line (64 16-bit values), kept with evict_last. A GPU-only hint (inline PTX):
    it reads no value and changes no result. Rows are clamped inside W, columns inside
    [0, l2_end) (the caller keeps l2_end <= K), so the last step asks for no more."""
    LINES: tl.constexpr = 16
    rows = tl.minimum(tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    lines = tl.arange(0, LINES) * 64
    for k0 in range(0, l2_end, LINES * 64):
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                  [w_rows + tl.minimum(k0 + lines, l2_end - 1)[None, :]],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _one_row(x_ptr, w_ptr, bias_ptr, y_ptr, r_ptr, r_out_ptr, nw_ptr, inbox_ptrs, pad_ptrs, slot_offset, pad_at,
             half, N, K, l2_end, eps, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr,
             PDL: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
             NORM_BLOCK: tl.constexpr, PUSH: tl.constexpr, REDUCE: tl.constexpr, RANK: tl.constexpr,
             WORLD: tl.constexpr, SIGNAL_NEXT: tl.constexpr):
    """y[0, cols] for one row of x: fp32 products summed over K at the end."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    col_ok = cols < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    rstd = 0.0
    k_start = 0
    if PREFETCH or NORM:  # as in _gemv_kernel; NORM: the first W tile streams during the statistics pass
        if PDL:
            _prefetch_l2(w_ptr, N, K, l2_end, BLOCK_N)
        w = _w_tile(w_rows, w_rows, 0, offs_k, col_ok, K, False, EVEN_N, EVEN_K, BLOCK_N)
        if PDL:
            tl.extra.cuda.gdc_wait()
        if REDUCE:  # ... and while the peers' partial rows arrive
            wait_pushed(pad_ptrs, pad_at, half, RANK)
        if NORM:
            rstd = _input_rstd(x_ptr, r_ptr, r_out_ptr, K, eps, HAS_RESIDUAL, NORM_BLOCK, REDUCE, WORLD)
        acc = _row_product(w, x_ptr, r_ptr, nw_ptr, rstd, offs_k, K, acc, EVEN_K, GATED, NORM, HAS_RESIDUAL,
                           REDUCE, WORLD)
        k_start = BLOCK_K
    for k0 in tl.range(k_start, K, BLOCK_K, num_stages=NUM_STAGES):
        w = _w_tile(w_rows, w_rows, k0, k0 + offs_k, col_ok, K, False, EVEN_N, EVEN_K, BLOCK_N)
        acc = _row_product(w, x_ptr, r_ptr, nw_ptr, rstd, k0 + offs_k, K, acc, EVEN_K, GATED, NORM,
                           HAS_RESIDUAL, REDUCE, WORLD)
    if SIGNAL_NEXT:  # W is streamed: the next GEMV may load its first tile during this one's stores
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=1)                                           # (BLOCK_N,)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = y.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + cols, y, mask=col_ok)
    if PUSH:
        push_tile(y, cols, col_ok, inbox_ptrs, slot_offset, pad_ptrs, pad_at, half, N, RANK, WORLD)


@triton.jit
def _row_product(w, x_ptr, r_ptr, nw_ptr, rstd, k, K, acc, EVEN_K: tl.constexpr, GATED: tl.constexpr,
                 NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, REDUCE: tl.constexpr, WORLD: tl.constexpr):
    """``acc + w * x[k]`` (fp32 products, summed over K by the caller at the end); NORM: x[k]
    is the normalised ``x + residual`` (residual at ``r_ptr``, norm weight at ``nw_ptr``)."""
    if EVEN_K:
        x = _one_row_input(x_ptr, r_ptr, nw_ptr, rstd, k, None, K, GATED, NORM, HAS_RESIDUAL, REDUCE, WORLD)
    else:
        x = _one_row_input(x_ptr, r_ptr, nw_ptr, rstd, k, k < K, K, GATED, NORM, HAS_RESIDUAL, REDUCE, WORLD)
    return acc + w.to(tl.float32) * x.to(tl.float32)[None, :]


@triton.jit
def _one_row_input(x_ptr, r_ptr, nw_ptr, rstd, k, mask, K, GATED: tl.constexpr, NORM: tl.constexpr,
                   HAS_RESIDUAL: tl.constexpr, REDUCE: tl.constexpr, WORLD: tl.constexpr):
    """The input row at columns ``k``: x, silu(gate) * up (GATED), or NORM: the RMSNorm kernel's
    output for ``x + residual`` given its ``rstd`` (the same rounding: ``rms_norm.normalise``)."""
    if NORM:
        s = _residual_sum(x_ptr, r_ptr, k, mask, K, HAS_RESIDUAL, REDUCE, WORLD)
        x = normalise(s, _masked_load(nw_ptr + k, mask).to(tl.float32), rstd).to(s.dtype)
    else:
        x = _x_cols(x_ptr, k, mask, K, GATED)
    return x


@triton.jit
def _residual_sum(x_ptr, r_ptr, k, mask, K, HAS_RESIDUAL: tl.constexpr, REDUCE: tl.constexpr, WORLD: tl.constexpr):
    """x at columns ``k`` (REDUCE: the sum of the WORLD pushed rows, as the all-reduce rounds it),
    or ``x + residual`` rounded as the RMSNorm kernel rounds it (``rms_norm.add_residual``)."""
    if REDUCE:
        x = pushed_sum(x_ptr, k, mask, K, WORLD)
    else:
        x = _masked_load(x_ptr + k, mask)
    if HAS_RESIDUAL:
        x = add_residual(x, _masked_load(r_ptr + k, mask))
    return x


@triton.jit
def _input_rstd(x_ptr, r_ptr, r_out_ptr, K, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                REDUCE: tl.constexpr, WORLD: tl.constexpr):
    """``1 / sqrt(mean(s^2) + eps)`` of the row s = x [+ residual] (fp32 sums, BLOCK columns a
    step; every program computes it, from L2). HAS_RESIDUAL: program 0 also writes s to r_out,
    a buffer no program reads (the new residual stream)."""
    sq = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        s = _residual_sum(x_ptr, r_ptr, k, k < K, K, HAS_RESIDUAL, REDUCE, WORLD)
        if HAS_RESIDUAL:
            if tl.program_id(0) == 0:
                tl.store(r_out_ptr + k, s, mask=k < K)
        s32 = s.to(tl.float32)
        sq += s32 * s32
    return tl.math.rsqrt(tl.sum(sq, axis=0) / K + eps)


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
         push: PushChannel | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x (M, K) with M <= 16: (M, N) in x's dtype, with
    ``config`` (None: ``default_config(M, N, K)``), written into ``out`` if given (a contiguous
    (M, N) of x's dtype; returned).

    ``gated``: x is (M, 2K) = [gate | up] and the input is ``silu(gate) * up``, computed
    as the W tiles stream (the SiLU-and-mul kernel's rounding, so the same bits as
    ``gemv(silu_and_mul(x), ...)``): the MLP's down projection without a kernel for
    the activation.

    ``push``: y is this rank's partial sum of a row-parallel layer, one row on the one-row path;
    ``out`` is this rank's slot of the push inbox, and every tile also goes to the peers' inboxes
    (``_push_all_reduce``: the all-reduce without a kernel of its own).

    Raises:
        TypeError: x, weight (and bias) are not one of bf16 / fp16 together.
        ValueError: more than 16 rows, mismatched K (2K when gated), a strided last dimension, a
            non-contiguous weight, a bias not (N,), an ``out`` not a contiguous (M, N),
            tensors on different devices, or a push without ``out``, of more than one row or
            off the one-row path.
    """
    tensors = _check(x, weight, bias, gated)
    if out is not None:
        check_dtype("out", out, (x.dtype,))
        if out.shape != (x.shape[0], weight.shape[0]) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous ({x.shape[0]}, {weight.shape[0]}), "
                             f"got shape {tuple(out.shape)}")
        tensors["out"] = out
    config = config or default_config(x.shape[0], *weight.shape)
    if push is not None:
        if out is None or x.shape[0] != 1 or not config.one_row:
            raise ValueError(f"a pushed GEMV writes one row into its inbox slot (out) on the one-row path, got "
                             f"{x.shape[0]} rows, out {'given' if out is not None else 'None'}, "
                             f"one_row={config.one_row}")
        tensors.update(inbox_ptrs=push.inbox_ptrs, pad_ptrs=push.pad_ptrs)
    check_same_device(**tensors)
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device) if out is None else out
    _launch(x, weight, bias, y, config, gated=gated, push=push)
    return y


def rms_norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: GemvConfig | None = None, *,
                  reduce: PushChannel | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(rms_norm(s), weight, bias), s)`` for one row x (1, K) and s = x + residual
    (residual None: s = x), in one kernel: the RMSNorm kernel's rounding (``rms_norm.normalise``
    and ``add_residual``), with the row's statistics summed in the kernel's own order; s is a new
    tensor (x itself when residual is None). A decode layer's residual add + RMSNorm without a
    launch of its own, at batch 1 on the one-row path (``config`` None: ``default_config(1, N, K)``).

    ``reduce``: x is a push inbox's (world_size, K) slots, which the ranks' pushed GEMVs fill,
    and the row is their sum (``_push_all_reduce``: the kernel waits for the peers' slots, and
    rounds the sum as the all-reduce does); ``residual`` is then required.

    Raises:
        TypeError: x, residual, the weights (and bias) are not one of bf16 / fp16 together.
        ValueError: anything :func:`gemv` refuses, more than one row, a config without
            ``one_row``, a residual not like x, a norm weight not a contiguous (K,), or with
            ``reduce``: x not a contiguous (world_size, K), or no residual.
    """
    row = x
    if reduce is not None:
        if x.dim() != 2 or x.shape[0] != reduce.world_size or not x.is_contiguous() or residual is None:
            raise ValueError(f"a reducing rms_norm_gemv takes the contiguous ({reduce.world_size}, K) slots and a "
                             f"residual, got x {tuple(x.shape)} strides {x.stride()}, residual "
                             f"{'given' if residual is not None else 'None'}")
        row = x[:1]
    tensors = _check(row, weight, bias, False)
    config = config or default_config(1, *weight.shape)
    if row.shape[0] != 1 or not config.one_row:
        raise ValueError(f"rms_norm_gemv takes one row on the one-row path, got {row.shape[0]} rows "
                         f"and one_row={config.one_row}")
    check_dtype("norm_weight", norm_weight, (x.dtype,))
    if norm_weight.shape != (row.shape[1],) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight must be a contiguous ({row.shape[1]},), got shape {tuple(norm_weight.shape)}")
    tensors["norm_weight"] = norm_weight
    if residual is not None:
        check_dtype("residual", residual, (x.dtype,))
        if residual.shape != row.shape or residual.stride(1) != 1:
            raise ValueError(f"residual must be like x {tuple(row.shape)}, got shape {tuple(residual.shape)} "
                             f"strides {residual.stride()}")
        tensors["residual"] = residual
    if reduce is not None:
        tensors["pad_ptrs"] = reduce.pad_ptrs
    check_same_device(**tensors)
    y = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
    s = torch.empty_like(row, memory_format=torch.contiguous_format) if residual is not None else x
    _launch(x, weight, bias, y, config, norm=(norm_weight, float(eps), residual, s), reduce=reduce)
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
            push: PushChannel | None = None, reduce: PushChannel | None = None) -> None:
    """Launch the kernel on checked arguments; ``norm``: (norm weight, eps, residual or None,
    the buffer for x + residual); ``push`` / ``reduce``: the channel y goes out on / x came in on
    (x then is the (world_size, K) slots, one row)."""
    n, k = weight.shape
    rows = 1 if reduce is not None else x.shape[0]
    if rows == 0 or n == 0:
        return
    one_row = config.one_row and rows == 1
    if config.block_n < MIN_DOT_BLOCK and not one_row:
        raise ValueError(f"block_n {config.block_n} < {MIN_DOT_BLOCK} serves one row only (one_row), "
                         f"got {rows} rows")
    use_tma = config.tma and not one_row and tma_allowed(weight)
    w_desc = TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k]) if use_tma else weight
    pdl_on = pdl(x)
    use_pdl = config.prefetch is not False and pdl_on
    prefetch = bool(config.prefetch) or use_pdl
    norm_weight, eps, residual, res_out = norm if norm is not None else (weight, 0.0, None, weight)
    channel = push or reduce
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, w_desc, bias if bias is not None else weight, y,
        residual if residual is not None else weight, res_out, norm_weight,
        channel.inbox_ptrs if channel else weight, channel.pad_ptrs if channel else weight,
        channel.slot_offset if channel else 0, channel.pad_at if channel else 0, channel.half if channel else 0,
        rows, n, k, x.stride(0),
        l2_prefetch_columns(n, k, weight.element_size()) if use_pdl else 0, eps,
        HAS_BIAS=bias is not None, EVEN_N=n % config.block_n == 0, EVEN_K=k % config.block_k == 0,
        BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k, UPCAST_DOT=upcast_dot(x),
        USE_TMA=use_tma, ONE_ROW=one_row, NUM_STAGES=config.num_stages, PREFETCH=prefetch, PDL=use_pdl,
        GATED=gated, NORM=norm is not None, HAS_RESIDUAL=residual is not None,
        NORM_BLOCK=min(next_pow2(k), NORM_BLOCK_MAX), PUSH=push is not None, REDUCE=reduce is not None,
        RANK=channel.rank if channel else 0, WORLD=channel.world_size if channel else 1,
        SIGNAL_NEXT=pdl_on,
        num_warps=config.num_warps, num_stages=config.num_stages, **({"launch_pdl": True} if use_pdl else {}),
    )


def l2_prefetch_columns(n: int, k: int, element_size: int) -> int:
    """How many leading columns of an (n, k) W a PDL-launched GEMV asks L2 for:
    ``MINIVLLM_PDL_L2_MB`` worth (at least 64, at most k); 0 where unset or 0.

    Raises:
        ValueError: the variable is not a number >= 0.
    """
    raw = os.environ.get(L2_PREFETCH_ENV, "0")
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb >= 0:
        raise ValueError(f"{L2_PREFETCH_ENV} must be a number of MB >= 0, got {raw!r}")
    if mb == 0:
        return 0
    return min(k, max(64, int(mb * (1 << 20)) // (n * element_size)))


def tma_allowed(weight: torch.Tensor) -> bool:
    """Whether W's tiles can come by tensor-memory copy (``tma_rows_allowed`` of its rows;
    ``gemv`` already requires W contiguous)."""
    return tma_rows_allowed(weight, weight.shape[1] * weight.element_size())
