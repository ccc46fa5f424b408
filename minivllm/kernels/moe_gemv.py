"""The experts of a sparse MoE layer for a few tokens: one GEMV per (token, expert) pair,
reading only the selected experts' weights, with no alignment pass::

    stage 1  grid (P, cdiv(I, BLOCK_N))    program (p, n), p = t * k + j, e = topk_ids[t, j]
             act[p, n-block] = silu(x[t] @ W13[e, gate rows].T) * (x[t] @ W13[e, up rows].T)
    stage 2  grid (T, cdiv(H, BLOCK_N))    program (t, n): token t's k choices in one tile
             out[t, n-block] = sum_j w[t, j] * (act[t * k + j] @ W2[e_j, n-block].T)

At decode a sparse layer is a weight stream, as a dense one is (``kernels/gemv.py``): the
time is the selected experts' bytes over the memory bandwidth. The grouped GEMM of
``kernels/fused_moe.py`` reads the same bytes but pads every expert to 16 rows and needs the
alignment pass first, and at one token its grid of (experts x column blocks) programs is too
small to keep the memory system busy. Here every program is a few weight rows on the CUDA
cores (the one-row GEMV's scheme: an fp32 tile of products per (row, k lane), summed at the
end), streamed in one pipelined loop: in stage 1 a column block's gate and up rows, in stage 2
the column block's rows of every choice of its token (k short loops one after the other kept
too few bytes in flight), each choice's act row loaded once a step for all the block's
columns (docs/tuning.md, "Experts at few tokens"). Two tokens that pick one
expert read its weights twice (from L2 when they are close in time), so the caller takes this
path for a few tokens only (``Ops.moe``).

Rounding at fused_moe's points, so the two paths differ only in the order of each dot
product's fp32 sum: gate and up rounded to x's dtype, then ``gated_silu``; each choice's down
sum scaled by its routing weight and rounded, the k of a token summed in fp32, rounded once.

FP8 experts (float8_e4m3fn W13 and W2 with float32 block or per-channel scales, as
``kernels/fused_moe.py`` takes them): weight-only, as ``kernels/fp8_gemv.py`` does for one
row. Each weight is dequantized in registers (times its 128x128 block scale, or the
channel scale after the sum), x and act stay in 16 bits: at a few tokens the time is the
weights' bytes, which FP8 halves, and quantizing x would only add rounding.

With ``pdl``, each program waits for the previous kernel (the router's ids feed its first
weight address, so no weight tile can load earlier) and lets the next kernel start once its
weights are streamed.

Torch references: :func:`minivllm.kernels.reference.fused_moe_reference`, and
:func:`~minivllm.kernels.reference.moe_gemv_fp8_reference` for FP8 experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minivllm.kernels._fp8_tiles import expert_scale_ptrs, scaled_tile
from minivllm.kernels._gemv_tiles import w_tile
from minivllm.kernels._launch import (check_dtype, check_power_of_two, check_same_device, check_tile_config, next_pow2,
                                      takes_pdl)
from minivllm.kernels._norm_act import gated_silu
from minivllm.kernels.fp8 import FP8_GROUP, ScaleMode
from minivllm.kernels.fused_moe import check_experts


@dataclass(frozen=True)
class MoeGemvConfig:
    """Tiles of one stage (a tuning knob, not semantics): a program streams a tile of
    2 x block_n weight rows in stage 1, top_k x block_n in stage 2. The defaults below are
    from sweeps of each stage on an H200 at Qwen3-30B-A3B's shapes, one token (docs/tuning.md,
    "Experts at few tokens")."""

    block_n: int = 4          # output columns per program; power of two
    block_k: int = 512        # reduction step; power of two >= 16
    num_warps: int = 4
    num_stages: int = 3       # weight tiles in flight per program

    def __post_init__(self) -> None:
        check_power_of_two("block_n", self.block_n)  # no tl.dot: any power of two
        check_tile_config(self, ("block_k",))


GATE_UP_CONFIG = MoeGemvConfig(block_n=4, block_k=512)     # K = hidden (2048 at Qwen3-30B-A3B)
BLOCK_SCALED_GATE_UP_CONFIG = MoeGemvConfig(block_n=16, block_k=128, num_warps=8)
DOWN_CONFIG = MoeGemvConfig(block_n=8, block_k=128)        # K = moe_intermediate (768); both formats


@triton.jit
def _rows_dot(w_rows, ws_rows, x_row, K, row_ok, FP8: tl.constexpr, BLOCK_SCALES: tl.constexpr,
              BLOCK_K: tl.constexpr, GROUP: tl.constexpr, NUM_STAGES: tl.constexpr):
    """(R,) fp32: each weight row at ``w_rows`` (R, 1) dotted with the one x row at ``x_row``,
    products kept per (row, k lane) and summed at the end. FP8: the rows' scales at
    ``ws_rows`` (``expert_scale_ptrs``), block scales on each weight, a channel scale on
    the sum."""
    acc = tl.zeros((w_rows.shape[0], BLOCK_K), tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        w = scaled_tile(w_tile(w_rows, k, row_ok, K, False, False), ws_rows, k0, row_ok, K, BLOCK_SCALES, GROUP)
        acc += w * tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if FP8 and not BLOCK_SCALES:
        y *= tl.load(ws_rows, mask=row_ok, other=0.0)
    return y


@triton.jit
def _gate_up_kernel(
    x_ptr,                # (T, H), last dim contiguous
    w13_ptr,              # (E, 2I, H) contiguous: gate rows, then up rows
    ws_ptr,               # FP8: W13's float32 scales (E, 2I / GROUP, cdiv(H, GROUP)) or (E, 2I)
    ids_ptr,              # (P,) int32 expert of each pair
    act_ptr,              # (P, I) contiguous
    stride_x, I, H,
    TOP_K: tl.constexpr, FP8: tl.constexpr, BLOCK_SCALES: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
):
    """One tile of 2 BLOCK_N weight rows, column n's gate row then its up row, so that one
    pipelined loop streams both."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    r = tl.arange(0, 2 * BLOCK_N)
    cols = tl.program_id(1) * BLOCK_N + r // 2
    row_ok = cols < I
    w_row = (r % 2) * I + cols                                   # row of expert's (2I, H) matrix
    y = _rows_dot(w13_ptr + expert * 2 * I * H + w_row.to(tl.int64)[:, None] * H,
                  expert_scale_ptrs(ws_ptr, expert, 2 * I, w_row, H, BLOCK_SCALES, GROUP),
                  x_ptr + (pair // TOP_K).to(tl.int64) * stride_x, H, row_ok,
                  FP8, BLOCK_SCALES, BLOCK_K, GROUP, NUM_STAGES)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    gate, up = tl.split(tl.reshape(y, (BLOCK_N, 2)))
    dtype = act_ptr.dtype.element_ty
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(act_ptr + pair.to(tl.int64) * I + cols, gated_silu(gate.to(dtype), up.to(dtype), dtype),
             mask=cols < I)


@triton.jit
def _down_kernel(
    act_ptr,              # (P, I) contiguous
    w2_ptr,               # (E, H, I) contiguous
    ws_ptr,               # FP8: W2's float32 scales (E, cdiv(H, GROUP), I / GROUP) or (E, H)
    ids_ptr,              # (P,) int32
    weights_ptr,          # (P,) float32 routing weights
    out_ptr,              # (T, H) contiguous
    H, I,
    TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, FP8: tl.constexpr, BLOCK_SCALES: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
):
    """Token t's TOP_K choices for BLOCK_N columns: a (TOP_K_POW2, BLOCK_N, SUB_K) weight
    tile against a (TOP_K_POW2, SUB_K) act tile, each choice's act row loaded once for all the
    columns. A choice past TOP_K (k not a power of two) repeats choice TOP_K - 1's addresses
    with its weights masked off, and counts 0. SUB_K = BLOCK_K, or GROUP for block scales
    when BLOCK_K is longer (one scale a row in each sub-step)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    choice = tl.arange(0, TOP_K_POW2)
    pair = token * TOP_K + tl.minimum(choice, TOP_K - 1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)                             # (C,)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (choice < TOP_K)[:, None] & (cols < H)[None, :]                     # (C, N)
    w_rows = w2_ptr + expert[:, None] * H * I + cols.to(tl.int64)[None, :] * I
    s_rows = expert_scale_ptrs(ws_ptr, expert[:, None], H, cols[None, :], I, BLOCK_SCALES, GROUP)   # (C, N)
    acc = tl.zeros((TOP_K_POW2, BLOCK_N, SUB_K), tl.float32)
    for k0 in tl.range(0, I, BLOCK_K, num_stages=NUM_STAGES):
        for k1 in tl.static_range(0, BLOCK_K, SUB_K):
            k = k0 + k1 + tl.arange(0, SUB_K)
            k_ok = k < I
            w = tl.load(w_rows[:, :, None] + k[None, None, :], mask=ok[:, :, None] & k_ok[None, None, :],
                        other=0.0).to(tl.float32)
            if BLOCK_SCALES:
                w *= tl.load(s_rows + (k0 + k1) // GROUP, mask=ok, other=0.0)[:, :, None]
            a = tl.load(act_ptr + pair[:, None] * I + k[None, :], mask=k_ok[None, :], other=0.0)
            acc += w * a.to(tl.float32)[:, None, :]
    y = tl.sum(acc, axis=2)                                                  # (C, N)
    if FP8 and not BLOCK_SCALES:
        y *= tl.load(s_rows, mask=ok, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    dtype = out_ptr.dtype.element_ty
    weighted = (y * tl.load(weights_ptr + pair)[:, None]).to(dtype).to(tl.float32)
    total = tl.sum(tl.where(ok, weighted, 0.0), axis=0)
    tl.store(out_ptr + token * H + cols, total.to(dtype), mask=cols < H)


def moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, gate_up_config: MoeGemvConfig | None = None,
             down_config: MoeGemvConfig | None = None, *, w13_scale: torch.Tensor | None = None,
             w2_scale: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """The experts' output (T, H) in x's dtype (module doc) for tokens routed to
    ``topk_ids`` with ``topk_weights``: what :func:`minivllm.kernels.fused_moe.fused_moe`
    returns, without an alignment.

    Args:
        x: (T, H) bf16 / fp16 / fp32 (bf16 / fp16 with FP8 experts), contiguous last dimension.
        w13: (E, 2I, H) contiguous, x's dtype or float8_e4m3fn: each expert's gate rows, then
            its up rows.
        w2: (E, H, I) contiguous, w13's dtype.
        topk_weights: (T, k) float32 contiguous.
        topk_ids: (T, k) int32 contiguous, every id in [0, E) (not checked: that would read
            the ids on the host).
        gate_up_config, down_config: tiles of the two stages (None: ``GATE_UP_CONFIG``, or
            ``BLOCK_SCALED_GATE_UP_CONFIG`` for block-scaled FP8 experts; ``DOWN_CONFIG``).
        w13_scale, w2_scale: float32 scales of FP8 experts (None for 16-bit ones), as
            :func:`minivllm.kernels.fused_moe.check_experts` says; their rank is the mode.
        pdl: take part in programmatic dependent launch where the device allows it.

    Raises:
        TypeError: as ``check_experts``, topk_weights not float32 or topk_ids not int32.
        ValueError: as ``check_experts``, shapes that disagree, non-contiguous operands, or
            tensors on different devices.
    """
    mode = _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    gate_up_config = gate_up_config or (BLOCK_SCALED_GATE_UP_CONFIG if mode == "block" else GATE_UP_CONFIG)
    down_config = down_config or DOWN_CONFIG
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = w2.shape[2]
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    use_pdl = takes_pdl(pdl, x)
    launch = {"launch_pdl": True} if use_pdl else {}
    act = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    fp8 = {"FP8": mode is not None, "BLOCK_SCALES": mode == "block", "GROUP": FP8_GROUP}
    _gate_up_kernel[(tokens * top_k, triton.cdiv(inter, gate_up_config.block_n))](
        x, w13, w13 if mode is None else w13_scale, topk_ids, act, x.stride(0), inter, hidden,
        TOP_K=top_k, **fp8, BLOCK_N=gate_up_config.block_n, BLOCK_K=gate_up_config.block_k,
        NUM_STAGES=gate_up_config.num_stages, PDL=use_pdl,
        num_warps=gate_up_config.num_warps, num_stages=gate_up_config.num_stages, **launch,
    )
    _down_kernel[(tokens, triton.cdiv(hidden, down_config.block_n))](
        act, w2, w2 if mode is None else w2_scale, topk_ids, topk_weights, out, hidden, inter,
        TOP_K=top_k, TOP_K_POW2=next_pow2(top_k), **fp8, BLOCK_N=down_config.block_n,
        BLOCK_K=down_config.block_k, SUB_K=min(down_config.block_k, FP8_GROUP) if mode == "block" else
        down_config.block_k, NUM_STAGES=down_config.num_stages, PDL=use_pdl,
        num_warps=down_config.num_warps, num_stages=down_config.num_stages, **launch,
    )
    return out


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None) -> ScaleMode | None:
    """Validate the arguments of :func:`moe_gemv` (raises as it says); the FP8 scale mode."""
    mode = check_experts(x, w13, w2, w13_scale, w2_scale)
    check_dtype("topk_weights", topk_weights, (torch.float32,))
    check_dtype("topk_ids", topk_ids, (torch.int32,))
    tokens = x.shape[0]
    for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.dim() != 2 or t.shape[0] != tokens or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous ({tokens}, k), got shape {tuple(t.shape)}")
    if topk_ids.shape != topk_weights.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must have one shape")
    check_same_device(x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    return mode
