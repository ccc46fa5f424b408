"""Tensor-parallel all-reduce fused with the residual add and RMSNorm after it.

A row-parallel layer (``o_proj``, ``down_proj``) leaves each rank a partial sum
``x_r``; the decoder then adds the sum to the residual stream and normalises. Unfused
that is two kernels and two passes (the all-reduce, then ``rms_norm`` with its
residual); here one kernel over symmetric memory (every rank's buffer mapped into
every rank's address space over NVLink)::

    copy x_rank into this rank's symmetric buffer      (rows of this program; skipped
                                                        when the GEMM wrote x there)
    barrier: every rank's copy of these rows is done
    s   = x_0 + x_1 + ... + x_{W-1}     rank order on every rank (so they agree bit
                                        for bit), fp32, rounded to x's dtype: what
                                        the all-reduce would return
    s   = s + residual                  rounded: the new residual stream
    out = w * (s / sqrt(mean(s^2) + eps))   ``rms_norm.weighted_rms_norm_row``

Barriers are per program: program p of each rank handles the same rows (the grid
depends only on the row count) and meets program p of every peer on one flag per
(program, peer) in a symmetric int32 signal pad. Each program counts its calls in its
own slot of the pad (the epoch: every rank makes the same calls with the same row
counts, so program p's epochs agree across ranks). Signalling a peer writes the epoch
into the peer's flag (one remote exchange, release, system scope); waiting spins on
one's *own* flag (acquire) until it holds the epoch or a later one, so no program spins
over NVLink and no flag needs resetting.

**One barrier, two buffers.** A rank may not overwrite its buffer while a peer still
reads it. Instead of a second barrier after the reads, consecutive calls use the two
halves of the buffer in turn (``buf_offset``, chosen by the caller), and that is
enough: when a rank starts anything after call k+1, its call k+1 kernel has finished,
so every program of it passed the barrier, so every peer had started call k+1, so
every peer's call k (the last reader of the half that call k+2 writes) had finished
(kernels of one stream run in order: so this kernel must never be launched with
programmatic dependent launch, which would let call k+1 start before call k ends; with
``pdl`` it only lets the kernel after it start early). Without the second barrier a peer
can signal call k+1 before this rank has seen call k's signal, hence "the epoch or a later
one" (wrap-safe: the int32 difference); it cannot get further, as its call k+2 waits for
this rank. Each rank's own term comes from ``x`` itself; only peers' buffers are read
over NVLink. Where this kernel pays off against the plain all-reduce: docs/tuning.md,
"All-reduce paths and thresholds".

``sync=False`` skips the barrier: tests on the CPU (``TRITON_INTERPRET=1``) run the
ranks one after the other in one process, with the buffers filled beforehand.

Torch reference: :func:`minivllm.kernels.reference.all_reduce_add_rms_norm_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, check_same_device, next_pow2, takes_pdl
from minivllm.kernels._norm_act import weighted_rms_norm_row
from minivllm.kernels.rms_norm import MAX_HIDDEN

MAX_PROGRAMS = 256  # flags per peer; the all-reduce uses at most this many programs


def signal_pad_numel(world_size: int) -> int:
    """int32 slots a rank's signal pad needs (zeroed before first use): the flags, then
    one epoch counter per program."""
    return MAX_PROGRAMS * world_size + MAX_PROGRAMS


@triton.jit
def _flag(pad_ptrs, owner, pid, src, WORLD: tl.constexpr):
    """Address of flag (pid, src) in rank ``owner``'s signal pad."""
    pad = tl.load(pad_ptrs + owner).to(tl.pointer_type(tl.int32))
    return pad + pid * WORLD + src


