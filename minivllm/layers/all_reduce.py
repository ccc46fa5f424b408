"""The tensor-parallel all-reduce that row-parallel layers and the vocab-parallel
embedding call: ``y = all_reduce(y)``.

Two paths, one function:

- ``torch.distributed.all_reduce`` on the default group (NCCL on CUDA, gloo on the
  CPU): every message when nothing else is installed, and large ones (prefill).
- a **one-shot all-reduce over symmetric memory** for small CUDA messages (a decode
  step's activations: 256 x 4096 bf16 is 2 MB). Each rank's buffer is mapped into
  every other rank's address space (``torch.distributed._symmetric_memory``: CUDA
  virtual memory shared over NVLink); one kernel copies the rank's partial sum into its
  own buffer, waits at a barrier on signal pads, reads every peer's buffer and adds. One
  kernel and one barrier, where NCCL's ring pays a protocol per message: at 8 KB (the
  batch-1 decode step's all-reduce of Qwen3-8B) 6.7 us against NCCL's 12.7 on two
  H200s, in CUDA graphs (``benchmarks.all_reduce``). vLLM's custom all-reduce and its
  symmetric-memory communicator do the same. From 1 MB (``TWO_SHOT_MIN_BYTES``: a decode
  step of 128 or more tokens of Qwen3-8B) the **two-shot** kernel over the same buffer instead: each rank reduces its
  1/world share and writes it to every peer, half the traffic for one more barrier
  (15.2 us against one-shot's 21.9 and NCCL's 33.7 at 2 MB).

No NVLink multicast is used (``multimem`` ops need it; the one-shot and two-shot kernels
read and write peers with ordinary loads and stores), so the device machines'
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` stands.

The executor installs the fast path (``install_symm_mem_all_reduce``) after the process
group exists and before CUDA graphs are captured; graphs then bake in its kernels.
``uninstall`` releases it (before the group is destroyed).

With ``fuse_norm`` (the default), the all-reduces of ``o_proj`` and ``down_proj`` are
left to the residual add + RMSNorm after them, one kernel over a symmetric buffer of its
own (``kernels/all_reduce_rms_norm.py``), and the GEMM writes its partial sum straight
into that buffer (``output_slot``).
"""

from __future__ import annotations

import functools
import math
import os

from dataclasses import dataclass

import torch
import torch.distributed as dist

from minivllm.kernels._push_all_reduce import PUSH_PAD_SLOTS, PushChannel

# Largest message the symmetric-memory paths take; larger ones go to NCCL. The one-shot
# kernel has every rank read every peer's whole message (one barrier); the two-shot
# kernel has each rank reduce its 1/world share and write it to every peer (a
# reduce-scatter and an all-gather, two barriers): less traffic, one more barrier.
# Measured on two H200s over NVLink, bf16, in CUDA graphs (``benchmarks.all_reduce``,
# us per all-reduce, NCCL / one-shot / two-shot):
#     8 KB 11.9 / 6.6 / 8.3;  64 KB 12.6 / 7.4 / 8.4;  256 KB 13.0 / 9.5 / 9.0;
#     2 MB 33.7 / 21.9 / 15.2;  8 MB 52.3 / 62.6 / 36.2.
# A second machine (sixth session): 256 KB 12.9 / 9.5 / 12.7;  512 KB 14.9 / 11.4 / 13.5;
#     1 MB 20.3 / 15.4 / 16.5;  2 MB 31.8 / 22.5 / 20.1;  8 MB 51.6 / 61.8 / 41.0.
# The crossover moves between machines (256 KB on the first, 2 MB on the second); over
# both, one-shot wins below 1 MB (a decode step's activations up to 128 tokens of
# Qwen3-8B) and two-shot from 1 MB (mean 14.1 vs 15.2 us there) to 8 MB; NCCL above
# (prefill chunks).
DEFAULT_MAX_BYTES = 8 << 20
TWO_SHOT_MIN_BYTES = 1 << 20


@dataclass(frozen=True, eq=False)  # tensors inside: compared by identity
class PushedRow:
    """A one-row partial sum that a row-parallel GEMV pushes to every rank
    (``kernels/_push_all_reduce.py``) and the norm after it collects."""

    out: torch.Tensor       # (1, N): this rank's slot, where its GEMV writes
    slots: torch.Tensor     # (world_size, N): every rank's slot in this rank's inbox
    channel: PushChannel    # the call's pointer tables, counters and half


