"""The vocab-parallel embedding lookup of one rank: the rows of the ids in its vocabulary range.

Rank r of a tensor-parallel group holds the embedding rows ``[vocab_start, vocab_end)``
(``layers/embedding.py``). For each token it writes that row when ``vocab_start <= id <
vocab_end`` (half-open: an id equal to ``vocab_end`` is the next rank's) and zeros
otherwise; the all-reduce after it adds the ranks' outputs, so every id is looked up on
exactly one rank. Grid ``(T, cdiv(D, BLOCK))``.

Why a kernel: in torch the same lookup is seven launches (two comparisons, their
``and``, the shift, the masked ids, the gather, the zeroing multiply), and at decode
batch sizes the launches, not the bytes, set its time (``benchmarks.tp_step_tail``
times both).

Torch reference: :func:`minivllm.kernels.reference.vocab_shard_embedding_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, check_same_device, next_pow2

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["vocab_start", "rows_here"])
def _vocab_shard_embedding_kernel(
    ids_ptr,                    # (T,) int32 / int64 token ids
    weight_ptr,                 # (>= rows_here, D) this rank's rows, contiguous
    out_ptr,                    # (T, D) contiguous
    vocab_start, rows_here,     # the rank's range is [vocab_start, vocab_start + rows_here)
    D: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    local = tl.load(ids_ptr + token).to(tl.int64) - vocab_start
    mine = (local >= 0) & (local < rows_here)
    row = tl.where(mine, local, 0)
    width = tl.where(mine, D, 0)  # columns to read: all of the row, or none (a zero row)
    x = tl.load(weight_ptr + row * D + cols, mask=cols < width, other=0.0)
    tl.store(out_ptr + token * D + cols, x, mask=mask)


def vocab_shard_embedding(ids: torch.Tensor, weight: torch.Tensor, vocab_start: int, vocab_end: int) -> torch.Tensor:
    """(T, D) in weight's dtype: ``weight[id - vocab_start]`` where ``vocab_start <= id <
    vocab_end``, zeros elsewhere.

    Raises:
        TypeError: ids are not int32 / int64, or weight is not floating point.
        ValueError: ids are not 1-D, weight is not a contiguous (rows, D) holding the
            range, or the tensors live on different devices.
    """
    check_dtype("ids", ids, (torch.int32, torch.int64))
    check_dtype("weight", weight, _FLOAT_DTYPES)
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D (T,), got shape {tuple(ids.shape)}")
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous (rows, D), got shape {tuple(weight.shape)}")
    if not 0 <= vocab_start <= vocab_end or vocab_end - vocab_start > weight.shape[0]:
        raise ValueError(f"the range [{vocab_start}, {vocab_end}) does not fit weight's {weight.shape[0]} rows")
    check_same_device(ids=ids, weight=weight)
    tokens, dim = ids.shape[0], weight.shape[1]
    out = torch.empty(tokens, dim, dtype=weight.dtype, device=weight.device)
    if tokens and dim:
        block = min(1024, next_pow2(dim))
        _vocab_shard_embedding_kernel[(tokens, triton.cdiv(dim, block))](
            ids.contiguous(), weight, out, vocab_start, vocab_end - vocab_start, D=dim, BLOCK=block,
            num_warps=4 if block >= 512 else 1)
    return out
