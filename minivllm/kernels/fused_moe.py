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
and the k rows of a token are summed in fp32 (transformers adds them in x's dtype).
With k = 1 stage 2 writes ``out`` directly.

Torch reference: :func:`minivllm.kernels.reference.fused_moe_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import (
    check_dtype, check_last_dim_contiguous, check_power_of_two, check_same_device, check_tile_config, takes_pdl,
    upcast_dot,
)
from minivllm.kernels.moe_align import MoeAlignment
from minivllm.kernels.silu_and_mul import gated_silu

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class FusedMoeConfig:
    """Tile and launch parameters of both stages (a tuning knob, not semantics; not tuned:
    no GPU measurement yet). BLOCK_M is the alignment's ``block_m``."""

    block_n: int = 64         # output columns per program; power of two >= 16
    block_k: int = 64         # reduction step; power of two >= 16
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        check_tile_config(self, ("block_n", "block_k"))


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,                # GATED: x (T, K) rows of tokens; else act (P, K) rows of pairs
    w_ptr,                # GATED: W13 (E, 2N, K), gate rows first; else W2 (E, N, K); contiguous
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
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)                     # GATED only
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            a = tl.load(a_ptrs + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            acc = _dot(a, tl.load(w_ptrs + k[:, None], mask=w_mask, other=0.0), acc,
                       DOT_PRECISION, UPCAST_DOT)                             # W tile (BLOCK_K, BLOCK_N)
            if GATED:  # the up rows are N rows below the gate rows
                acc_up = _dot(a, tl.load(w_ptrs + N * K + k[:, None], mask=w_mask, other=0.0), acc_up,
                              DOT_PRECISION, UPCAST_DOT)
        dtype = out_ptr.dtype.element_ty
        if GATED:
            y = gated_silu(acc.to(dtype), acc_up.to(dtype), dtype)
        else:
            y = (acc * tl.load(topk_weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]).to(dtype)
        out = out_ptr + pairs.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(out, y, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _dot(a, w, acc, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """``acc + a @ w`` in fp32."""
    if UPCAST_DOT:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    return tl.dot(a, w, acc, input_precision=DOT_PRECISION)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              alignment: MoeAlignment, config: FusedMoeConfig | None = None, *,
              pdl: bool = False) -> torch.Tensor:
    """The experts' output (T, H) in x's dtype (module doc) for tokens routed as
    ``topk_weights`` and ``alignment`` say.

    Args:
        x: (T, H) bf16 / fp16 / fp32 with a contiguous last dimension.
        w13: (E, 2I, H) contiguous, x's dtype: each expert's gate rows, then its up rows.
        w2: (E, H, I) contiguous, x's dtype: each expert's down projection.
        topk_weights: (T, k) float32 contiguous, the routing weight of each pair.
        alignment: :func:`minivllm.kernels.moe_align.moe_align` of the (T, k) expert ids
            with E experts.
        config: tiles of both stages (None: ``FusedMoeConfig()``).
        pdl: let the next kernel start early where the device allows programmatic
            dependent launch.

    Raises:
        TypeError: x not bf16/fp16/fp32, weights not x's dtype, topk_weights not float32,
            or alignment tensors not int32.
        ValueError: shapes that disagree (alignment of another T * k), strided or
            non-contiguous operands, or tensors on different devices.
    """
    _check(x, w13, w2, topk_weights, alignment)
    config = config or FusedMoeConfig()
    tokens, hidden = x.shape
    top_k = topk_weights.shape[1]
    inter = w2.shape[2]
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    act = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    _launch(x, w13, act, topk_weights, alignment, config, gated=True, pdl=pdl)
    down = out if top_k == 1 else torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _launch(act, w2, down, topk_weights, alignment, config, gated=False, pdl=pdl)
    if top_k > 1:
        out.copy_(down.view(tokens, top_k, hidden).sum(dim=1, dtype=torch.float32))
    return out


def _launch(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, topk_weights: torch.Tensor,
            alignment: MoeAlignment, config: FusedMoeConfig, *, gated: bool, pdl: bool) -> None:
    """One stage of the grouped GEMM on checked arguments: out (P, N) from a's rows."""
    n, k = out.shape[1], a.shape[1]
    _grouped_gemm_kernel[(alignment.block_expert.shape[0], triton.cdiv(n, config.block_n))](
        a, w, out, alignment.sorted_pair_ids, alignment.block_expert, topk_weights, a.stride(0),
        alignment.num_pairs, n, k,
        TOP_K=topk_weights.shape[1], GATED=gated,
        BLOCK_M=alignment.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", UPCAST_DOT=upcast_dot(a),
        SIGNAL_NEXT=takes_pdl(pdl, a), num_warps=config.num_warps, num_stages=config.num_stages,
    )


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           alignment: MoeAlignment) -> None:
    """Validate the arguments of :func:`fused_moe` (raises as it says)."""
    check_dtype("x", x, _DTYPES)
    check_dtype("w13", w13, (x.dtype,))
    check_dtype("w2", w2, (x.dtype,))
    check_dtype("topk_weights", topk_weights, (torch.float32,))
    check_dtype("alignment.sorted_pair_ids", alignment.sorted_pair_ids, (torch.int32,))
    check_dtype("alignment.block_expert", alignment.block_expert, (torch.int32,))
    if x.dim() != 2:
        raise ValueError(f"x must be (T, H), got shape {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    tokens, hidden = x.shape
    if w2.dim() != 3 or w2.shape[1] != hidden or not w2.is_contiguous():
        raise ValueError(f"w2 must be a contiguous (E, {hidden}, I), got shape {tuple(w2.shape)} "
                         f"strides {w2.stride()}")
    experts, _, inter = w2.shape
    if w13.shape != (experts, 2 * inter, hidden) or not w13.is_contiguous():
        raise ValueError(f"w13 must be a contiguous ({experts}, {2 * inter}, {hidden}), got shape "
                         f"{tuple(w13.shape)} strides {w13.stride()}")
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
