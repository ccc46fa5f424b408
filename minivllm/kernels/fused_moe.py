"""The experts of a sparse MoE layer: a grouped GEMM over the aligned blocks of
``kernels/moe_align.py``, launched twice, then the sum over each token's k choices::

    stage 1 (GATED)  act[p]  = silu(x[t] @ W13[e, :I].T) * (x[t] @ W13[e, I:].T)   (P, I)
    stage 2          down[p] = w[p] * (act[p] @ W2[e].T)                          (P, H)
    sum              out[t]  = sum_j down[t * k + j]   (float32, rounded once)    (T, H)

for pair p = t * k + j of token t and expert e = topk_ids[t, j]. Grid (max_blocks,
cdiv(N, BLOCK_N)): program (b, n) multiplies block b's BLOCK_M rows (gathered through
``sorted_pair_ids``; sentinel rows are masked) by expert ``block_expert[b]``'s weights at
output columns n. Blocks past the used ones (expert -1) return after one load: the grid
is sized for the worst case so that it needs no host sync.

Rounding where transformers' ``Qwen3MoeExperts`` rounds in x's dtype: gate and up after
their fp32 sums, silu(gate), and the product (the SiLU-and-mul kernel's ``gated_silu``);
the down projection's fp32 sum is scaled by the routing weight before its one rounding,
and the k rows of a token are summed in fp32 (transformers adds them in x's dtype) by
``kernels/moe_sum.py``.
With k = 1 stage 2 writes ``out`` directly.

FP8 experts (float8_e4m3fn W13 and W2 with float32 scales, ``kernels/fp8.py``): W8A8 as
``kernels/fp8_gemm.py``, in the same kernel. Each stage quantizes its input rows (x, then
the 16-bit act) to e4m3 inside its K loop, whose step is then the 128-column group::

    block scales s (E, cdiv(rows, 128), cdiv(K, 128))   per channel s (E, rows)
      per group g: xs = amax(a[rows, g]) / 448            xs = amax(a[rows, :]) / 448 (a first pass)
      acc += (e4m3(a * (1 / xs)) @ W[cols, g]^T)          acc += e4m3(a * (1 / xs)) @ W[cols, g]^T
             * xs[:, None] * s[e, cols // 128, g]         epilogue: acc * xs[:, None] * s[e, cols]

The rounding points after the fp32 sums are the 16-bit ones. The fp8 ``tl.dot`` needs fp8
tensor cores (compute capability 8.9 or later). Block scales need I to be a
multiple of 128, so that no scale block holds both gate and up rows (the up rows' scales
start at block row I / 128). Which scales the weights carry follows from their rank
(:func:`check_experts`). Each column program quantizes its rows anew, at the cost of a
few ALU ops per element beside the dot (the dense GEMM quantizes x once first instead:
``kernels/fp8_gemm.py``). The layer's tiles, by rows per expert: :func:`default_tiles`.

Torch references: :func:`minivllm.kernels.reference.fused_moe_reference`, and
:func:`~minivllm.kernels.reference.fused_moe_fp8_reference` for FP8 experts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from minivllm.kernels._fp8_tiles import expert_scale_ptrs
from minivllm.kernels._gemm_tiles import wt_tile, x_tile
from minivllm.kernels._launch import (
    check_dtype, check_last_dim_contiguous, check_power_of_two, check_same_device, check_tile_config, takes_pdl,
    upcast_dot,
)
from minivllm.kernels._norm_act import gated_silu
from minivllm.kernels.fp8 import FP8_DTYPE, FP8_GROUP, ScaleMode, e4m3_scales, exact_cast, quantize_e4m3
from minivllm.kernels.moe_align import MoeAlignment
from minivllm.kernels.moe_sum import moe_sum

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8_X_DTYPES = (torch.bfloat16, torch.float16)  # as fp8_gemm's x


@dataclass(frozen=True)
class FusedMoeConfig:
    """Tile and launch parameters of both stages (a tuning knob, not semantics; the layer
    takes :func:`default_tiles`). BLOCK_M is the alignment's ``block_m``. FP8 experts step
    K by the 128-column activation group instead of ``block_k``."""

    block_n: int = 64         # output columns per program; power of two >= 16
    block_k: int = 64         # reduction step of 16-bit experts; power of two >= 16
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        check_tile_config(self, ("block_n", "block_k"))


def default_tiles(tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> tuple[int, FusedMoeConfig]:
    """``(block_m, config)`` for ``tokens`` tokens' pairs over ``num_experts`` experts of
    weight ``dtype``, by the rows an expert gets on average (tokens * top_k / num_experts):
    16-row blocks while that is under 32 (decode: a block holds the few pairs an expert
    gets, padding least), then 64, and for 16-bit experts 128 from 128 rows (prefill: each
    weight tile reused over more rows). From the tiling sweep of ``benchmarks.moe --sweep``
    (docs/tuning.md, "Experts at many tokens"); float32 experts step K by 32 columns, which
    keeps the pipelined tiles within shared memory. The shape decides, so each captured
    batch size keeps its tiles."""
    rows = tokens * top_k / num_experts
    size = 0 if rows < 32 else 1 if rows < 128 else 2
    return _tiles(size, dtype == FP8_DTYPE, dtype.itemsize == 4)


@functools.lru_cache(maxsize=None)
def _tiles(size: int, fp8: bool, wide: bool) -> tuple[int, FusedMoeConfig]:
    """:func:`default_tiles` for a size class (0: under 32 rows an expert, 1: under 128, 2:
    more), built once per class rather than on every layer of every step."""
    if size == 0:  # FP8: 128 columns a program; 16-bit: 64, as fast at a full batch, more programs below it
        block_m, config = 16, FusedMoeConfig(block_n=128 if fp8 else 64, block_k=128, num_warps=4, num_stages=3)
    elif fp8:
        block_m, config = 64, FusedMoeConfig(block_n=128, num_warps=8, num_stages=3)
    elif size == 1:
        block_m, config = 64, FusedMoeConfig(block_n=64, block_k=64, num_warps=4, num_stages=3)
    else:
        block_m, config = 128, FusedMoeConfig(block_n=128, block_k=64, num_warps=8, num_stages=3)
    return block_m, replace(config, block_k=32) if wide else config


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,                # GATED: x (T, K) rows of tokens; else act (P, K) rows of pairs
    w_ptr,                # GATED: W13 (E, 2N, K), gate rows first; else W2 (E, N, K); contiguous
    ws_ptr,               # FP8: W's float32 scales, (E, cdiv(rows, GROUP), cdiv(K, GROUP)) or (E, rows)
    out_ptr,              # (P, N) contiguous (stage 2 with TOP_K 1: out (T, N) = (P, N))
    pair_ptr,             # (max_blocks * BLOCK_M,) int32 sorted pair ids, P = padding
    block_expert_ptr,     # (max_blocks,) int32, -1 = unused block
    topk_weights_ptr,     # (P,) float32 routing weight of each pair (read unless GATED)
    stride_a,             # row stride of a (last dim contiguous)
    num_pairs, N, K,
    TOP_K: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,            # CPU interpreter + bf16: see _launch.upcast_dot
    FP8: tl.constexpr,                   # e4m3 W and a (quantized here); BLOCK_K is then GROUP
    BLOCK_SCALES: tl.constexpr,          # FP8 with 128x128 weight blocks; else per channel
    GROUP: tl.constexpr,
    EXACT_CAST: tl.constexpr,            # CPU interpreter: round to e4m3 before the cast (fp8.to_e4m3)
    SIGNAL_NEXT: tl.constexpr,           # programmatic dependent launch: let the next kernel start
):
    if SIGNAL_NEXT:
        tl.extra.cuda.gdc_launch_dependents()
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= 0:
        pairs = tl.load(pair_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))   # (BLOCK_M,)
        row_ok = pairs < num_pairs
        if GATED:  # pair t * k + j reads token t's row
            a_rows = pairs // TOP_K
        else:
            a_rows = pairs
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)             # (BLOCK_N,)
        col_ok = cols < N
        a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_a              # (BLOCK_M, 1)
        w_rows = 2 * N if GATED else N
        w_ptrs = w_ptr + expert.to(tl.int64) * w_rows * K + cols.to(tl.int64)[None, :] * K  # (1, BLOCK_N)
        if FP8:  # the up rows' scales: rows N + cols (on a block edge: N % GROUP == 0)
            acc, acc_up = _fp8_products(
                a_ptrs, w_ptrs, expert_scale_ptrs(ws_ptr, expert, w_rows, cols, K, BLOCK_SCALES, GROUP),
                expert_scale_ptrs(ws_ptr, expert, w_rows, N + cols, K, BLOCK_SCALES, GROUP), row_ok, col_ok, N, K,
                GATED, BLOCK_SCALES, BLOCK_M, BLOCK_N, GROUP, EXACT_CAST)
        else:
            acc, acc_up = _products(a_ptrs, w_ptrs, row_ok, col_ok, N, K, GATED, BLOCK_M, BLOCK_N, BLOCK_K,
                                    DOT_PRECISION, UPCAST_DOT)
        dtype = out_ptr.dtype.element_ty
        if GATED:
            y = gated_silu(acc.to(dtype), acc_up.to(dtype), dtype)
        else:
            y = (acc * tl.load(topk_weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]).to(dtype)
        out = out_ptr + pairs.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(out, y, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _products(a_ptrs, w_ptrs, row_ok, col_ok, N, K, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """``(acc, acc_up)`` (BLOCK_M, BLOCK_N) fp32: a's rows times the gate (or only) rows of W
    and, GATED, the up rows N rows below them (acc_up stays 0 otherwise)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptrs + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        acc = _dot(a, wt_tile(w_ptrs, k, col_ok, K), acc, DOT_PRECISION, UPCAST_DOT)   # W^T tile (BLOCK_K, BLOCK_N)
        if GATED:
            acc_up = _dot(a, wt_tile(w_ptrs + N * K, k, col_ok, K), acc_up, DOT_PRECISION, UPCAST_DOT)
    return acc, acc_up


