"""The MoE router's choice: softmax over all experts, top-k, renormalised when asked.

One program per token; the token's E logits sit in registers::

    p = softmax(logits)                 in float32 (16-bit logits widened), exp(l - max) / sum
    top-k of p, largest first           k rounds of (max, lowest index holding it)
    w = p[top] / sum(p[top])            only with norm_topk_prob

so it computes what transformers' ``Qwen3MoeTopKRouter`` does after its linear layer.
Outputs have fixed shapes (T, k) and nothing is read back on the host, so a decode
step that routes can be captured in a CUDA graph. Ties pick the lower expert index.

Torch reference: :func:`minivllm.kernels.reference.moe_topk_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, check_last_dim_contiguous, next_pow2, takes_pdl

MAX_EXPERTS = 4096  # one row of probabilities per program, in registers


@triton.jit
def route_row(logits, experts, valid, TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr):
    """(p, rank) of one token's fp32 ``logits`` (BLOCK_E,) over lanes ``experts``, E of them
    ``valid``: p the softmax (renormalised over the chosen when NORM), rank[e] = i when
    expert e is the i-th largest, -1 when not chosen."""
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)                                          # (BLOCK_E,), 0 past E
    # Probabilities are >= 0, so -1 marks lanes that can never win (past E, or already chosen).
    rank = tl.full((BLOCK_E,), -1, tl.int32)
    left = tl.where(valid, p, -1.0)
    for i in range(TOP_K):
        best = tl.max(left, axis=0)
        pick = tl.min(tl.where(left == best, experts, BLOCK_E), axis=0)
        rank = tl.where(experts == pick, i, rank)
        left = tl.where(experts == pick, -1.0, left)
    if NORM:
        p = p / tl.sum(tl.where(rank >= 0, p, 0.0), axis=0)
    return p, rank


@triton.jit
def _moe_topk_kernel(
    logits_ptr,                          # (T, E) float32/bf16/fp16, last dim contiguous
    weights_ptr,                         # (T, TOP_K) float32 contiguous
    ids_ptr,                             # (T, TOP_K) int32 contiguous
    stride_l,                            # row stride of logits
    E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
    NORM: tl.constexpr,                  # divide the top-k probabilities by their sum
    SIGNAL_NEXT: tl.constexpr,           # programmatic dependent launch: let the next kernel start
):
    if SIGNAL_NEXT:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < E
    logits = tl.load(logits_ptr + row * stride_l + experts, mask=valid, other=-float("inf")).to(tl.float32)
    p, rank = route_row(logits, experts, valid, TOP_K, NORM, BLOCK_E)
    chosen = rank >= 0
    # Scatter by rank: column i of the outputs receives the i-th largest.
    tl.store(weights_ptr + row * TOP_K + rank, p, mask=chosen)
    tl.store(ids_ptr + row * TOP_K + rank, experts, mask=chosen)


def moe_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, *,
             pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, ids)`` of the ``top_k`` experts of each token, largest first: weights
    (T, top_k) float32 (softmax over all E, then top-k, divided by their sum when
    ``norm_topk_prob``), ids (T, top_k) int32.

    Args:
        logits: (T, E) router logits, float32 or the model's 16 bits (widened in the kernel,
            as transformers' softmax widens them: no cast launch), with a contiguous last
            dimension; finite or -inf (an expert never chosen unless fewer than top_k remain).
        top_k: 1 <= top_k <= E.
        norm_topk_prob: renormalise the chosen probabilities to sum to 1.
        pdl: let the next kernel start early where the device allows programmatic
            dependent launch.

    Raises:
        TypeError: logits are not float32, bf16 or fp16.
        ValueError: logits not 2-D with a contiguous last dimension, more than
            ``MAX_EXPERTS`` experts, or top_k outside [1, E].
    """
    check_dtype("logits", logits, (torch.float32, torch.bfloat16, torch.float16))
    if logits.dim() != 2:
        raise ValueError(f"logits must be (T, E), got shape {tuple(logits.shape)}")
    check_last_dim_contiguous("logits", logits)
    tokens, experts = logits.shape
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"the number of experts must be in [1, {MAX_EXPERTS}], got {experts}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be an int in [1, {experts}], got {top_k!r}")
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        block_e = next_pow2(experts)
        _moe_topk_kernel[(tokens,)](
            logits, weights, ids, logits.stride(0), E=experts, TOP_K=top_k, BLOCK_E=block_e,
            NORM=bool(norm_topk_prob), SIGNAL_NEXT=takes_pdl(pdl, logits),
            num_warps=max(1, min(8, block_e // 256)),
        )
    return weights, ids
