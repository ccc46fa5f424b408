"""The tensor-parallel communicator: every collective a sharded model makes.

One ``Communicator`` per engine, built by the executor and reached through its ``Ops``
(``minivllm/ops/dispatch.py``); nothing here is process-wide. Two paths:

- ``torch.distributed`` on the default group (NCCL on CUDA, gloo on the CPU): every
  message when nothing else is set up, and large ones (prefill chunks).
- ``SymmMemAllReduce``, symmetric memory on CUDA: each rank's buffer is mapped into
  every peer's address space (``torch.distributed._symmetric_memory``, CUDA virtual
  memory shared over NVLink). Small messages take torch's one-shot kernel (copy in,
  one barrier, read every peer and add), from ``TWO_SHOT_MIN_BYTES`` its two-shot
  kernel (reduce-scatter + all-gather over the same buffer). The all-reduce of the
  row-parallel layers, whose outputs always feed a residual add + RMSNorm, runs inside
  that norm: one kernel over a buffer of its own (``kernels/all_reduce_rms_norm.py``),
  which the layer's GEMM writes straight into (``partial_slot``).
  Why these paths and sizes: docs/tuning.md, "All-reduce paths and thresholds".

No NVLink multicast is used (no ``multimem`` ops), so ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``
may stand.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

# Largest message the symmetric-memory paths take; larger ones go to NCCL.
DEFAULT_MAX_BYTES = 8 << 20
TWO_SHOT_MIN_BYTES = 1 << 20


def uses_two_shot(nbytes: int, world_size: int) -> bool:
    """Whether a plain sum of ``nbytes`` takes the two-shot kernel: from ``TWO_SHOT_MIN_BYTES``
    up, when every rank's share is a whole number of 16-byte vectors."""
    return nbytes >= TWO_SHOT_MIN_BYTES and nbytes % (16 * world_size) == 0


