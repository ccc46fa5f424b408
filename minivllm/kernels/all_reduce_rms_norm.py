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
programmatic dependent launch, which would let call k+1 start before call k ends; it
only lets the kernel after it start early, ``SIGNAL_NEXT``). Without the second barrier a peer can signal
call k+1 before this rank has seen call k's signal, hence "the epoch or a later one"
(wrap-safe: the int32 difference); it cannot get further, as its call k+2 waits for
this rank. (Measured history: the first version swapped flags 0 -> 1 -> 0 with
compare-and-swap loops, the signalling one spinning on the peer's memory: 59 us at
256 rows against 22 unfused. The epoch version with two barriers took 1,430 us per
batch-256 decode step of Qwen3-8B at TP=2 against 1,394 + 233 for the two-shot
all-reduce and the norm apart; BENCHMARKS.md, eighth session.) Each rank's own term
comes from ``x`` itself; only peers' buffers are read over NVLink.

With ``PUSHED`` (one row, :func:`pushed_add_rms_norm`) the ranks' GEMVs have already pushed
their partial sums into this rank's inbox (``_push_all_reduce.py``): no copy and no
barrier, only the wait for the peers' rows, then the same sum and norm. The model's final
norm at batch 1 takes that way (the LM head after it does not take the norm in).