class SymmMemAllReduce:
    """The one-shot all-reduce over a symmetric buffer of ``max_bytes``.

    Args:
        group: the tensor-parallel process group (NCCL, every rank a GPU of one host).
        device: this rank's CUDA device.
        dtype: the activations' dtype (other dtypes take NCCL).
        max_bytes: largest message this path takes.

    Raises:
        RuntimeError: symmetric memory is not available (torch build, driver, no peer
            access); ``install_symm_mem_all_reduce`` catches it and keeps NCCL.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                 max_bytes: int = DEFAULT_MAX_BYTES, fuse_norm: bool = False, push: bool = False) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_name = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and not hasattr(enable, "__deprecated__"):  # older torch needs it
            enable(self.group_name)
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        self.world_size = dist.get_world_size(group)
        self._one_shot = torch.ops.symm_mem.one_shot_all_reduce_copy
        # Absent from older torch builds: then the one-shot kernel takes every size.
        self._two_shot = getattr(torch.ops.symm_mem, "two_shot_all_reduce_out", None)
        self.fuses_norm = False
        self.pushes = False
        if fuse_norm:
            self._set_up_fused_norm(group, device, symm_mem)
            self.pushes = push

    def _set_up_fused_norm(self, group: dist.ProcessGroup, device: torch.device, symm_mem: object) -> None:
        """The fused all-reduce + residual add + RMSNorm kernel's own symmetric buffer (two
        halves, used by consecutive calls in turn), its tables of every rank's buffer and
        signal pad (the pads zeroed on every rank before any is used)."""
        from minivllm.kernels.all_reduce_rms_norm import signal_pad_numel

        self.rank = dist.get_rank(group)
        # Apart from ``self.buffer``: torch's one- and two-shot kernels (the embedding's
        # all-reduce) must not share the halves' no-second-barrier protocol.
        self.fused_buffer = symm_mem.empty(2 * self.max_numel, dtype=self.dtype,  # type: ignore[attr-defined]
                                           device=device)
        self._fused_handle = symm_mem.rendezvous(self.fused_buffer, self.group_name)  # type: ignore[attr-defined]
        self._half = 0  # the half the next fused call uses
        self.pad_at = signal_pad_numel(self.world_size)  # the push counters follow the fused kernel's slots
        self.pad = symm_mem.empty(self.pad_at + PUSH_PAD_SLOTS, dtype=torch.int32,  # type: ignore[attr-defined]
                                  device=device)
        self.pad.zero_()
        pad_handle = symm_mem.rendezvous(self.pad, self.group_name)  # type: ignore[attr-defined]
        if any(ptr % 16 for ptr in self._fused_handle.buffer_ptrs):  # the kernel loads peers' rows as 16-byte vectors
            raise RuntimeError(f"symmetric buffers not 16-byte aligned: {list(self._fused_handle.buffer_ptrs)}")
        self.buf_ptrs = torch.tensor(list(self._fused_handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.pad_ptrs = torch.tensor(list(pad_handle.buffer_ptrs), dtype=torch.int64, device=device)
        self._pad_handle = pad_handle
        torch.cuda.synchronize(device)
        dist.barrier(group)  # no peer signals into a pad before it is zero
        self.fuses_norm = True

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, warm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``add_rms_norm(all_reduce(x), residual)`` in one kernel (``x`` as ``takes`` allows),
        through the next half of the fused buffer; ``x`` is not copied if it is that half
        already (``fused_slot``). A decoder's forward makes an even number of these calls
        (two a layer), so every forward starts on the first half, and CUDA graphs captured
        at different times, replayed in any order, still alternate the halves. ``warm``: the
        weight of the layer after the norm; at one row, with ``MINIVLLM_AR_WARM_MB`` set, the
        kernel asks L2 for that many MB of it while it waits on its peers (opt-in: the
        kernel's module doc)."""
        from minivllm.kernels.all_reduce_rms_norm import all_reduce_add_rms_norm as kernel
        from minivllm.kernels.all_reduce_rms_norm import pushed_add_rms_norm

        row = self.pushed(x)
        if row is not None:  # its producer used the half up
            return pushed_add_rms_norm(row.slots, residual.contiguous(), weight, eps, row.channel)
        offset = self._half * self.max_numel
        in_place = x.data_ptr() == self.fused_buffer.data_ptr() + offset * x.element_size()
        self._half ^= 1  # every rank makes the same calls: the halves agree
        warm_bytes = warm_l2_bytes() if warm is not None and x.shape[0] == 1 else 0
        return kernel(x, residual.contiguous(), weight, eps, self.buf_ptrs, self.pad_ptrs,
                      self.rank, self.world_size, buf_offset=offset, in_place=in_place,
                      warm=warm if warm_bytes else None, warm_bytes=warm_bytes)

    def push_target(self, shape: tuple[int, ...], dtype: torch.dtype) -> PushedRow | None:
        """Where a row-parallel GEMV's one-row partial sum (``shape``) goes when it pushes it
        (``_push_all_reduce``): this rank's slot of the next half, and the channel; None where
        the push does not take it (then ``fused_slot``). Uses up the half, as ``add_rms_norm``
        does (one call: the consumer finds the half from the slot's address, ``pushed``)."""
        if not (self.pushes and len(shape) == 2 and shape[0] == 1 and self.fuses(shape, dtype)
                and (self.world_size + 1) * shape[1] <= self.max_numel):
            return None
        row = self._pushed_row(self._half, shape[1])
        self._half ^= 1
        return row

    def pushed(self, x: torch.Tensor) -> PushedRow | None:
        """The pushed row whose slot ``x`` is (a ``push_target``'s ``out``), or None."""
        if not (self.pushes and x.dim() == 2 and x.shape[0] == 1 and x.dtype == self.dtype):
            return None
        for half in (0, 1):
            row = self._pushed_row(half, x.shape[1])
            if x.data_ptr() == row.out.data_ptr():
                return row
        return None

    def _pushed_row(self, half: int, n: int) -> PushedRow:
        """Half ``half``'s push slots of rows n wide. They start one row into the half, so no
        pushed row shares an address with the fused kernel's rows (which start at the half,
        where ``add_rms_norm`` takes a row as written in place)."""
        start = half * self.max_numel + n
        slots = self.fused_buffer.narrow(0, start, self.world_size * n).view(self.world_size, n)
        channel = PushChannel(self.buf_ptrs, self.pad_ptrs, self.pad_at, half, start + self.rank * n,
                              self.rank, self.world_size)
        return PushedRow(slots[self.rank:self.rank + 1], slots, channel)

    def fused_slot(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The view of the fused buffer's next half that a ``shape`` partial sum would be
        copied into by the next ``add_rms_norm`` (a GEMM may write it there instead), or
        None where this path does not take such a tensor."""
        if not self.fuses(shape, dtype):
            return None
        return self.fused_buffer.narrow(0, self._half * self.max_numel, math.prod(shape)).view(shape)

    def fuses(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Whether a contiguous ``shape`` partial sum may be left to ``add_rms_norm``: the
        fused kernel is set up, and takes (T, N) rows of this dtype and size."""
        from minivllm.kernels.rms_norm import MAX_HIDDEN

        return (self.fuses_norm and len(shape) == 2 and shape[1] <= MAX_HIDDEN
                and self._takes(math.prod(shape), dtype))

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes this way: the dtype, contiguous, 16-byte sized, small enough."""
        return x.is_contiguous() and self._takes(x.numel(), x.dtype)

    def _takes(self, numel: int, dtype: torch.dtype) -> bool:
        return dtype == self.dtype and 0 < numel <= self.max_numel and (numel * dtype.itemsize) % 16 == 0

    def uses_two_shot(self, x: torch.Tensor) -> bool:
        """Whether ``x`` (which this path takes) goes through the two-shot kernel."""
        return self._uses_two_shot(x.numel() * x.element_size())

    def _uses_two_shot(self, nbytes: int) -> bool:
        """From ``TWO_SHOT_MIN_BYTES`` up, when every rank's share is a whole number of
        16-byte vectors."""
        return (self._two_shot is not None and nbytes >= TWO_SHOT_MIN_BYTES
                and nbytes % (16 * self.world_size) == 0)

    def slot_for(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The view of the symmetric buffer that a contiguous ``shape`` tensor would be
        copied into before the two-shot kernel, if it goes that way; else None."""
        numel = math.prod(shape)
        if not self._takes(numel, dtype) or not self._uses_two_shot(numel * dtype.itemsize):
            return None
        return self.buffer.narrow(0, 0, numel).view(shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over ranks, as a new tensor (``x`` is left as it was)."""
        return self.two_shot(x) if self.uses_two_shot(x) else self.one_shot(x)

    def one_shot(self, x: torch.Tensor) -> torch.Tensor:
        """The sum through the one-shot kernel (any size ``takes`` allows)."""
        slot = self.buffer.narrow(0, 0, x.numel()).view(x.shape)
        return self._one_shot(slot, x, "sum", self.group_name)

    def two_shot(self, x: torch.Tensor) -> torch.Tensor:
        """The sum through the two-shot kernel (needs ``two_shot_all_reduce_out`` and
        whole 16-byte vectors per rank)."""
        slot = self.buffer.narrow(0, 0, x.numel()).view(x.shape)
        if x.data_ptr() != slot.data_ptr():  # unless written there already (``output_slot``)
            slot.copy_(x)  # the two-shot kernel reduces in the symmetric buffer (it scratches it)
        return self._two_shot(slot, "sum", self.group_name, torch.empty_like(x))


def ranks_in_one_process(world_size: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                         max_numel: int = 1024) -> list[SymmMemAllReduce]:
    """Every rank's fused path with the push on, in this process, over plain tensors of one
    device (no symmetric memory, no process group): NaN-filled buffers, zeroed pads, tables
    shared by all. For running the ranks' kernels one after the other, a call's producers
    before its consumers (whose waits then pass at once): the CPU tests, the one-GPU test
    and ``benchmarks.push_all_reduce``."""
    from minivllm.kernels.all_reduce_rms_norm import signal_pad_numel

    paths = []
    for rank in range(world_size):
        path = object.__new__(SymmMemAllReduce)
        path.dtype, path.max_numel, path.fuses_norm, path.pushes, path._half = dtype, max_numel, True, True, 0
        path.rank, path.world_size = rank, world_size
        path.fused_buffer = torch.full((2 * max_numel,), float("nan"), dtype=dtype, device=device)
        path.pad_at = signal_pad_numel(world_size)
        path.pad = torch.zeros(path.pad_at + PUSH_PAD_SLOTS, dtype=torch.int32, device=device)
        paths.append(path)
    table = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=device)  # noqa: E731
    buf_ptrs, pad_ptrs = table([p.fused_buffer for p in paths]), table([p.pad for p in paths])
    for path in paths:
        path.buf_ptrs, path.pad_ptrs = buf_ptrs, pad_ptrs
    return paths


_installed: SymmMemAllReduce | None = None
# Whether this process has set the path up before. torch keeps symmetric memory's group
# state by group name, and a later process group reuses the name ("0") with a new store:
# seen on two H200s, the second tensor-parallel LLM of one process hung in its rendezvous
# (torch 2.11, through the deprecated ``enable_symm_mem_for_group`` cache). So once per
# process; ``TPExecutor`` sends later groups of the same process, on every rank, to NCCL.
_used_in_this_process = False


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the tensor-parallel ranks (the default group).

    Returns a tensor holding the sum: ``x`` itself, reduced in place (NCCL, gloo), or a
    new tensor (one-shot path). Callers use the return value.
    """
    fast = _installed
    if fast is not None and fast.takes(x):
        return fast(x)
    dist.all_reduce(x)
    return x


def output_slot(shape: tuple[int, ...], dtype: torch.dtype, into_norm: bool = False) -> torch.Tensor | None:
    """Where a row-parallel layer may write its partial output (``shape``, ``dtype``) so that
    the all-reduce finds it already in the symmetric buffer: the buffer's view when the
    installed path sends such a tensor through the two-shot kernel, which would otherwise
    copy it there first (119 us per batch-256 decode step of Qwen3-8B at TP=2, fifth
    session). For an output feeding a norm that the fused kernel reduces (``into_norm``),
    the half of the fused buffer that the kernel would copy it into. None otherwise."""
    fast = _installed
    if fast is None:
        return None
    if into_norm and fast.fuses_norm:
        return fast.fused_slot(shape, dtype)
    return fast.slot_for(shape, dtype)


def push_target(shape: tuple[int, ...], dtype: torch.dtype) -> PushedRow | None:
    """Where a row-parallel GEMV whose one-row output (``shape``) feeds a reducing norm pushes
    its partial sum (``SymmMemAllReduce.push_target``), or None: the layer then writes it as
    ``output_slot`` says. Only the layer's GEMV may write there (it pushes as it writes)."""
    fast = _installed
    return fast.push_target(shape, dtype) if fast is not None else None


def pushes() -> bool:
    """Whether the installed path pushes one-row sums (``push_target`` may offer a slot): a
    flag read, so a layer asks it before anything dearer."""
    fast = _installed
    return fast is not None and fast.pushes


def pushed_row(x: torch.Tensor) -> PushedRow | None:
    """The pushed row ``x`` is the slot of (the norm after the layer collects it), or None."""
    fast = _installed
    return fast.pushed(x) if fast is not None else None


def check_forward_start() -> None:
    """Called as every model forward starts (eager, or captured into a CUDA graph): the
    fused path must be on the first of its buffer halves, which holds while every forward
    makes an even number of fused calls (two a decoder layer). Graphs captured at
    different parities could otherwise run one half twice in a row, a silent race
    (``SymmMemAllReduce.add_rms_norm``).

    Raises:
        RuntimeError: the halves are out of step (an earlier forward stopped part-way, or
            made an odd number of fused calls).
    """
    fast = _installed
    if fast is not None and fast.fuses_norm and fast._half != 0:
        raise RuntimeError("the fused all-reduce's buffer halves are out of step at the start of a forward "
                           "(an earlier forward stopped part-way, or made an odd number of fused calls); "
                           "the tensor-parallel engine must be restarted")


def defers_to_norm(x: torch.Tensor) -> bool:
    """Whether a row-parallel output ``x`` that feeds a residual add + RMSNorm leaves its
    all-reduce to that norm (the fused kernel is installed and takes ``x``). The layer
    and the norm both ask, about tensors of one shape, so they agree."""
    fast = _installed
    return fast is not None and fast.fuses_norm and x.is_contiguous() and fast.fuses(tuple(x.shape), x.dtype)


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float, warm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(sum + residual), sum + residual)`` of the ranks' partial sums ``x``,
    in one kernel; only where ``defers_to_norm(x)``. ``warm``: the next layer's weight
    (``SymmMemAllReduce.add_rms_norm``)."""
    assert _installed is not None and _installed.fuses_norm
    return _installed.add_rms_norm(x, residual, weight, eps, warm)


WARM_ENV = "MINIVLLM_AR_WARM_MB"


@functools.cache
def warm_l2_bytes() -> int:
    """``MINIVLLM_AR_WARM_MB`` in bytes: how much of the next layer's weight the one-row fused
    all-reduce asks L2 for (0, the default: none). Read once.

    Raises:
        ValueError: the variable is not a whole number of MB >= 0.
    """
    raw = os.environ.get(WARM_ENV, "0")
    if not raw.isdigit():
        raise ValueError(f"{WARM_ENV} must be a whole number of MB >= 0, got {raw!r}")
    return int(raw) * 1_000_000


def install_symm_mem_all_reduce(device: torch.device, dtype: torch.dtype,
                                max_bytes: int = DEFAULT_MAX_BYTES, fuse_norm: bool = False,
                                push: bool = False) -> str | None:
    """Route small all-reduces through the symmetric-memory kernels from now on; with
    ``fuse_norm``, also let row-parallel layers leave their all-reduce to the residual
    add + RMSNorm after them (``kernels/all_reduce_rms_norm.py``;
    ``ExecutorConfig.fuse_all_reduce_norm``, on by default: on two H200s it took 1,028
    us per batch-256 decode step of Qwen3-8B where the two-shot all-reduce and the norm
    apart took 1,394 + 233). With ``push`` too, a one-row partial sum (batch-1 decode) is
    pushed by the GEMV that computes it into every rank's buffer and summed by the kernel
    that needs it (``kernels/_push_all_reduce.py``; ``ExecutorConfig.push_all_reduce``).

    Every rank must call it (the buffer's rendezvous is a collective). Returns None when
    installed, else why not (the caller reports it; NCCL then takes every message).
    """
    global _installed, _used_in_this_process
    if device.type != "cuda" or not dist.is_initialized() or dist.get_world_size() < 2:
        return "needs CUDA and a process group of two or more ranks"
    if _used_in_this_process:
        return "an earlier process group of this process set it up (once per process)"
    _used_in_this_process = True
    try:
        _installed = SymmMemAllReduce(dist.group.WORLD, device, dtype, max_bytes, fuse_norm, push)
    except (RuntimeError, AttributeError, ImportError) as e:
        _installed = None
        return f"symmetric memory unavailable: {type(e).__name__}: {e}"
    return None


def used_in_this_process() -> bool:
    """Whether this process has set the path up before (then it must not again: every rank
    of a new group has to be told, ``TPExecutor`` does)."""
    return _used_in_this_process


def installed() -> SymmMemAllReduce | None:
    """The installed one-shot path, if any."""
    return _installed


def uninstall() -> None:
    """Back to ``torch.distributed.all_reduce`` for every message (frees the buffer)."""
    global _installed
    _installed = None