class SymmMemAllReduce:
    """The symmetric-memory all-reduces of one process group: one-shot / two-shot for plain
    sums, and the fused all-reduce + residual add + RMSNorm.

    Args:
        group: the tensor-parallel process group (NCCL, every rank a GPU of one host).
        device: this rank's CUDA device.
        dtype: the activations' dtype (other dtypes take NCCL).
        max_bytes: largest message this path takes.

    Raises:
        RuntimeError: symmetric memory is not available (torch build, driver, no peer
            access) or its buffers are not 16-byte aligned.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        from minivllm.kernels.all_reduce_rms_norm import signal_pad_numel

        self.group_name = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and not hasattr(enable, "__deprecated__"):  # older torch needs it
            enable(self.group_name)
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        self._handle = symm_mem.rendezvous(self.buffer, self.group_name)
        self._one_shot = torch.ops.symm_mem.one_shot_all_reduce_copy
        # Absent from older torch builds: then the one-shot kernel takes every size.
        self._two_shot = getattr(torch.ops.symm_mem, "two_shot_all_reduce_out", None)
        # The fused kernel's buffer, apart from ``buffer``: torch's kernels must not share
        # its protocol (two halves used by consecutive calls in turn, no second barrier).
        self.fused_buffer = symm_mem.empty(2 * self.max_numel, dtype=dtype, device=device)
        self._fused_handle = symm_mem.rendezvous(self.fused_buffer, self.group_name)
        self.pad = symm_mem.empty(signal_pad_numel(self.world_size), dtype=torch.int32, device=device)
        self.pad.zero_()
        self._pad_handle = symm_mem.rendezvous(self.pad, self.group_name)
        if any(ptr % 16 for ptr in self._fused_handle.buffer_ptrs):  # peers' rows load as 16-byte vectors
            raise RuntimeError(f"symmetric buffers not 16-byte aligned: {list(self._fused_handle.buffer_ptrs)}")
        self.buf_ptrs = torch.tensor(list(self._fused_handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.pad_ptrs = torch.tensor(list(self._pad_handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.half = 0  # the half of ``fused_buffer`` the next fused call uses
        torch.cuda.synchronize(device)
        dist.barrier(group)  # no peer signals into a pad before it is zero

    def takes(self, x: torch.Tensor) -> bool:
        """Whether a plain sum of ``x`` goes this way: the dtype, contiguous, 16-byte sized, small enough."""
        return x.is_contiguous() and self._takes(x.numel(), x.dtype)

    def _takes(self, numel: int, dtype: torch.dtype) -> bool:
        return dtype == self.dtype and 0 < numel <= self.max_numel and (numel * dtype.itemsize) % 16 == 0

    def fuses(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Whether the fused kernel takes a contiguous ``shape`` (T, N) partial sum."""
        from minivllm.kernels.rms_norm import MAX_HIDDEN

        return len(shape) == 2 and shape[1] <= MAX_HIDDEN and self._takes(math.prod(shape), dtype)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` (which ``takes`` accepts) over ranks, as a new tensor."""
        slot = self.buffer.narrow(0, 0, x.numel()).view(x.shape)
        if self._two_shot is not None and uses_two_shot(x.numel() * x.element_size(), self.world_size):
            slot.copy_(x)  # the two-shot kernel reduces in the symmetric buffer (it scratches it)
            return self._two_shot(slot, "sum", self.group_name, torch.empty_like(x))
        return self._one_shot(slot, x, "sum", self.group_name)

    def partial_slot(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The view of the fused buffer's next half where a ``shape`` partial sum feeding the
        next ``add_rms_norm`` may be written (then it is not copied), or None."""
        if not self.fuses(shape, dtype):
            return None
        return self.fused_buffer.narrow(0, self.half * self.max_numel, math.prod(shape)).view(shape)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``add_rms_norm(sum over ranks of x, residual)`` in one kernel, through the next half
        of the fused buffer (``x`` is not copied if it is that half already). A decoder's
        forward makes an even number of these calls (two a layer), so every forward starts on
        the first half, and CUDA graphs captured at different times, replayed in any order,
        still alternate the halves (``begin_forward`` checks it)."""
        from minivllm.kernels.all_reduce_rms_norm import all_reduce_add_rms_norm

        offset = self.half * self.max_numel
        in_place = x.data_ptr() == self.fused_buffer.data_ptr() + offset * x.element_size()
        self.half ^= 1  # every rank makes the same calls: the halves agree
        return all_reduce_add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps, self.buf_ptrs,
                                       self.pad_ptrs, self.rank, self.world_size, buf_offset=offset,
                                       in_place=in_place, pdl=pdl)


class Communicator:
    """The collectives of one tensor-parallel engine on this rank.

    Args:
        rank: this rank; world_size: the number of ranks (of the default process group).
        symm: the symmetric-memory paths (CUDA), or None: every message through
            ``torch.distributed``.
    """

    def __init__(self, rank: int, world_size: int, symm: SymmMemAllReduce | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.symm = symm

    @property
    def path(self) -> str:
        """How this rank's all-reduces travel, in words (start-up log, benchmarks)."""
        if self.symm is None:
            return dist.get_backend() if dist.is_initialized() else "torch.distributed"
        return "one-shot / two-shot (symmetric memory) + nccl, fused with the residual add + RMSNorm"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over ranks: a new tensor, or ``x`` reduced in place. Use the result."""
        if self.symm is not None and self.symm.takes(x):
            return self.symm.all_reduce(x)
        dist.all_reduce(x)
        return x

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(S, n) on every rank -> (world_size * S, n), rank-major, in one collective."""
        out = x.new_empty((self.world_size * x.shape[0], x.shape[1]))
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    def partial_slot(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Where a row-parallel layer writes its partial sum for the next ``add_rms_norm``
        (the fused kernel's buffer), or None: any tensor will do."""
        return self.symm.partial_slot(shape, dtype) if self.symm is not None else None

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     pdl: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fused all-reduce + residual add + RMSNorm of the ranks' partial sums ``x``, or
        None where it does not take ``x`` (the caller then sums with ``all_reduce``)."""
        if self.symm is None or not x.is_contiguous() or not self.symm.fuses(tuple(x.shape), x.dtype):
            return None
        return self.symm.add_rms_norm(x, residual, weight, eps, pdl)

    def begin_forward(self) -> None:
        """Called as every model forward starts (eager, or captured into a CUDA graph).

        Raises:
            RuntimeError: the fused kernel's buffer halves are out of step (an earlier
                forward stopped part-way): graphs captured at different parities would
                run one half twice in a row, a silent race.
        """
        if self.symm is not None and self.symm.half != 0:
            raise RuntimeError("the fused all-reduce's buffer halves are out of step at the start of a forward "
                               "(an earlier forward stopped part-way); the tensor-parallel engine must be "
                               "restarted")

    def close(self) -> None:
        """Drop the symmetric buffers (before the process group is left)."""
        self.symm = None


def build_communicator(device: torch.device, dtype: torch.dtype,
                       custom_all_reduce: bool) -> tuple[Communicator, str | None]:
    """The default process group's communicator for this rank; with ``custom_all_reduce`` on
    CUDA, with the symmetric-memory paths. Every rank must call it (the buffers' rendezvous
    is a collective). Returns it and, where the symmetric paths were asked for but are not
    available, why (the caller reports it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if not custom_all_reduce or device.type != "cuda":
        return Communicator(rank, world), None
    try:
        return Communicator(rank, world, SymmMemAllReduce(dist.group.WORLD, device, dtype)), None
    except (RuntimeError, AttributeError, ImportError) as e:
        return Communicator(rank, world), f"symmetric memory unavailable: {type(e).__name__}: {e}"
