"""Tensor-parallel linear layers.

A column-parallel layer splits ``W (out, in)`` along ``out``: rank r computes
its slice of the output features and nothing is communicated. A row-parallel
layer splits ``W`` along ``in``: rank r multiplies its slice of the input
features (the output of a column-parallel layer) and the partial results are
summed over ranks where they go next (the residual add + RMSNorm, ``Ops.add_rms_norm``).
An MLP or attention block is therefore column -> (local work) -> row, one collective
per block.

Packed layers keep several checkpoint tensors in one matmul; each rank holds
its own shard of every part, parts concatenated in order::

    qkv_proj.weight on rank r (rows):  [ q heads of r | k heads of r | v heads of r ]
    gate_up_proj.weight on rank r:     [ gate rows of r | up rows of r ]

QKV shards fall on head boundaries. When there are fewer KV heads than ranks,
each KV head is replicated on ``tp_size // num_kv_heads`` consecutive ranks.

The weight-loader convention and the sharding rules these layers follow are in ``weights.py``.

FP8 weights (``kernels/fp8.py``): with ``fp8_block`` a layer holds its weight in e4m3 and
``weight_scale_inv``, one float32 scale per 128 x 128 block (a Qwen3-FP8 checkpoint's
tensors), which its weight loader shards as the weight, in units of blocks: every part a
rank holds must then start on a block edge. ``quantize_fp8_per_channel`` turns a loaded
16-bit layer into e4m3 with one scale per output row (``weight_scale``). Either way
``weight_scale`` is the scale the ops take beside the weight (None: a 16-bit layer).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.config import cdiv
from minivllm.layers.weights import (
    FP8_BLOCK_SIDE, Loaded, ShardId, WeightLoader, check_tp, default_weight_loader, divide, in_blocks,
    kv_heads_per_rank, load_slice, load_unpacked, set_weight_loader,
)
from minivllm.ops.dispatch import FP8_DTYPE, quantize_fp8_per_channel

class LinearBase(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` this rank's shard, stored (out_local, in_local); with
    ``fp8_block`` in e4m3 with its 128 x 128 block scales (module doc)."""

    def __init__(self, in_local: int, out_local: int, bias: bool, tp_rank: int, tp_size: int,
                 fp8_block: bool = False) -> None:
        super().__init__()
        check_tp(tp_rank, tp_size)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        # Uninitialised: the loader checks every parameter gets written.
        dtype = FP8_DTYPE if fp8_block else None
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=dtype), requires_grad=False)
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.empty(out_local), requires_grad=False) if bias else None
        )
        self.weight_scale_inv: nn.Parameter | None = None
        self.weight_scale_channel: nn.Parameter | None = None
        if fp8_block:
            self.weight_scale_inv = block_scale_parameter(cdiv(out_local, FP8_BLOCK_SIDE), cdiv(in_local, FP8_BLOCK_SIDE))

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == FP8_DTYPE

    def block_scale_of(self, param: nn.Parameter) -> nn.Parameter | None:
        """The block scales of an e4m3 weight (for filling dummy weights)."""
        return self.weight_scale_inv if param is self.weight else None

    @property
    def weight_scale(self) -> torch.Tensor | None:
        """The FP8 weight's scale: (cdiv(N, 128), cdiv(K, 128)) block scales or (N,) per-channel
        scales; None for a 16-bit weight."""
        return self.weight_scale_inv if self.weight_scale_inv is not None else self.weight_scale_channel

    def quantize_fp8_per_channel(self) -> None:
        """Replace the loaded 16-bit weight by its e4m3 values and one scale per output row
        (``kernels/fp8.py``: ``quantize_fp8_per_channel``).

        Raises:
            ValueError: the weight is FP8 already.
        """
        if self.is_fp8:
            raise ValueError(f"{type(self).__name__}: the weight is FP8 already")
        w_fp8, scale = quantize_fp8_per_channel(self.weight.data)
        self.weight = nn.Parameter(w_fp8, requires_grad=False)
        self.weight_scale_channel = nn.Parameter(scale, requires_grad=False)

    def _set_loaders(self, loader: WeightLoader, shard_ids: tuple[ShardId, ...] = (None,)) -> None:
        """``loader`` for the weight and its block scales; the bias's by the subclass."""
        for p in (self.weight, self.weight_scale_inv):
            if p is not None:
                set_weight_loader(p, loader, shard_ids)

    def _check_block_edges(self, starts: Sequence[int], what: str) -> None:
        """With block scales, every local part's start (in the packed and in the checkpoint
        tensor) on a 128 edge: a scale block must not span two parts or two ranks.

        Raises:
            ValueError: naming ``what`` and the offending start.
        """
        if self.weight_scale_inv is None:
            return
        bad = [s for s in starts if s % FP8_BLOCK_SIDE]
        if bad:
            raise ValueError(f"{what}: an FP8 block-scaled layer needs every part and rank to start on a multiple "
                             f"of {FP8_BLOCK_SIDE}, got start(s) {bad}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in_local) -> (..., out_local)
        """The torch reference; the decoder calls ``Ops.linear`` / ``Ops.gemv`` with the weights."""
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """Linear layer whose output features are split across ranks (no collective).

    Args:
        input_size: input features (every rank sees all of them).
        output_size: output features over all ranks.
        bias: add a (sharded) bias.
        tp_rank: this rank; tp_size: number of ranks.

    Raises:
        ValueError: ``output_size`` is not divisible by ``tp_size``.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, fp8_block: bool = False) -> None:
        local = divide(output_size, tp_size, "output_size")
        super().__init__(input_size, local, bias, tp_rank, tp_size, fp8_block)
        self.output_size = output_size
        self._check_block_edges([tp_rank * local], type(self).__name__)
        for p in self._parameters.values():
            if p is not None:
                set_weight_loader(p, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        """Copy this rank's rows of the full (output_size, ...) tensor.

        Raises:
            ValueError: a shard id was given, or the checkpoint shape is wrong.
        """
        load_unpacked(self, param, loaded, shard_id, dim=0, full=self.output_size)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs in one matmul (gate/up: shard ids 0 and 1).

    Args:
        input_size: input features.
        output_sizes: full output features of each packed part, in order.
        bias: add a (sharded) bias.
        tp_rank: this rank; tp_size: number of ranks.

    Raises:
        ValueError: an output size is not divisible by ``tp_size``.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], *, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, fp8_block: bool = False) -> None:
        locals_ = [divide(s, tp_size, f"output_sizes[{i}]") for i, s in enumerate(output_sizes)]
        super().__init__(input_size, sum(locals_), bias, tp_rank, tp_size, fp8_block)
        self.output_sizes = tuple(output_sizes)
        self.local_sizes = tuple(locals_)
        self._check_block_edges([sum(locals_[:i]) for i in range(len(locals_))] + [tp_rank * n for n in locals_],
                                type(self).__name__)
        shard_ids = tuple(range(len(output_sizes)))
        for p in self._parameters.values():
            if p is not None:
                set_weight_loader(p, self.weight_loader, shard_ids)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        """Copy this rank's rows of part ``shard_id`` into its place in the packed tensor.

        Raises:
            ValueError: an unknown shard id, or the checkpoint shape is wrong.
        """
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{type(self).__name__}: shard id must be in "
                             f"0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        offset, local, start, full = in_blocks(self, param, sum(self.local_sizes[:shard_id]),
                                               self.local_sizes[shard_id],
                                               self.tp_rank * self.local_sizes[shard_id], self.output_sizes[shard_id])
        load_slice(param.data.narrow(0, offset, local), loaded, 0, start, full,
                   f"{type(self).__name__} shard {shard_id}")


class QKVParallelLinear(LinearBase):
    """The q, k and v projections packed in one matmul, sharded on head boundaries.

    Args:
        hidden_size: input features.
        head_dim: D.
        num_heads: query heads over all ranks.
        num_kv_heads: KV heads over all ranks.
        bias: add a (sharded) bias.
        tp_rank: this rank; tp_size: number of ranks.

    Attributes:
        num_heads: query heads on this rank.
        num_kv_heads: KV heads on this rank (1 when KV heads are replicated).

    Raises:
        ValueError: ``num_heads`` is not divisible by ``tp_size``, or neither of
            ``num_kv_heads`` and ``tp_size`` divides the other.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, *,
                 bias: bool = False, tp_rank: int = 0, tp_size: int = 1, fp8_block: bool = False) -> None:
        check_tp(tp_rank, tp_size)
        heads = divide(num_heads, tp_size, "num_heads")
        kv_heads = kv_heads_per_rank(num_kv_heads, tp_size)
        # Replicated (fewer KV heads than ranks): ranks share a head tp_size // num_kv_heads at a time.
        kv_start = tp_rank * kv_heads if num_kv_heads >= tp_size else tp_rank // (tp_size // num_kv_heads)
        super().__init__(hidden_size, (heads + 2 * kv_heads) * head_dim, bias, tp_rank, tp_size, fp8_block)
        self.head_dim = head_dim
        self.num_heads = heads
        self.num_kv_heads = kv_heads
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        q, kv = heads * head_dim, kv_heads * head_dim
        # shard id -> (offset in the packed rows, local rows, start in checkpoint rows, checkpoint rows)
        self._layout: dict[str, tuple[int, int, int, int]] = {
            "q": (0, q, tp_rank * q, num_heads * head_dim),
            "k": (q, kv, kv_start * head_dim, num_kv_heads * head_dim),
            "v": (q + kv, kv, kv_start * head_dim, num_kv_heads * head_dim),
        }
        self._check_block_edges([x for offset, _, start, _ in self._layout.values() for x in (offset, start)],
                                type(self).__name__)
        for p in self._parameters.values():
            if p is not None:
                set_weight_loader(p, self.weight_loader, ("q", "k", "v"))

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        """Copy this rank's heads of the q, k or v tensor into the packed tensor.

        Raises:
            ValueError: shard id not one of "q", "k", "v", or the checkpoint shape is wrong.
        """
        if shard_id not in self._layout:
            raise ValueError(f"{type(self).__name__}: shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        offset, local, start, full = in_blocks(self, param, *self._layout[shard_id])  # type: ignore[index]
        load_slice(param.data.narrow(0, offset, local), loaded, 0, start, full,
                   f"{type(self).__name__} shard {shard_id!r}")


class RowParallelLinear(LinearBase):
    """Linear layer whose input features are split across ranks: each rank's output is a
    partial sum, and the sum over ranks happens where the output goes next.

    In the decoder that is always a residual add + RMSNorm (``Ops.add_rms_norm``), which
    sums the ranks' outputs in the same kernel. The bias is replicated but must count once
    in the sum over ranks: rank 0 adds it (``partial_bias``).

    Args:
        input_size: input features over all ranks.
        output_size: output features (every rank produces all of them).
        bias: add a replicated bias.
        tp_rank: this rank; tp_size: number of ranks.

    Raises:
        ValueError: ``input_size`` is not divisible by ``tp_size``.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, fp8_block: bool = False) -> None:
        local = divide(input_size, tp_size, "input_size")
        super().__init__(local, output_size, bias, tp_rank, tp_size, fp8_block)
        self.input_size = input_size
        self._check_block_edges([tp_rank * local], type(self).__name__)
        self._set_loaders(self.weight_loader)
        if self.bias is not None:
            set_weight_loader(self.bias, default_weight_loader)

    @property
    def partial_bias(self) -> torch.Tensor | None:
        """The bias this rank adds to its partial sum: the bias on rank 0, None elsewhere."""
        return self.bias if self.tp_rank == 0 else None

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        """Copy this rank's columns of the full (output_size, input_size) weight.

        Raises:
            ValueError: a shard id was given, or the checkpoint shape is wrong.
        """
        load_unpacked(self, param, loaded, shard_id, dim=1, full=self.input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in_local) -> (..., out)
        """This rank's partial sum (the torch reference; the decoder calls ``Ops``)."""
        return F.linear(x, self.weight, self.partial_bias)


def quantize_to_fp8(model: nn.Module) -> int:
    """On-the-fly FP8 (``quantization="fp8"``): every module of ``model`` that holds 16-bit
    weights it can hold in e4m3 (``quantize_fp8_per_channel``: the tensor-parallel linear
    layers, the MoE experts) to e4m3 with per-output-channel scales; the embedding, the LM head
    and the MoE router have no such method and stay as they are. Returns how many modules."""
    modules = [m for m in model.modules() if hasattr(m, "quantize_fp8_per_channel") and not m.is_fp8]
    for m in modules:
        m.quantize_fp8_per_channel()
    return len(modules)


def block_scale_parameter(*shape: int) -> nn.Parameter:
    """An uninitialised float32 parameter of 128 x 128 block scales (marked ``is_block_scale``:
    a dummy fill writes it with its weight)."""
    param = nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)
    param.is_block_scale = True  # type: ignore[attr-defined]
    return param
