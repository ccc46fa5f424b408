"""The last step of the grouped experts (``kernels/fused_moe.py``): each token's k rows,
already weighted by their routing weights, summed::

    out[t] = sum_j rows[t * k + j]      (float32, rounded once to out's dtype)

Grid (T, cdiv(H, BLOCK)): a program loads its token's k rows at BLOCK columns as one
(k rounded up to a power of two, BLOCK) tile, masked, and sums it in float32. One kernel
where torch takes two (the float32 sum into a new tensor, then its cast into ``out``).

Torch reference: :func:`minivllm.kernels.reference.moe_sum_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, next_pow2

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK = 1024  # columns a program; Qwen3-30B-A3B's hidden size is two of them


@triton.jit
def _moe_sum_kernel(
    rows_ptr,                  # (T * TOP_K, H) contiguous
    out_ptr,                   # (T, H) contiguous
    H,
    TOP_K: tl.constexpr, K_POW2: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    choice = tl.arange(0, K_POW2)
    col_ok = cols < H
    mask = (choice < TOP_K)[:, None] & col_ok[None, :]
    ptrs = rows_ptr + (token * TOP_K + choice)[:, None] * H + cols[None, :]
    total = tl.sum(tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), axis=0)
    tl.store(out_ptr + token * H + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


def moe_sum(rows: torch.Tensor, top_k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` (T, H), row t the float32 sum of ``rows[t * top_k : (t + 1) * top_k]``
    rounded to out's dtype; ``rows`` (T * top_k, H) contiguous; ``out`` None: a new tensor
    of rows' dtype.

    Raises:
        TypeError: rows or out not bf16 / fp16 / fp32.
        ValueError: top_k < 1, rows not 2-D contiguous with a multiple of top_k rows, out
            not a contiguous (T, H), or the two on different devices.
    """
    check_dtype("rows", rows, _DTYPES)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
    if rows.dim() != 2 or not rows.is_contiguous() or rows.shape[0] % top_k:
        raise ValueError(f"rows must be a contiguous (T * top_k, H) with top_k {top_k}, got shape "
                         f"{tuple(rows.shape)} strides {rows.stride()}")
    tokens, hidden = rows.shape[0] // top_k, rows.shape[1]
    if out is None:
        out = torch.empty(tokens, hidden, dtype=rows.dtype, device=rows.device)
    check_dtype("out", out, _DTYPES)
    if out.shape != (tokens, hidden) or not out.is_contiguous() or out.device != rows.device:
        raise ValueError(f"out must be a contiguous {(tokens, hidden)} on {rows.device}, got shape "
                         f"{tuple(out.shape)} on {out.device}")
    if tokens and hidden:
        block = min(BLOCK, next_pow2(hidden))
        _moe_sum_kernel[(tokens, triton.cdiv(hidden, block))](
            rows, out, hidden, TOP_K=top_k, K_POW2=next_pow2(top_k), BLOCK=block,
            num_warps=4 if block >= 512 else 1)
    return out
