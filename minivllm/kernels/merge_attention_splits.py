"""Combine the per-split partial results of split-context (flash-decoding) attention.

Split s of a (sequence, head) row attended to a slice of the context and produced
its softmax-normalised output ``o_s`` and the base-2 log-sum-exp ``lse_s`` of its
(base-2) scores. The full softmax weights each split by its share of the total
probability mass::

    out = sum_s 2**(lse_s - M) * o_s / sum_s 2**(lse_s - M),    M = max_s lse_s

An empty split has lse -inf and weight 0; a row whose splits are all empty
(kv_len 0) gets zeros. One program per (head, sequence).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import (
    check_dtype, check_last_dim_contiguous, check_power_of_two, check_same_device, next_pow2, takes_pdl,
)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,                 # (B, H, S, D) fp32 contiguous
    part_lse_ptr,                 # (B, H, S) fp32 contiguous, base 2, -inf = empty split
    out_ptr,                      # (B, H, D)
    num_splits,
    stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    SIGNAL_NEXT: tl.constexpr,    # programmatic dependent launch: let the next kernel start
):
    """One (sequence, head): every split's log-sum-exp and output in one load each (no loop
    over splits), weighted and summed."""
    if SIGNAL_NEXT:
        tl.extra.cuda.gdc_launch_dependents()
    head = tl.program_id(0)
    seq = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    split_ok = offs_s < num_splits
    row = (seq * NUM_HEADS + head) * num_splits + offs_s                     # (BLOCK_S,)
    # Read once: ".cg" keeps the partials in L2 and out of L1.
    lse = tl.load(part_lse_ptr + row, mask=split_ok, other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, 0)
    # All splits empty: subtract 0 instead of -inf so the weights are exp2(-inf) = 0, not NaN.
    weight = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))             # (BLOCK_S,)
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=split_ok[:, None], other=0.0, cache_modifier=".cg")  # (BLOCK_S, D)
    total = tl.sum(weight, 0)
    out = tl.sum(weight[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)  # (D,)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


def merge_attention_splits(
    part_out: torch.Tensor,  # (B, H, S, D) fp32 contiguous
    part_lse: torch.Tensor,  # (B, H, S) fp32 contiguous
    out: torch.Tensor,       # (B, H, D), written in place
    *,
    pdl: bool = False,
) -> None:
    """Write into ``out`` the softmax-weighted combination of the split outputs; ``pdl``:
    let the next kernel start early where the device allows programmatic dependent launch.

    Raises:
        TypeError: partials are not fp32, or ``out`` is not bf16/fp16/fp32.
        ValueError: shapes disagree, partials are not contiguous, ``out``'s last
            dimension is strided, D is not a power of two, or devices differ.
    """
    check_dtype("part_out", part_out, (torch.float32,))
    check_dtype("part_lse", part_lse, (torch.float32,))
    check_dtype("out", out, (torch.bfloat16, torch.float16, torch.float32))
    check_same_device(part_out=part_out, part_lse=part_lse, out=out)
    if (part_out.dim() != 4 or part_lse.shape != part_out.shape[:3]
            or out.shape != part_out.shape[:2] + part_out.shape[3:]):
        raise ValueError(f"need part_out (B, H, S, D), part_lse (B, H, S), out (B, H, D); got "
                         f"{tuple(part_out.shape)}, {tuple(part_lse.shape)}, {tuple(out.shape)}")
    if not (part_out.is_contiguous() and part_lse.is_contiguous()):
        raise ValueError("part_out and part_lse must be contiguous")
    check_last_dim_contiguous("out", out)
    batch, num_heads, num_splits, head_dim = part_out.shape
    check_power_of_two("head_dim", head_dim)
    if num_splits < 1:
        raise ValueError("part_out must hold at least one split")
    if batch * num_heads == 0:
        return
    _merge_splits_kernel[(num_heads, batch)](
        part_out, part_lse, out, num_splits, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_S=next_pow2(num_splits),
        SIGNAL_NEXT=takes_pdl(pdl, out),
        num_warps=4 if num_splits * head_dim >= 2048 else 2,
    )


def merge_attention_splits_reference(part_out: torch.Tensor, part_lse: torch.Tensor) -> torch.Tensor:
    """Plain-torch merge in fp32: (B, H, S, D), (B, H, S) -> (B, H, D)."""
    m = part_lse.amax(dim=-1, keepdim=True)                        # (B, H, 1)
    weight = torch.exp2(part_lse - torch.where(m == float("-inf"), 0.0, m))
    total = weight.sum(dim=-1, keepdim=True)
    merged = (weight[..., None] * part_out.float()).sum(dim=2)
    return merged / torch.where(total > 0, total, 1.0)
