"""Align the (token, expert) pairs of MoE routing into expert-contiguous blocks.

Pair ``p = t * k + j`` is token t's j-th choice, expert ``topk_ids[t, j]``. The grouped
GEMM (``kernels/fused_moe.py``) multiplies BLOCK_M rows of one expert at a time, so the
pairs are sorted by expert (ascending pair id within an expert) and each expert's segment
is padded up to a multiple of BLOCK_M with the sentinel P = T * k::

    topk_ids (T=3, k=2)  [[2, 0], [0, 1], [2, 0]]          BLOCK_M = 4, P = 6
    sorted_pair_ids      1 2 5 P | 3 P P P | 0 4 P P | P ...   (max_blocks * BLOCK_M)
    block_expert         0       | 1       | 2       | -1 ...  (max_blocks,)
    num_blocks           3                                     (1,) on the device

Blocks past ``num_blocks`` (where another routing would fill more) hold only P and -1.

The output sizes depend only on P, E and BLOCK_M (:func:`max_blocks`), and nothing is
read back on the host, so a decode step can be captured in a CUDA graph. At most
min(E, P) experts receive a pair and each pads fewer than BLOCK_M rows, which bounds the
used rows by P + min(E, P) * (BLOCK_M - 1).

One program does it all, in three passes over the ids in chunks of CHUNK pairs: count
the pairs of each expert, write the sentinel everywhere and each block's expert, then
place every pair at its expert's start plus the number of the expert's pairs before it.
Why one program: the passes depend on all the counts, and a second launch costs more
than the passes at decode sizes; prefill-sized P would want a multi-program histogram
(not measured: no GPU here).

Torch reference: :func:`minivllm.kernels.reference.moe_align_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, check_power_of_two, next_pow2, takes_pdl

MAX_EXPERTS = 4096
CHUNK_ELEMENTS = 4096  # CHUNK * BLOCK_E one-hot entries in registers per pass step


@dataclass(frozen=True)
class MoeAlignment:
    """The aligned layout of P = T * k routing pairs (module doc), all on the device."""

    sorted_pair_ids: torch.Tensor  # (max_blocks * block_m,) int32: pair ids, P = padding
    block_expert: torch.Tensor     # (max_blocks,) int32: expert of each block, -1 = unused
    num_blocks: torch.Tensor       # (1,) int32: blocks in use (the first ones)
    num_pairs: int                 # P, the sentinel
    block_m: int                   # rows per block


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most blocks of ``block_m`` rows that ``num_pairs`` pairs over ``num_experts``
    experts can fill once padded (the used rows' bound in the module doc, a multiple of
    block_m, so floor division is exact)."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


@triton.jit
def _moe_align_kernel(
    ids_ptr,                             # (P,) int32 expert of each pair, in [0, E)
    sorted_ptr,                          # (max_blocks * BLOCK_M,) int32
    block_expert_ptr,                    # (max_blocks,) int32
    num_blocks_ptr,                      # (1,) int32
    num_pairs, num_blocks_max,
    E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    SIGNAL_NEXT: tl.constexpr,           # programmatic dependent launch: let the next kernel start
):
    if SIGNAL_NEXT:
        tl.extra.cuda.gdc_launch_dependents()
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros((BLOCK_E,), tl.int32)
    for start in range(0, num_pairs, CHUNK):
        counts += tl.sum(_one_hot(ids_ptr, start + lanes, num_pairs, experts), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    seg_end = tl.cumsum(padded, axis=0)                                # (BLOCK_E,) inclusive
    seg_start = seg_end - padded
    tl.store(num_blocks_ptr, tl.sum(padded, axis=0) // BLOCK_M)
    for b0 in range(0, num_blocks_max, CHUNK):
        blocks = b0 + lanes
        in_range = blocks < num_blocks_max
        # The expert of a block is the number of segments ending at or before its first
        # row (empty segments end where they start); E or more: past the used blocks.
        # Lanes past E have padded 0, so they end at the total and count only there.
        ended = tl.sum((seg_end[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(ended < E, ended, -1), mask=in_range)
        rows = blocks[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]   # (CHUNK, BLOCK_M)
        tl.store(sorted_ptr + rows, tl.zeros((CHUNK, BLOCK_M), tl.int32) + num_pairs, mask=in_range[:, None])
    # The sentinel stores above and the pair stores below may hit one address from
    # different threads: the barrier orders them.
    tl.debug_barrier()
    placed = tl.zeros((BLOCK_E,), tl.int32)                            # pairs placed per expert
    for start in range(0, num_pairs, CHUNK):
        pairs = start + lanes
        hit = _one_hot(ids_ptr, pairs, num_pairs, experts)             # (CHUNK, BLOCK_E)
        earlier = tl.cumsum(hit, axis=0) - hit                         # same-expert pairs before, this chunk
        slot = tl.sum(hit * (seg_start + placed)[None, :] + hit * earlier, axis=1)
        tl.store(sorted_ptr + slot, pairs, mask=pairs < num_pairs)
        placed += tl.sum(hit, axis=0)


@triton.jit
def _one_hot(ids_ptr, pairs, num_pairs, experts):
    """(CHUNK, BLOCK_E) int32: 1 where pair ``pairs[i]`` goes to expert ``experts[e]``; rows
    of pairs past num_pairs are 0."""
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    return (ids[:, None] == experts[None, :]).to(tl.int32)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int = 16, *, chunk: int | None = None,
              pdl: bool = False) -> MoeAlignment:
    """The aligned layout (module doc) of ``topk_ids`` (T, k) int32, every id in
    [0, ``num_experts``) (not checked: that would read the ids on the host).

    Args:
        block_m: rows per block, the grouped GEMM's BLOCK_M; a power of two >= 16
            (``tl.dot``'s minimum). 16 pads least (decode); larger blocks reuse each
            weight tile over more rows (prefill).
        chunk: pairs per pass step, a power of two (None: ``CHUNK_ELEMENTS`` one-hot
            entries over the padded expert count); a tuning knob, not semantics.
        pdl: let the next kernel start early where the device allows programmatic
            dependent launch.

    Raises:
        TypeError: topk_ids not int32.
        ValueError: topk_ids not a contiguous 2-D tensor, num_experts outside
            [1, ``MAX_EXPERTS``], or block_m / chunk not a power of two as above.
    """
    check_dtype("topk_ids", topk_ids, (torch.int32,))
    if topk_ids.dim() != 2 or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be a contiguous (T, k), got shape {tuple(topk_ids.shape)} "
                         f"strides {topk_ids.stride()}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be an int in [1, {MAX_EXPERTS}], got {num_experts!r}")
    check_power_of_two("block_m", block_m, minimum=16)
    block_e = next_pow2(num_experts)
    chunk = chunk if chunk is not None else max(16, CHUNK_ELEMENTS // block_e)
    check_power_of_two("chunk", chunk)
    pairs = topk_ids.numel()
    blocks = max_blocks(pairs, num_experts, block_m)
    device = topk_ids.device
    out = MoeAlignment(
        sorted_pair_ids=torch.empty(blocks * block_m, dtype=torch.int32, device=device),
        block_expert=torch.empty(blocks, dtype=torch.int32, device=device),
        num_blocks=torch.zeros(1, dtype=torch.int32, device=device),
        num_pairs=pairs, block_m=block_m,
    )
    if pairs == 0:
        return out
    _moe_align_kernel[(1,)](
        topk_ids, out.sorted_pair_ids, out.block_expert, out.num_blocks, pairs, blocks,
        E=num_experts, BLOCK_E=block_e, BLOCK_M=block_m, CHUNK=chunk,
        SIGNAL_NEXT=takes_pdl(pdl, topk_ids), num_warps=4,
    )
    return out
