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

The work, in steps of CHUNK pairs (a (CHUNK, E) one-hot in registers), on either path::

    one program (P <= ONE_PROGRAM_MAX_CHUNKS * CHUNK, a few tokens):
        count per expert -> segments, num_blocks, labels -> place every pair
    grid (more), tiles of TILE = tile_chunks * CHUNK pairs, three launches:
        1 (tiles)   counts of each tile               -> scratch[tile, e]
        2 (one)     column-wise exclusive scan        -> scratch[tile, e], totals, num_blocks
        3 (tiles)   segments from the totals; label a share of the blocks; place the
                    tile's pairs at seg_start[e] + scratch[tile, e] + rank in the tile

Labelling writes each block's expert and the sentinel only in rows that no pair takes, so
it needs no ordering against the placement (in one program, or spread over the grid).
Why two paths: one program walks every pair twice in dependent steps; a grid program walks
2 * tile_chunks steps and the scan P / (TILE * CHUNK), at the cost of two more launches,
which only the fewest pairs do not repay. :func:`grid_tile_chunks` sizes the tiles for
about ``GRID_TILES`` programs: one chunk each at decode sizes, more at prefill ones so that
the scan keeps few rows. Per-tile counts rather than atomics keep the layout deterministic.
The constants are from a sweep on an H200 (docs/tuning.md, "Experts at many tokens").

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
# One program while each of its passes takes at most this many steps: past it, the grid's
# few steps per program, its scan and two more launches cost less.
ONE_PROGRAM_MAX_CHUNKS = 2
GRID_TILES = 128       # grid programs aimed at (grid_tile_chunks)
MAX_TILE_CHUNKS = 8    # chunks a grid program walks at most
MAX_ROWS = 2 ** 31 - 1  # pair ids and row offsets are int32


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
    counts = _count(ids_ptr, 0, num_pairs, experts, CHUNK)
    seg_start, seg_end = _segments(counts, BLOCK_M)
    tl.store(num_blocks_ptr, tl.max(seg_end, axis=0) // BLOCK_M)
    _label_blocks(sorted_ptr, block_expert_ptr, 0, num_blocks_max, seg_end, seg_start + counts,
                  num_pairs, experts, E, BLOCK_M, CHUNK)
    _place(ids_ptr, sorted_ptr, 0, num_pairs, seg_start, experts, CHUNK)


@triton.jit
def _moe_align_count_kernel(
    ids_ptr,                             # (P,) int32
    scratch_ptr,                         # (num_tiles + 1, BLOCK_E) int32: row tile <- its counts
    num_pairs,
    BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr,
):
    # No PDL signal here or in the scan: the kernel after each is the next of these three,
    # launched in plain stream order, so there is nothing to let start early.
    tile = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    first = tile * TILE
    counts = _count(ids_ptr, first, tl.minimum(first + TILE, num_pairs), experts, CHUNK)
    tl.store(scratch_ptr + tile * BLOCK_E + experts, counts)


@triton.jit
def _moe_align_scan_kernel(
    scratch_ptr,                         # (num_tiles + 1, BLOCK_E) int32
    num_blocks_ptr,                      # (1,) int32
    num_tiles,
    BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
):
    """Each tile's row becomes the expert's pairs in the tiles before it; row num_tiles
    receives the totals."""
    experts = tl.arange(0, BLOCK_E)
    total = tl.zeros((BLOCK_E,), tl.int32)
    for r0 in range(0, num_tiles, CHUNK):                      # (CHUNK, BLOCK_E) rows at a time
        tiles = r0 + tl.arange(0, CHUNK)
        ptrs = scratch_ptr + tiles[:, None] * BLOCK_E + experts[None, :]
        in_range = (tiles < num_tiles)[:, None]
        counts = tl.load(ptrs, mask=in_range, other=0)
        tl.store(ptrs, total[None, :] + tl.cumsum(counts, axis=0) - counts, mask=in_range)
        total += tl.sum(counts, axis=0)
    tl.store(scratch_ptr + num_tiles * BLOCK_E + experts, total)
    _, seg_end = _segments(total, BLOCK_M)
    tl.store(num_blocks_ptr, tl.max(seg_end, axis=0) // BLOCK_M)


@triton.jit
def _moe_align_place_kernel(
    ids_ptr,                             # (P,) int32
    sorted_ptr,                          # (max_blocks * BLOCK_M,) int32
    block_expert_ptr,                    # (max_blocks,) int32
    scratch_ptr,                         # (num_tiles + 1, BLOCK_E) int32, as the scan left it
    num_pairs, num_tiles, num_blocks_max, blocks_per_tile,
    E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    TILE: tl.constexpr,
    SIGNAL_NEXT: tl.constexpr,           # programmatic dependent launch: let the next kernel start
):
    # The last of the three may signal: a kernel launched with launch_pdl after it reads
    # the layout only past its griddepcontrol.wait, which waits for this grid, and stream
    # order finished the count and the scan before this grid began.
    if SIGNAL_NEXT:
        tl.extra.cuda.gdc_launch_dependents()
    tile = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.load(scratch_ptr + num_tiles * BLOCK_E + experts)
    seg_start, seg_end = _segments(counts, BLOCK_M)
    first_block = tile * blocks_per_tile
    _label_blocks(sorted_ptr, block_expert_ptr, first_block,
                  tl.minimum(first_block + blocks_per_tile, num_blocks_max), seg_end, seg_start + counts,
                  num_pairs, experts, E, BLOCK_M, CHUNK)
    before = tl.load(scratch_ptr + tile * BLOCK_E + experts)
    first = tile * TILE
    _place(ids_ptr, sorted_ptr, first, tl.minimum(first + TILE, num_pairs), seg_start + before,
           experts, CHUNK)


@triton.jit
def _one_hot(ids_ptr, pairs, last, experts):
    """(CHUNK, BLOCK_E) int32: 1 where pair ``pairs[i]`` goes to expert ``experts[e]``; rows
    of pairs from ``last`` on are 0."""
    ids = tl.load(ids_ptr + pairs, mask=pairs < last, other=-1)
    return (ids[:, None] == experts[None, :]).to(tl.int32)


@triton.jit
def _count(ids_ptr, first, last, experts, CHUNK: tl.constexpr):
    """(BLOCK_E,) int32: the pairs in [first, last) of each expert."""
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros_like(experts)
    for start in range(first, last, CHUNK):
        counts += tl.sum(_one_hot(ids_ptr, start + lanes, last, experts), axis=0)
    return counts


@triton.jit
def _segments(counts, BLOCK_M: tl.constexpr):
    """(seg_start, seg_end) (BLOCK_E,): each expert's rows once its ``counts`` pairs are
    padded to a multiple of BLOCK_M, in expert order; lanes past E (count 0) start and end
    at the total."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    seg_end = tl.cumsum(padded, axis=0)
    return seg_end - padded, seg_end


@triton.jit
def _label_blocks(sorted_ptr, block_expert_ptr, first, last, seg_end, fill_end, num_pairs, experts,
                  E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Blocks [first, last): each one's expert (-1 past the used blocks) and the sentinel in
    its rows from ``fill_end`` of its expert on (seg_start + count: the pairs end there).
    Rows before it are the placement's, so the two store to disjoint rows in any order."""
    for b0 in range(first, last, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        in_range = blocks < last
        # The expert of a block is the number of segments ending at or before its first
        # row (empty segments end where they start); E or more: past the used blocks.
        # Lanes past E have padded 0, so they end at the total and count only there.
        ended = tl.sum((seg_end[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(ended < E, ended, -1), mask=in_range)
        # Past the used blocks the owner is a lane past E (fill_end = the total) or none (0):
        # every row takes the sentinel.
        owner = ended[:, None] == experts[None, :]                          # (CHUNK, BLOCK_E)
        fill = tl.sum(tl.where(owner, fill_end[None, :], 0), axis=1)        # (CHUNK,)
        rows = blocks[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]   # (CHUNK, BLOCK_M)
        pad = in_range[:, None] & (rows >= fill[:, None])
        tl.store(sorted_ptr + rows, tl.zeros((CHUNK, BLOCK_M), tl.int32) + num_pairs, mask=pad)


@triton.jit
def _place(ids_ptr, sorted_ptr, first, last, base, experts, CHUNK: tl.constexpr):
    """Store each pair p in [first, last) at row ``base[e]`` + the number of expert e's pairs
    in [first, p), e its expert."""
    lanes = tl.arange(0, CHUNK)
    for start in range(first, last, CHUNK):
        pairs = start + lanes
        hit = _one_hot(ids_ptr, pairs, last, experts)                  # (CHUNK, BLOCK_E)
        earlier = tl.cumsum(hit, axis=0) - hit                         # same-expert pairs before, this chunk
        slot = tl.sum(hit * (base[None, :] + earlier), axis=1)
        tl.store(sorted_ptr + slot, pairs, mask=pairs < last)
        base += tl.sum(hit, axis=0)


def grid_tile_chunks(pairs: int, chunk: int) -> int:
    """Chunks a grid program walks for ``pairs`` pairs in steps of ``chunk``: the power of
    two that gives about ``GRID_TILES`` programs, from 1 to ``MAX_TILE_CHUNKS``."""
    return min(MAX_TILE_CHUNKS, next_pow2(-(-pairs // (chunk * GRID_TILES))))


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int = 16, *, chunk: int | None = None,
              one_program: bool | None = None, tile_chunks: int | None = None,
              pdl: bool = False) -> MoeAlignment:
    """The aligned layout (module doc) of ``topk_ids`` (T, k) int32, every id in
    [0, ``num_experts``) (not checked: that would read the ids on the host).

    Args:
        block_m: rows per block, the grouped GEMM's BLOCK_M; a power of two >= 16
            (``tl.dot``'s minimum). 16 pads least (decode); larger blocks reuse each
            weight tile over more rows (prefill).
        chunk: pairs per pass step, a power of two (None: ``CHUNK_ELEMENTS`` one-hot
            entries over the padded expert count); a tuning knob, not semantics.
        one_program: the one-program kernel (True) or the three-kernel grid (False);
            None: one program while P <= ``ONE_PROGRAM_MAX_CHUNKS`` chunks. The layout
            is the same either way.
        tile_chunks: chunks each grid program walks, a power of two (None:
            :func:`grid_tile_chunks`); a tuning knob, not semantics.
        pdl: let the next kernel start early where the device allows programmatic
            dependent launch.

    Raises:
        TypeError: topk_ids not int32.
        ValueError: topk_ids not a contiguous 2-D tensor, num_experts outside
            [1, ``MAX_EXPERTS``], block_m / chunk / tile_chunks not a power of two as
            above, or more rows than int32 offsets reach.
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
    tile_chunks = tile_chunks if tile_chunks is not None else grid_tile_chunks(pairs, chunk)
    check_power_of_two("tile_chunks", tile_chunks)
    blocks = max_blocks(pairs, num_experts, block_m)
    if blocks * block_m + tile_chunks * chunk > MAX_ROWS:  # the rows, and a grid tile's end past P
        raise ValueError(f"topk_ids has {pairs} pairs: their {blocks * block_m} rows pass int32 offsets")
    device = topk_ids.device
    out = MoeAlignment(
        sorted_pair_ids=torch.empty(blocks * block_m, dtype=torch.int32, device=device),
        block_expert=torch.empty(blocks, dtype=torch.int32, device=device),
        num_blocks=torch.zeros(1, dtype=torch.int32, device=device),
        num_pairs=pairs, block_m=block_m,
    )
    if pairs == 0:
        return out
    if one_program is None:
        one_program = pairs <= ONE_PROGRAM_MAX_CHUNKS * chunk
    if one_program:
        _moe_align_kernel[(1,)](
            topk_ids, out.sorted_pair_ids, out.block_expert, out.num_blocks, pairs, blocks,
            E=num_experts, BLOCK_E=block_e, BLOCK_M=block_m, CHUNK=chunk,
            SIGNAL_NEXT=takes_pdl(pdl, topk_ids), num_warps=4,
        )
    else:
        _launch_grid(topk_ids, out, num_experts, chunk, tile_chunks, takes_pdl(pdl, topk_ids))
    return out


def _launch_grid(topk_ids: torch.Tensor, out: MoeAlignment, num_experts: int, chunk: int, tile_chunks: int,
                 signal_next: bool) -> None:
    """The three kernels of the grid path (module doc), writing ``out``."""
    pairs, blocks, block_m = out.num_pairs, out.block_expert.shape[0], out.block_m
    block_e = next_pow2(num_experts)
    tile = tile_chunks * chunk
    tiles = triton.cdiv(pairs, tile)
    # (tiles + 1, BLOCK_E): per-tile counts, then per-tile offsets and the totals. Every
    # entry is written before it is read, so no zero fill; the caching allocator serves it
    # inside a CUDA-graph capture too.
    scratch = torch.empty((tiles + 1, block_e), dtype=torch.int32, device=topk_ids.device)
    _moe_align_count_kernel[(tiles,)](
        topk_ids, scratch, pairs, BLOCK_E=block_e, CHUNK=chunk, TILE=tile, num_warps=4)
    _moe_align_scan_kernel[(1,)](
        scratch, out.num_blocks, tiles, BLOCK_E=block_e, BLOCK_M=block_m, CHUNK=chunk, num_warps=4)
    _moe_align_place_kernel[(tiles,)](
        topk_ids, out.sorted_pair_ids, out.block_expert, scratch, pairs, tiles, blocks,
        triton.cdiv(blocks, tiles), E=num_experts, BLOCK_E=block_e, BLOCK_M=block_m, CHUNK=chunk,
        TILE=tile, SIGNAL_NEXT=signal_next, num_warps=4,
    )
