"""The one-row all-reduce that a GEMV pushes and the next kernel collects: the protocol's
Triton helpers, shared by the producer (``gemv.py``: a row-parallel layer's GEMV at batch 1)
and the two consumers (``gemv.rms_norm_gemv``'s input, and
``all_reduce_rms_norm.pushed_add_rms_norm`` where no GEMV takes the norm).

At batch 1 under tensor parallelism a decode layer's two all-reduces carry one row
(8 KB for Qwen3-8B) and cost their latency, not their bytes: the fused all-reduce + norm
kernel took 5.1 us per call at TP=2, 368 us of a 2.9 ms step (BENCHMARKS.md, eighth
session): one launch, one barrier round trip over NVLink and one remote read. Here the
row-parallel GEMV writes each output tile straight into every peer's inbox as it finishes
it, and the kernel that needs the sum reads it from its own inbox once it is there::

    producer (rank r, program owning columns c):
        t[c] = tags[c] + 1  (16 bits; this rank's own count of pushes of column c, this half)
        its own slot[c] = y[c]                              (plain, for its own consumer)
        every peer's inbox[r][c] = t[c] << 16 | bits(y[c])  (one 32-bit store per value)
    consumer (rank p, any program, columns k):
        spin until every peer's inbox[r][k] carries tag tags[k]   (its own producer's count)
        row[k] = slot_0[k] + ... + slot_{WORLD-1}[k]   rank order, fp32, rounded to the
                                                         dtype: what the all-reduce returns

The tag travels in the word with the value, as in NCCL's low-latency protocol: a 32-bit
store is seen whole or not at all, so the producer needs no fence and no flag, and the
consumer needs no counter: a word carrying this call's tag is this call's value. Every
rank makes the same calls, so a rank's own column counts equal its peers'. The consumer
starts streaming its weights before it looks (``gemv``'s first W tile is already in
flight); the values are half-precision (bf16 / fp16: 16 bits beside the tag).

**Why two halves are enough.** Consecutive calls use the two halves of the inbox in turn
(``SymmMemAllReduce``: the same halves, in the same turn, as the fused all-reduce + norm
kernel's barrier protocol, so the two protocols may alternate call by call). A peer writes
half h for call k+2 only after its consumer of call k+1 saw this rank's call k+1 words,
which this rank's producer of call k+1 wrote after its consumer of call k (the last reader
of half h) finished: stream order on each GPU. So a word a consumer reads holds this
call's value or the previous call's on that half (tag one less), never a later one. Tags
are 16 bits and wrap: a slot is rewritten every call on its half, so the previous tag is
always exactly one less. The inbox starts zeroed (tag 0), and the first push tags 1. As
with the fused kernel, no producer may push before its predecessors end: the GEMV pushes
after its ``griddepcontrol.wait`` when launched with programmatic dependent launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

TAG_SHIFT = tl.constexpr(16)  # a pushed word: tag << 16 | the value's 16 bits


@dataclass(frozen=True, eq=False)  # tensors inside: compared by identity
class PushChannel:
    """One call's way through the protocol (built by ``SymmMemAllReduce``; the same on every
    rank but ``rank`` and ``tags``)."""

    inbox_ptrs: torch.Tensor  # (world_size,) int64 on the device: every rank's inbox buffer
    inbox_offset: int         # this call's inbox in every buffer (int32 words): WORLD rows of N words
    tags: torch.Tensor        # (>= N,) int32 on the device: this rank's push count per column, this half
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size or self.inbox_offset < 0:
            raise ValueError(f"a push channel needs 0 <= rank < world_size and an inbox offset >= 0, got rank "
                             f"{self.rank} of {self.world_size}, offset {self.inbox_offset}")
        if self.inbox_ptrs.dtype != torch.int64 or self.inbox_ptrs.shape != (self.world_size,):
            raise ValueError(f"inbox_ptrs must be ({self.world_size},) int64, got "
                             f"{tuple(self.inbox_ptrs.shape)} {self.inbox_ptrs.dtype}")
        if self.tags.dtype != torch.int32 or self.tags.dim() != 1 or not self.tags.is_contiguous():
            raise ValueError(f"tags must be a contiguous 1-D int32, got {tuple(self.tags.shape)} {self.tags.dtype}")


@triton.jit
def push_tile(y, cols, col_ok, inbox_ptrs, inbox_offset, tags_ptr, N, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Count this program's columns once more in ``tags`` and store the tile ``y`` (16-bit
    values) with the new tags into row RANK of every peer's inbox (the caller stores its own
    plain copy)."""
    tag = (tl.load(tags_ptr + cols, mask=col_ok, other=0) + 1) & 0xFFFF
    tl.store(tags_ptr + cols, tag, mask=col_ok)
    word = (tag << TAG_SHIFT) | y.to(tl.uint16, bitcast=True).to(tl.int32)
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            inbox = tl.load(inbox_ptrs + peer).to(tl.pointer_type(tl.int32)) + inbox_offset + RANK * N
            tl.store(inbox + cols, word, mask=col_ok)


@triton.jit
def pushed_sum(own_ptr, inbox_ptrs, inbox_offset, tags_ptr, k, mask, N, RANK: tl.constexpr, WORLD: tl.constexpr,
               WAIT: tl.constexpr):
    """The all-reduced row at columns ``k`` (0 where ``mask`` is False; None: every column):
    this rank's term from ``own_ptr``, each peer's from row ``r`` of this rank's inbox, in
    rank order, in fp32, rounded to the own row's dtype. WAIT: first spin until every
    peer's words there carry this call's tags (a program's first look at columns ``k``;
    later looks find them, as nothing rewrites the half before this kernel ends)."""
    dtype = own_ptr.dtype.element_ty
    expected = _masked(tags_ptr + k, mask, False)  # written by this rank's producer, a kernel earlier
    inbox = tl.load(inbox_ptrs + RANK).to(tl.pointer_type(tl.int32)) + inbox_offset
    acc = tl.zeros(k.shape, tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            part = _masked(own_ptr + k, mask, False)
        else:
            word = _masked(inbox + r * N + k, mask, WAIT)
            if WAIT:  # masked-off lanes read 0 against an expected 0: they never hold the spin
                while tl.min((((word >> TAG_SHIFT) & 0xFFFF) == expected).to(tl.int32), axis=0) == 0:
                    word = _masked(inbox + r * N + k, mask, True)
            part = (word & 0xFFFF).to(tl.uint16).to(dtype, bitcast=True)
        acc += part.to(tl.float32)
    return acc.to(dtype)


@triton.jit
def _masked(ptrs, mask, VOLATILE: tl.constexpr):
    """``ptrs``' values, 0 where ``mask`` is False (None: every one), from L2 (which peers'
    stores reach), never from a line an earlier kernel left in L1. VOLATILE: read memory again
    every time (a spin)."""
    if VOLATILE:
        if mask is None:
            x = tl.load(ptrs, volatile=True)
        else:
            x = tl.load(ptrs, mask=mask, other=0, volatile=True)
    else:
        if mask is None:
            x = tl.load(ptrs, cache_modifier=".cg")
        else:
            x = tl.load(ptrs, mask=mask, other=0, cache_modifier=".cg")
    return x
