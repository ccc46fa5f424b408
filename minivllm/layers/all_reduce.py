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
  kernel and one barrier, where NCCL's ring pays a protocol per message: NCCL takes
  about 7 us for 8 KB on two H200s (BENCHMARKS.md, TP section), which is the batch-1
  decode step's all-reduce. vLLM's custom all-reduce and its symmetric-memory
  communicator do the same.

No NVLink multicast is used (``multimem`` ops need it; the one-shot kernel reads peers
with ordinary loads), so the device machines' ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``
stands.

The executor installs the fast path (``install_symm_mem_all_reduce``) after the process
group exists and before CUDA graphs are captured; graphs then bake in the one-shot
kernel. ``uninstall`` releases it (before the group is destroyed).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Largest message the one-shot path takes; larger ones go to NCCL. Each rank reads
# every peer's whole message, so its cost grows with world size x bytes, where NCCL's
# ring moves 2 x bytes / world size per rank: small messages are the one-shot's.
# vLLM's custom all-reduce switches at 1-8 MB for two ranks (by GPU).
DEFAULT_MAX_BYTES = 4 << 20


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
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9, a no-op after
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        self._op = torch.ops.symm_mem.one_shot_all_reduce_copy

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes this way: the dtype, contiguous, 16-byte sized, small enough."""
        n = x.numel()
        return (x.dtype == self.dtype and x.is_contiguous() and 0 < n <= self.max_numel
                and (n * x.element_size()) % 16 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over ranks, as a new tensor (``x`` is left as it was)."""
        slot = self.buffer.narrow(0, 0, x.numel()).view(x.shape)
        return self._op(slot, x, "sum", self.group_name)


_installed: SymmMemAllReduce | None = None


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


def install_symm_mem_all_reduce(device: torch.device, dtype: torch.dtype,
                                max_bytes: int = DEFAULT_MAX_BYTES) -> str | None:
    """Route small all-reduces through the one-shot kernel from now on.

    Every rank must call it (the buffer's rendezvous is a collective). Returns None when
    installed, else why not (the caller reports it; NCCL then takes every message).
    """
    global _installed
    if device.type != "cuda" or not dist.is_initialized() or dist.get_world_size() < 2:
        return "needs CUDA and a process group of two or more ranks"
    try:
        _installed = SymmMemAllReduce(dist.group.WORLD, device, dtype, max_bytes)
    except (RuntimeError, AttributeError, ImportError) as e:
        _installed = None
        return f"symmetric memory unavailable: {type(e).__name__}: {e}"
    return None


def installed() -> SymmMemAllReduce | None:
    """The installed one-shot path, if any."""
    return _installed


def uninstall() -> None:
    """Back to ``torch.distributed.all_reduce`` for every message (frees the buffer)."""
    global _installed
    _installed = None