@triton.jit
def _dot(a, w, acc, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """``acc + a @ w`` in fp32."""
    if UPCAST_DOT:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    return tl.dot(a, w, acc, input_precision=DOT_PRECISION)


@triton.jit
def _fp8_products(a_ptrs, w_ptrs, ws_gate, ws_up, row_ok, col_ok, N, K, GATED: tl.constexpr,
                  BLOCK_SCALES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                  EXACT_CAST: tl.constexpr):
    """What :func:`_products` returns for e4m3 W with its scales at ``ws_gate`` / ``ws_up``
    (``expert_scale_ptrs``), a quantized per row and group (BLOCK_SCALES) or per row (module doc)."""
    offs_k = tl.arange(0, GROUP)
    if not BLOCK_SCALES:  # one scale a row over all of K: a first pass over a
        amax = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, GROUP):
            amax = tl.maximum(amax, tl.max(tl.abs(x_tile(a_ptrs, k0 + offs_k, row_ok, K).to(tl.float32)), axis=1))
        xs, inv = e4m3_scales(amax)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, GROUP):
        a = x_tile(a_ptrs, k0 + offs_k, row_ok, K).to(tl.float32)             # (BLOCK_M, GROUP)
        if BLOCK_SCALES:
            xs, inv = e4m3_scales(tl.max(tl.abs(a), axis=1))
        aq = quantize_e4m3(a, inv[:, None], EXACT_CAST)
        acc = _fp8_dot(aq, wt_tile(w_ptrs, k0 + offs_k, col_ok, K), acc, xs, ws_gate + k0 // GROUP, col_ok,
                       BLOCK_SCALES)
        if GATED:
            acc_up = _fp8_dot(aq, wt_tile(w_ptrs + N * K, k0 + offs_k, col_ok, K), acc_up, xs, ws_up + k0 // GROUP,
                              col_ok, BLOCK_SCALES)
    if not BLOCK_SCALES:
        acc = acc * xs[:, None] * tl.load(ws_gate, mask=col_ok, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * xs[:, None] * tl.load(ws_up, mask=col_ok, other=0.0)[None, :]
    return acc, acc_up


@triton.jit
def _fp8_dot(aq, w, acc, xs, ws_ptrs, col_ok, BLOCK_SCALES: tl.constexpr):
    """``acc + aq @ w`` for e4m3 tiles of one group; BLOCK_SCALES: the product times the rows'
    scales ``xs`` and the group's weight scales at ``ws_ptrs`` (per channel: after the loop)."""
    if BLOCK_SCALES:
        ws = tl.load(ws_ptrs, mask=col_ok, other=0.0)
        acc += tl.dot(aq, w) * xs[:, None] * ws[None, :]
    else:
        acc = tl.dot(aq, w, acc)
    return acc


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              alignment: MoeAlignment, config: FusedMoeConfig | None = None, *,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              pdl: bool = False) -> torch.Tensor:
    """The experts' output (T, H) in x's dtype (module doc) for tokens routed as
    ``topk_weights`` and ``alignment`` say.

    Args:
        x: (T, H) bf16 / fp16 / fp32 (bf16 / fp16 with FP8 experts), contiguous last dimension.
        w13: (E, 2I, H) contiguous, x's dtype or float8_e4m3fn: each expert's gate rows, then
            its up rows.
        w2: (E, H, I) contiguous, w13's dtype: each expert's down projection.
        topk_weights: (T, k) float32 contiguous, the routing weight of each pair.
        alignment: :func:`minivllm.kernels.moe_align.moe_align` of the (T, k) expert ids
            with E experts.
        config: tiles of both stages (None: ``FusedMoeConfig()``).
        w13_scale, w2_scale: float32 scales of FP8 experts (None for 16-bit ones); their
            rank says the mode (:func:`check_experts`).
        pdl: let the next kernel start early where the device allows programmatic
            dependent launch.

    Raises:
        TypeError: as :func:`check_experts`, topk_weights not float32, or alignment tensors
            not int32.
        ValueError: as :func:`check_experts`, shapes that disagree (alignment of another
            T * k), strided or non-contiguous operands, or tensors on different devices.
    """
    mode = _check(x, w13, w2, topk_weights, alignment, w13_scale, w2_scale)
    config = config or FusedMoeConfig()
    tokens, hidden = x.shape
    top_k = topk_weights.shape[1]
    inter = w2.shape[2]
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    act = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    _launch(x, w13, w13_scale, act, topk_weights, alignment, config, mode, gated=True, pdl=pdl)
    down = out if top_k == 1 else torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _launch(act, w2, w2_scale, down, topk_weights, alignment, config, mode, gated=False, pdl=pdl)
    if top_k > 1:
        moe_sum(down, top_k, out)
    return out