**Warming L2 for the GEMV after it** (``warm``, opt-in: ``MINIVLLM_AR_WARM_MB``). At batch 1
the kernel spends most of its ~5 us waiting on its peers over NVLink while HBM idles, and the
kernel after it is a GEMV streaming tens of MB of weights (the layer's qkv or gate_up). With
``warm``, ``WARM_PROGRAMS`` programs beyond the all-reduce's own each ask L2 for their share of
the first ``warm_bytes`` of that weight (one ``prefetch.global.L2::evict_last`` per 128-byte
line: a GPU-only hint that reads no value and changes no result) and end. Timed on one H200
with a 5 us spin standing in for the wait (``benchmarks.l2_warm_gemv``, twelfth session,
16 MB): the Qwen3-8B TP=2 gate_up GEMV 1.5 us sooner, qkv 0.3 (with programmatic dependent
launch as well, ``MINIVLLM_PDL=1``: 2.9 and 1.3). One program prefetching alone was far
slower (one SM's requests: ~60 us for 8 MB in bulk copies). Not timed on two GPUs.

``SYNC=False`` skips the barrier: tests on the CPU (``TRITON_INTERPRET=1``) run the
ranks one after the other in one process, with the buffers filled beforehand.

Torch reference: :func:`minivllm.kernels.reference.all_reduce_add_rms_norm_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, check_same_device, next_pow2, pdl
from minivllm.kernels._push_all_reduce import PushChannel, pushed_sum, wait_pushed
from minivllm.kernels.rms_norm import MAX_HIDDEN, weighted_rms_norm_row

MAX_PROGRAMS = 256  # flags per peer; the all-reduce uses at most this many programs
WARM_PROGRAMS = 128  # programs that warm L2 for the next GEMV (module doc), after the all-reduce's
_WARM_LINES = tl.constexpr(512)  # 128-byte lines a warming program asks for per pass (a lane each, at 16 warps)


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
            # ".cv": fetch again rather than trust a cached line, as a plain (vectorisable)
            # load. The first version read with volatile=True and barriered by spinning
            # compare-and-swap; together they took 59 us at 256 rows against 22 unfused,
            # which of the two cost it is not measured.
            part = tl.load(peer + at, mask=mask, other=0.0, cache_modifier=".cv")
        acc += part.to(tl.float32)
    return acc.to(dtype)


@triton.jit
def _warm_l2(w_ptr, nbytes, part, parts, LINES: tl.constexpr):
    """Ask L2 for share ``part`` of ``parts`` of the first ``nbytes`` bytes at ``w_ptr``, one
    ``prefetch.global.L2::evict_last`` per 128-byte line (module doc)."""
    share = tl.cdiv(tl.cdiv(nbytes, parts), 128) * 128
    lo = part.to(tl.int64) * share
    hi = tl.minimum(lo + share, nbytes)
    for at in range(lo, hi, LINES * 128):
        lines = tl.minimum(at + tl.arange(0, LINES).to(tl.int64) * 128, hi - 1)
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                  [w_ptr + lines], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    x_ptr,                                # (T, N) this rank's partial sums, contiguous
    buf_ptrs,                             # (WORLD,) int64: each rank's symmetric buffer
    buf_offset,                           # this call's rows start here (elements)
    pad_ptrs,                             # (WORLD,) int64: each rank's int32 signal pad
    residual_ptr, weight_ptr,             # (T, N) contiguous, (N,)
    out_ptr, residual_out_ptr,            # (T, N) contiguous
    T, eps,
    pad_at, half,                         # PUSHED: the push counters in the pads, and this call's pair
    warm_ptr, warm_bytes,                 # WARM: bytes of the next GEMV's weight to ask L2 for
    work,                                 # programs [0, work) reduce rows; WARM: the rest warm L2
    N: tl.constexpr, BLOCK_N: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
    MAX_PROGRAMS: tl.constexpr, SYNC: tl.constexpr,
    COPY: tl.constexpr,                   # False: x already is this rank's buffer at buf_offset
    SIGNAL_NEXT: tl.constexpr,            # programmatic dependent launch (_launch.pdl): let the next kernel start
    PUSHED: tl.constexpr,                 # x is a push inbox's (WORLD, N) slots of one row, pushed by the
                                          # ranks' GEMVs (_push_all_reduce); no copy, no barrier
    WARM: tl.constexpr,                   # programs from ``work`` on warm L2 (module doc), then end
):
    if SIGNAL_NEXT:  # the next GEMV may stream its weights while this one waits on its peers
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    if WARM:
        if pid >= work:
            _warm_l2(warm_ptr.to(tl.pointer_type(tl.int8)), warm_bytes, pid - work, tl.num_programs(0) - work,
                     _WARM_LINES)
            return
    nprog = work
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    dtype = x_ptr.dtype.element_ty
    mine = tl.load(buf_ptrs + RANK).to(tl.pointer_type(dtype)) + buf_offset
    if PUSHED:
        wait_pushed(pad_ptrs, pad_at, half, RANK)
    elif COPY:
        for row in range(pid, T, nprog):
            at = row * N + offs  # < the buffer's numel: int32 is enough
            tl.store(mine + at, tl.load(x_ptr + at, mask=mask), mask=mask)
    if SYNC and not PUSHED:  # this program's call count; only this program touches the slot
        counter = tl.load(pad_ptrs + RANK).to(tl.pointer_type(tl.int32)) + MAX_PROGRAMS * WORLD + pid
        epoch = tl.load(counter) + 1
        tl.store(counter, epoch)
        _barrier(pad_ptrs, pid, epoch, RANK, WORLD)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, T, nprog):
        at = row * N + offs  # < the buffer's numel: int32 is enough
        if PUSHED:  # one row (T = 1): the slots are in this rank's inbox
            s = pushed_sum(x_ptr, offs, mask, N, WORLD)
        else:
            s = _rank_order_sum(x_ptr, buf_ptrs, buf_offset, at, mask, RANK, WORLD)
        res = tl.load(residual_ptr + at, mask=mask, other=0.0)
        s = (s.to(tl.float32) + res.to(tl.float32)).to(dtype)       # one rounding, as torch's add
        tl.store(residual_out_ptr + at, s, mask=mask)
        tl.store(out_ptr + at, weighted_rms_norm_row(s, w, eps, N).to(out_ptr.dtype.element_ty), mask=mask)


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            buf_ptrs: torch.Tensor, pad_ptrs: torch.Tensor, rank: int, world_size: int,
                            sync: bool = True, buf_offset: int = 0, in_place: bool = False,
                            warm: torch.Tensor | None = None, warm_bytes: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
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
        sync: False only for single-process tests (no barriers; see module doc).
        buf_offset: where in every buffer this call's rows go (elements).
        in_place: ``x`` already is this rank's buffer at ``buf_offset`` (a row-parallel
            GEMM wrote it there: ``SymmMemAllReduce.fused_slot``), so it is not copied.
        warm, warm_bytes: the weight the kernel after this one streams, and how many of its
            first bytes extra programs ask L2 for (module doc; CUDA only, no effect on values).

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
    if warm is not None:
        if not isinstance(warm, torch.Tensor) or not warm.is_contiguous():
            raise ValueError("warm must be a contiguous tensor (the next layer's weight)")
        if isinstance(warm_bytes, bool) or not isinstance(warm_bytes, int) or warm_bytes < 0:
            raise ValueError(f"warm_bytes must be an int >= 0, got {warm_bytes!r}")
        check_same_device(x=x, warm=warm)
        warm_bytes = min(warm_bytes, warm.numel() * warm.element_size())
    return _launch(x, x.shape[0], residual, weight, eps, buf_ptrs, buf_offset, pad_ptrs, rank, world_size,
                   sync=sync, copy=not in_place, warm=warm if warm is not None and warm_bytes and x.is_cuda else None,
                   warm_bytes=warm_bytes)


def pushed_add_rms_norm(slots: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        channel: PushChannel) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(sum + residual), sum + residual)`` of one row whose ranks' partial sums
    the ranks' GEMVs pushed into this rank's inbox (``_push_all_reduce``): waits for the
    peers' slots, sums in rank order as :func:`all_reduce_add_rms_norm` does (the same bits).
    Where the layer after the norm is not a GEMV that takes the norm in (the model's final norm).

    Args:
        slots: (world_size, N) contiguous, this call's slots of this rank's inbox.
        residual: (1, N) contiguous.
        weight: (N,).
        eps: added to the mean square.
        channel: the call's push channel (its counters).

    Raises:
        TypeError: non-float tensors.
        ValueError: shapes that disagree, or non-contiguous tensors.
    """
    check_dtype("slots", slots, (torch.bfloat16, torch.float16, torch.float32))
    check_dtype("residual", residual, (slots.dtype,))
    check_dtype("weight", weight, (torch.bfloat16, torch.float16, torch.float32))
    n = slots.shape[-1]
    if (slots.shape != (channel.world_size, n) or not slots.is_contiguous() or residual.shape != (1, n)
            or not residual.is_contiguous()):
        raise ValueError(f"slots must be a contiguous ({channel.world_size}, N) and residual a contiguous (1, N), "
                         f"got {tuple(slots.shape)} and {tuple(residual.shape)}")
    if weight.shape != (n,) or n > MAX_HIDDEN:
        raise ValueError(f"weight must be ({n},) with N <= {MAX_HIDDEN}, got {tuple(weight.shape)}")
    check_same_device(slots=slots, residual=residual, weight=weight, pad_ptrs=channel.pad_ptrs)
    return _launch(slots, 1, residual, weight, eps, channel.inbox_ptrs, 0, channel.pad_ptrs, channel.rank,
                   channel.world_size, pushed=channel)


def _launch(x: torch.Tensor, rows: int, residual: torch.Tensor, weight: torch.Tensor, eps: float,
            buf_ptrs: torch.Tensor, buf_offset: int, pad_ptrs: torch.Tensor, rank: int, world_size: int,
            sync: bool = True, copy: bool = True, pushed: PushChannel | None = None,
            warm: torch.Tensor | None = None, warm_bytes: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel on checked arguments: ``rows`` rows of width ``x.shape[-1]``; with
    ``warm`` (a CUDA tensor), ``WARM_PROGRAMS`` more programs warm L2 with its first ``warm_bytes``."""
    n = x.shape[-1]
    out = torch.empty(rows, n, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        block = next_pow2(n)
        work = min(rows, MAX_PROGRAMS)
        _all_reduce_add_rms_norm_kernel[(work + (WARM_PROGRAMS if warm is not None else 0),)](
            x, buf_ptrs, buf_offset, pad_ptrs, residual, weight, out, res_out, rows, float(eps),
            pushed.pad_at if pushed else 0, pushed.half if pushed else 0,
            warm if warm is not None else x, warm_bytes, work,
            N=n, BLOCK_N=block, RANK=rank, WORLD=world_size, MAX_PROGRAMS=MAX_PROGRAMS, SYNC=sync,
            COPY=copy, SIGNAL_NEXT=pdl(x), PUSHED=pushed is not None, WARM=warm is not None,
            num_warps=max(1, min(16, block // 256)),
        )
    return out, res_out
