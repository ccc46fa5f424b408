"""The one-row all-reduce that a GEMV pushes and the next kernel collects: the protocol's
Triton helpers, shared by the producer (``gemv.py``: a row-parallel layer's GEMV at batch 1)
and the two consumers (``gemv.rms_norm_gemv``'s input, and
``all_reduce_rms_norm.pushed_add_rms_norm`` where no GEMV takes the norm).

At batch 1 under tensor parallelism a decode layer's two all-reduces carry one row
(8 KB for Qwen3-8B) and cost their latency, not their bytes: the fused all-reduce + norm
kernel took 5.1 us per call at TP=2, 368 us of a 2.9 ms step (BENCHMARKS.md, eighth
session), most of it one launch, one barrier round trip over NVLink and one remote read.
Here the row-parallel GEMV writes each output tile straight into every peer's inbox as it
finishes it, and the kernel that needs the sum waits for the tiles to arrive::

    producer (rank r, every program, after its tile y[cols] of the partial sum):
        store y[cols] into slot r of every rank's inbox      (its own: a local store)
        for each peer p: arrived[p][half] += len(cols)       (release, system scope)
        program 0: expected[r][half] += N * (WORLD - 1)      (local; read by the consumer)
    consumer (rank r, every program, before it reads the row):
        wait until arrived[r][half] - expected[r][half] >= 0   (acquire; int32 wrap-safe)
        row = slot 0 + slot 1 + ... + slot WORLD-1   rank order, fp32, rounded to the
                                                      dtype: what the all-reduce returns

One one-way trip over NVLink per call (stores, then a counter), no barrier and no remote
read, and the consumer starts streaming its weights before the wait (``gemv``'s first W
tile is already in flight). Counting elements rather than programs makes the count
independent of the producer's tiling.

**Why two halves are enough.** Consecutive calls use the two halves of the inbox in turn
(``SymmMemAllReduce``: the same halves, in the same turn, as the fused all-reduce + norm
kernel's barrier protocol, so the two protocols may alternate call by call). A peer writes
half h for call k+2 only after its consumer of call k+1 saw this rank's call k+1 tiles,
which this rank's producer of call k+1 pushed after its consumer of call k (the last reader
of half h) finished: stream order on each GPU, release/acquire between them. So the peer
may be one call ahead (hence "or more" in the wait), never two. The counters only grow
(by N per peer per call), so nothing needs resetting; int32 differences stay right across
wrap-around. As with the fused kernel, nothing here may be launched with programmatic
dependent launch in a way that lets a producer push before its predecessors end: the GEMV
pushes after its ``griddepcontrol.wait``.

The pad slots (int32, in each rank's symmetric signal pad at ``pad_at``): ``arrived[0]``,
``arrived[1]``, ``expected[0]``, ``expected[1]``.

**Measured, one GPU** (``benchmarks.push_all_reduce``: both ranks' kernels in turn, so without
NVLink; BENCHMARKS.md, eleventh session): 2.5 us per producer + consumer pair at Qwen3-8B TP=2
shapes, 0.9 of it the data and 1.6 the release, the wait and their scope; counters spread over
8 or 32 lanes changed nothing. Carrying a tag in each 32-bit word instead (no fence, no
atomic: NCCL's low-latency protocol) cost 5.0-17 us, every consumer program decoding words
and reading tags in every K tile: reverted. Off by default (``ExecutorConfig.push_all_reduce``)
until it has run on two GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

PUSH_PAD_SLOTS = 4  # arrived[2], expected[2]


@dataclass(frozen=True, eq=False)  # tensors inside: compared by identity
class PushChannel:
    """One call's way through the protocol (built by ``SymmMemAllReduce``; the same on every
    rank but ``rank``): for the producer, where its slot is in every inbox; for the consumer,
    which counters to wait on."""

    inbox_ptrs: torch.Tensor  # (world_size,) int64 on the device: every rank's inbox
    pad_ptrs: torch.Tensor    # (world_size,) int64 on the device: every rank's int32 signal pad
    pad_at: int               # the first of the PUSH_PAD_SLOTS counters in each pad
    half: int                 # 0 or 1: this call's inbox half and counter pair
    slot_offset: int          # where this rank's slot of this call is in every inbox (elements)
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size or self.half not in (0, 1) or self.slot_offset < 0:
            raise ValueError(f"a push channel needs 0 <= rank < world_size, half 0 or 1 and a slot offset "
                             f">= 0, got rank {self.rank} of {self.world_size}, half {self.half}, "
                             f"slot offset {self.slot_offset}")
        for name in ("inbox_ptrs", "pad_ptrs"):
            t = getattr(self, name)
            if t.dtype != torch.int64 or t.shape != (self.world_size,):
                raise ValueError(f"{name} must be ({self.world_size},) int64, got {tuple(t.shape)} {t.dtype}")


@triton.jit
def push_tile(y, cols, col_ok, inbox_ptrs, slot_offset, pad_ptrs, pad_at, half, N,
              RANK: tl.constexpr, WORLD: tl.constexpr):
    """Store this program's tile ``y`` (rounded to the inbox dtype) at ``slot_offset + cols``
    of every peer's inbox (the caller stores its own), then count its columns into every
    peer's ``arrived[half]``; program 0 also raises this rank's ``expected[half]`` by the
    call's N * (WORLD - 1)."""
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            inbox = tl.load(inbox_ptrs + peer).to(tl.pointer_type(y.dtype)) + slot_offset
            tl.store(inbox + cols, y, mask=col_ok)
    tl.debug_barrier()  # every thread's stores precede the releases below
    count = tl.sum(col_ok.to(tl.int32), axis=0)
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            arrived = tl.load(pad_ptrs + peer).to(tl.pointer_type(tl.int32)) + pad_at + half
            tl.atomic_add(arrived, count, sem="release", scope="sys")
    if tl.program_id(0) == 0:
        expected = tl.load(pad_ptrs + RANK).to(tl.pointer_type(tl.int32)) + pad_at + 2 + half
        tl.store(expected, tl.load(expected) + N * (WORLD - 1))


@triton.jit
def wait_pushed(pad_ptrs, pad_at, half, RANK: tl.constexpr):
    """Wait until every peer's tiles of this call are in this rank's inbox half ``half``
    (or a later call's too: a peer may be one call ahead). Loads after it see them."""
    pad = tl.load(pad_ptrs + RANK).to(tl.pointer_type(tl.int32)) + pad_at
    expected = tl.load(pad + 2 + half)  # written by this rank's producer, a kernel earlier
    while tl.atomic_add(pad + half, 0, sem="acquire", scope="sys") - expected < 0:
        pass
    tl.debug_barrier()  # every thread's loads follow the acquire above


@triton.jit
def pushed_sum(slots, k, mask, N, WORLD: tl.constexpr):
    """The all-reduced row at columns ``k``: slot 0 + ... + slot WORLD-1 (each N wide, from
    ``slots``), in rank order, in fp32, rounded to the slots' dtype (0 where ``mask`` is
    False; ``mask`` None: every column). ``.cg``: from L2, which peers' stores reach, never
    from a line an earlier call left in L1."""
    acc = tl.zeros(k.shape, tl.float32)
    for r in tl.static_range(WORLD):
        if mask is None:
            part = tl.load(slots + r * N + k, cache_modifier=".cg")
        else:
            part = tl.load(slots + r * N + k, mask=mask, other=0.0, cache_modifier=".cg")
        acc += part.to(tl.float32)
    return acc.to(slots.dtype.element_ty)