def _launch(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None, out: torch.Tensor,
            topk_weights: torch.Tensor, alignment: MoeAlignment, config: FusedMoeConfig,
            mode: ScaleMode | None, *, gated: bool, pdl: bool) -> None:
    """One stage of the grouped GEMM on checked arguments: out (P, N) from a's rows (``mode``
    None: 16-bit weights, and W stands in for the scales the kernel does not read)."""
    n, k = out.shape[1], a.shape[1]
    fp8 = mode is not None
    _grouped_gemm_kernel[(alignment.block_expert.shape[0], triton.cdiv(n, config.block_n))](
        a, w, w_scale if fp8 else w, out, alignment.sorted_pair_ids, alignment.block_expert, topk_weights,
        a.stride(0), alignment.num_pairs, n, k,
        TOP_K=topk_weights.shape[1], GATED=gated,
        BLOCK_M=alignment.block_m, BLOCK_N=config.block_n, BLOCK_K=FP8_GROUP if fp8 else config.block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", UPCAST_DOT=upcast_dot(a),
        FP8=fp8, BLOCK_SCALES=mode == "block", GROUP=FP8_GROUP, EXACT_CAST=exact_cast(a),
        SIGNAL_NEXT=takes_pdl(pdl, a), num_warps=config.num_warps, num_stages=config.num_stages,
    )