@triton.jit
def _barrier(pad_ptrs, pid, epoch, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Meet program ``pid`` of every other rank at this call's ``epoch``. Writes before it
    (by any thread of this program) are visible to the peers after it, and theirs to
    this program."""
    tl.debug_barrier()  # every thread's stores precede the release below
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            tl.atomic_xchg(_flag(pad_ptrs, peer, pid, RANK, WORLD), epoch, sem="release", scope="sys")
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            flag = _flag(pad_ptrs, RANK, pid, peer, WORLD)
            # A local read; the peer may already have signalled the next call (module doc).
            while tl.atomic_add(flag, 0, sem="acquire", scope="sys") - epoch < 0:
                pass
    tl.debug_barrier()  # every thread's loads follow the acquire above


@triton.jit
def _rank_order_sum(x_ptr, buf_ptrs, buf_offset, at, mask, RANK: tl.constexpr, WORLD: tl.constexpr):
    """The all-reduce's output at ``at``: x_0 + ... + x_{WORLD-1} in rank order, fp32, rounded
    to x's dtype; this rank's term from x, the peers' from their buffers."""
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros(at.shape, dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            part = tl.load(x_ptr + at, mask=mask, other=0.0)
        else:
            # The table says nothing of alignment, which left these loads scalar (eight 2-byte
            # loads a thread at hidden 4096): symmetric buffers start on allocation pages, so
            # 16 bytes is safe to promise, and the loads become one 16-byte vector a thread.
            peer = tl.multiple_of(tl.load(buf_ptrs + r).to(tl.pointer_type(dtype)), 16) + buf_offset
            # ".cv": fetch again rather than trust a cached line, as a plain (vectorisable) load.
            part = tl.load(peer + at, mask=mask, other=0.0, cache_modifier=".cv")
        acc += part.to(tl.float32)
    return acc.to(dtype)


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    x_ptr,                                # (T, N) this rank's partial sums, contiguous
    buf_ptrs,                             # (WORLD,) int64: each rank's symmetric buffer
    buf_offset,                           # this call's rows start here (elements)
    pad_ptrs,                             # (WORLD,) int64: each rank's int32 signal pad
    residual_ptr, weight_ptr,             # (T, N) contiguous, (N,)
    out_ptr, residual_out_ptr,            # (T, N) contiguous
    T, eps,
    N: tl.constexpr, BLOCK_N: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
    MAX_PROGRAMS: tl.constexpr, SYNC: tl.constexpr,
    COPY: tl.constexpr,                   # False: x already is this rank's buffer at buf_offset
    SIGNAL_NEXT: tl.constexpr,            # programmatic dependent launch: let the next kernel start
):
    if SIGNAL_NEXT:  # the next GEMV may stream its weights while this one waits on its peers
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    dtype = x_ptr.dtype.element_ty
    mine = tl.load(buf_ptrs + RANK).to(tl.pointer_type(dtype)) + buf_offset
    if COPY:
        for row in range(pid, T, nprog):
            at = row * N + offs  # < the buffer's numel: int32 is enough
            tl.store(mine + at, tl.load(x_ptr + at, mask=mask), mask=mask)
    if SYNC:  # this program's call count; only this program touches the slot
        counter = tl.load(pad_ptrs + RANK).to(tl.pointer_type(tl.int32)) + MAX_PROGRAMS * WORLD + pid
        epoch = tl.load(counter) + 1
        tl.store(counter, epoch)
        _barrier(pad_ptrs, pid, epoch, RANK, WORLD)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, T, nprog):
        at = row * N + offs  # < the buffer's numel: int32 is enough
        s = _rank_order_sum(x_ptr, buf_ptrs, buf_offset, at, mask, RANK, WORLD)
        res = tl.load(residual_ptr + at, mask=mask, other=0.0)
        s = (s.to(tl.float32) + res.to(tl.float32)).to(dtype)       # one rounding, as torch's add
        tl.store(residual_out_ptr + at, s, mask=mask)
        tl.store(out_ptr + at, weighted_rms_norm_row(s, w, eps, N).to(out_ptr.dtype.element_ty), mask=mask)


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            buf_ptrs: torch.Tensor, pad_ptrs: torch.Tensor, rank: int, world_size: int, *,
                            buf_offset: int, in_place: bool, pdl: bool = False,
                            sync: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(sum_r x_r + residual), sum_r x_r + residual)`` over the ranks.

    Every rank calls it with the same shapes (each with its own ``x``) and offsets, in the
    same order relative to its other collectives, and consecutive calls alternate between
    two offsets whose ``T * N`` regions do not overlap (module doc).

    Args:
        x: (T, N) this rank's partial sums, contiguous.
        residual: like ``x``.
        weight: (N,).
        eps: added to the mean square.
        buf_ptrs: (world_size,) int64 on x's device: every rank's symmetric buffer,
            each at least ``buf_offset + T * N`` elements of x's dtype, 16-byte aligned
            (the peers' rows are read as 16-byte vectors).
        pad_ptrs: (world_size,) int64: every rank's signal pad, ``signal_pad_numel``
            int32 slots, zero before the first call (then flags and counters hold epochs).
        rank, world_size: this rank and the group's size.
        buf_offset: where in every buffer this call's rows go (elements).
        in_place: ``x`` already is this rank's buffer at ``buf_offset`` (a row-parallel
            GEMM wrote it there), so it is not copied.
        pdl: let the kernel after this one start early where the device allows
            programmatic dependent launch (this one is never launched that way).
        sync: False only for single-process tests (no barriers; see module doc).

    Raises:
        TypeError: non-float tensors, or int64 pointer tables of another dtype.
        ValueError: shapes that disagree, non-contiguous tensors, a bad rank or offset.
    """
    check_dtype("x", x, (torch.bfloat16, torch.float16, torch.float32))
    check_dtype("residual", residual, (x.dtype,))
    check_dtype("weight", weight, (torch.bfloat16, torch.float16, torch.float32))
    check_dtype("buf_ptrs", buf_ptrs, (torch.int64,))
    check_dtype("pad_ptrs", pad_ptrs, (torch.int64,))
    if x.dim() != 2 or not x.is_contiguous() or residual.shape != x.shape or not residual.is_contiguous():
        raise ValueError(f"x and residual must be contiguous (T, N) of one shape, got {tuple(x.shape)} "
                         f"and {tuple(residual.shape)}")
    if weight.shape != x.shape[-1:] or x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"weight must be ({x.shape[-1]},) with N <= {MAX_HIDDEN}, got {tuple(weight.shape)}")
    if not 0 <= rank < world_size or buf_ptrs.shape != (world_size,) or pad_ptrs.shape != (world_size,):
        raise ValueError(f"rank {rank} of {world_size} with pointer tables {tuple(buf_ptrs.shape)}, "
                         f"{tuple(pad_ptrs.shape)}")
    if isinstance(buf_offset, bool) or not isinstance(buf_offset, int) or buf_offset < 0:
        raise ValueError(f"buf_offset must be an int >= 0, got {buf_offset!r}")
    check_same_device(x=x, residual=residual, weight=weight, buf_ptrs=buf_ptrs, pad_ptrs=pad_ptrs)
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        block = next_pow2(n)
        _all_reduce_add_rms_norm_kernel[(min(rows, MAX_PROGRAMS),)](
            x, buf_ptrs, buf_offset, pad_ptrs, residual, weight, out, res_out, rows, float(eps),
            N=n, BLOCK_N=block, RANK=rank, WORLD=world_size, MAX_PROGRAMS=MAX_PROGRAMS, SYNC=sync,
            COPY=not in_place, SIGNAL_NEXT=takes_pdl(pdl, x),
            num_warps=max(1, min(16, block // 256)),
        )
    return out, res_out