def check_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                  w2_scale: torch.Tensor | None) -> ScaleMode | None:
    """Validate x (T, H) and the expert weights of both expert paths; return the FP8 scale
    mode, None for 16-bit weights. w13 (E, 2I, H) and w2 (E, H, I) are contiguous, in x's
    dtype without scales, or float8_e4m3fn with contiguous float32 scales whose rank is the
    mode (a checkpoint's ``weight_scale_inv`` per expert, stacked as the weights are)::

        "block"    w13_scale (E, cdiv(2I, 128), cdiv(H, 128))   w2_scale (E, cdiv(H, 128), I / 128)
        "channel"  w13_scale (E, 2I)                            w2_scale (E, H)

    Block scales need I % 128 == 0: a scale block then never holds both gate and up rows.

    Raises:
        TypeError: x not bf16/fp16/fp32 (bf16/fp16 with FP8 weights), w13 neither x's dtype
            nor float8_e4m3fn, w2 not w13's dtype, or scales not float32.
        ValueError: x not 2-D with a contiguous last dimension, weights not contiguous of the
            shapes above, FP8 weights without both scales (16-bit ones with one), scales of
            other shapes or modes, block scales with I % 128 != 0, or tensors on different
            devices.
    """
    check_dtype("x", x, _DTYPES)
    check_dtype("w13", w13, (x.dtype, FP8_DTYPE))
    check_dtype("w2", w2, (w13.dtype,))
    if x.dim() != 2:
        raise ValueError(f"x must be (T, H), got shape {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    hidden = x.shape[1]
    if w2.dim() != 3 or w2.shape[1] != hidden or not w2.is_contiguous():
        raise ValueError(f"w2 must be a contiguous (E, {hidden}, I), got shape {tuple(w2.shape)} "
                         f"strides {w2.stride()}")
    experts, _, inter = w2.shape
    if w13.shape != (experts, 2 * inter, hidden) or not w13.is_contiguous():
        raise ValueError(f"w13 must be a contiguous ({experts}, {2 * inter}, {hidden}), got shape "
                         f"{tuple(w13.shape)} strides {w13.stride()}")
    if w13.dtype != FP8_DTYPE:
        if w13_scale is not None or w2_scale is not None:
            raise ValueError(f"w13_scale and w2_scale are for float8_e4m3fn experts, got {w13.dtype} weights")
        return None
    check_dtype("x", x, _FP8_X_DTYPES)
    mode = _check_scales(w13_scale, w2_scale, experts, inter, hidden)
    check_same_device(x=x, w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale)
    return mode


def _check_scales(w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None, experts: int, inter: int,
                  hidden: int) -> ScaleMode:
    """The mode of FP8 experts' scales, checked against E, I and H (raises as
    :func:`check_experts` says)."""
    if w13_scale is None or w2_scale is None:
        raise ValueError("float8_e4m3fn experts need w13_scale and w2_scale")
    check_dtype("w13_scale", w13_scale, (torch.float32,))
    check_dtype("w2_scale", w2_scale, (torch.float32,))
    mode: ScaleMode = "block" if w13_scale.dim() == 3 else "channel"
    if mode == "block":
        h_blocks = triton.cdiv(hidden, FP8_GROUP)
        want = {"w13_scale": (experts, triton.cdiv(2 * inter, FP8_GROUP), h_blocks),
                "w2_scale": (experts, h_blocks, triton.cdiv(inter, FP8_GROUP))}
    else:
        want = {"w13_scale": (experts, 2 * inter), "w2_scale": (experts, hidden)}
    for name, scale in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if tuple(scale.shape) != want[name] or not scale.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {want[name]} for {mode} scales (w13_scale 3-D: "
                             f"128x128 blocks, 2-D: per channel), got shape {tuple(scale.shape)} "
                             f"strides {scale.stride()}")
    if mode == "block" and inter % FP8_GROUP:
        raise ValueError(f"block scales need the moe intermediate size I (w2.shape[2]) to be a multiple of "
                         f"{FP8_GROUP}, so that no scale block holds both gate and up rows; got I = {inter}")
    return mode


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           alignment: MoeAlignment, w13_scale: torch.Tensor | None,
           w2_scale: torch.Tensor | None) -> ScaleMode | None:
    """Validate the arguments of :func:`fused_moe` (raises as it says); the FP8 scale mode."""
    mode = check_experts(x, w13, w2, w13_scale, w2_scale)
    check_dtype("topk_weights", topk_weights, (torch.float32,))
    check_dtype("alignment.sorted_pair_ids", alignment.sorted_pair_ids, (torch.int32,))
    check_dtype("alignment.block_expert", alignment.block_expert, (torch.int32,))
    tokens = x.shape[0]
    if topk_weights.dim() != 2 or topk_weights.shape[0] != tokens or not topk_weights.is_contiguous():
        raise ValueError(f"topk_weights must be a contiguous ({tokens}, k), got shape "
                         f"{tuple(topk_weights.shape)}")
    check_power_of_two("alignment.block_m", alignment.block_m, minimum=16)
    blocks = alignment.block_expert.shape[0]
    if (alignment.num_pairs != topk_weights.numel() or alignment.block_expert.dim() != 1
            or alignment.sorted_pair_ids.shape != (blocks * alignment.block_m,)
            or not alignment.sorted_pair_ids.is_contiguous()):
        raise ValueError(f"alignment must be of {topk_weights.numel()} pairs with (max_blocks * block_m,) "
                         f"sorted_pair_ids, got {alignment.num_pairs} pairs, sorted_pair_ids "
                         f"{tuple(alignment.sorted_pair_ids.shape)}, block_expert "
                         f"{tuple(alignment.block_expert.shape)}, block_m {alignment.block_m}")
    check_same_device(x=x, w13=w13, w2=w2, topk_weights=topk_weights,
                      sorted_pair_ids=alignment.sorted_pair_ids, block_expert=alignment.block_expert)
    return mode
