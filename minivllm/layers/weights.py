"""How a parameter receives its rank's part of a checkpoint tensor, and the rules tensor
parallelism puts on a model's shapes: what every weight holder (linear, norm, embedding,
attention, experts) and the model loader share.

Every parameter carries ``weight_loader(param, loaded_weight, shard_id=None)``
and ``shard_ids`` (the shard ids the loader expects, ``(None,)`` for a plain
tensor). ``loaded_weight`` is a ``torch.Tensor`` or a ``CheckpointTensor`` (a
checkpoint tensor not read yet): a loader checks the *full* checkpoint shape
before narrowing to its rank's slice, so a wrong-shaped tensor raises
``ValueError`` rather than loading a slice of it by luck, and reads only that
slice, so rank r of N reads about 1/N of every sharded tensor. With one rank it
is a checked plain copy.

Divisibility: ``check_tp_divisibility`` states every constraint the TP size puts
on a model's shapes, in one place, so a launcher can reject a bad size before
any process starts; the layers raise the same errors from the same functions.
"""

from __future__ import annotations

import inspect
import weakref
from typing import TYPE_CHECKING, Callable, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from minivllm.config import FP8_WEIGHT_BLOCK, cdiv
from minivllm.ops.dispatch import FP8_DTYPE

FP8_BLOCK_SIDE = FP8_WEIGHT_BLOCK[0]  # the square 128 x 128 block of the checkpoints

if TYPE_CHECKING:
    from minivllm.config import ModelConfig

ShardId = str | int | tuple[int, int] | None


@runtime_checkable
class CheckpointTensor(Protocol):
    """A checkpoint tensor that has not been read: its shape, and reads of part or all of it.

    ``torch.Tensor`` has the same ``shape``, ``dtype`` and ``narrow``; only ``read``
    differs (see ``read_whole``).
    """

    @property
    def shape(self) -> torch.Size: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Read only ``[start, start + length)`` along ``dim``."""
        ...

    def read(self) -> torch.Tensor:
        """Read the whole tensor."""
        ...


Loaded = torch.Tensor | CheckpointTensor
WeightLoader = Callable[[nn.Parameter, Loaded, ShardId], None]


def read_whole(loaded: Loaded) -> torch.Tensor:
    """The whole tensor: ``loaded`` itself, or read from the checkpoint."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.read()


class RowRuns:
    """Runs of rows of a checkpoint tensor, in a given order, as one tensor not read yet (a
    ``CheckpointTensor``): ``narrow`` and ``read`` read only the rows they return. A tensor
    whose parts interleave (Qwen3-Next's ``in_proj_qkvz``: q, k, v and z rows per key head)
    is thereby loaded as its parts, each by its parameter's own loader, a rank reading its
    rows only.

    Args:
        source: the tensor, read or not.
        runs: ``(first row, rows)`` of ``source`` in the order they appear here.
        source_rows: the rows ``source`` must have (checked before anything is read).
        name: names ``source`` in errors.
    """

    def __init__(self, source: Loaded, runs: Sequence[tuple[int, int]], source_rows: int, name: str) -> None:
        self.source, self.runs, self.source_rows, self.name = source, tuple(runs), source_rows, name
        self.shape = torch.Size([sum(rows for _, rows in self.runs), *source.shape[1:]])

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Read ``[start, start + length)`` along ``dim`` (rows: only the runs' rows in it).

        Raises:
            ValueError: the range is outside the runs, or the source has other than
                ``source_rows`` rows.
        """
        check_narrow(self.name, self.shape, dim, start, length)
        if self.source.shape[0] != self.source_rows:
            raise ValueError(f"{self.name}: expected {self.source_rows} rows, got checkpoint shape "
                             f"{tuple(self.source.shape)}")
        lo, hi = (start, start + length) if dim == 0 else (0, self.shape[0])
        pieces, offset = [], 0
        for first, rows in self.runs:
            a, b = max(lo, offset), min(hi, offset + rows)
            if a < b:
                pieces.append(self.source.narrow(0, first + a - offset, b - a))
            offset += rows
        whole = torch.cat(pieces) if pieces else self.source.narrow(0, 0, 0)
        return whole if dim == 0 else whole.narrow(dim, start, length)

    def read(self) -> torch.Tensor:
        """Read every run, in order."""
        return self.narrow(0, 0, self.shape[0])


class _LayerLoader:
    """A layer's ``weight_loader`` method as its parameter holds it: the layer by weak
    reference, so a layer and its parameters form no reference cycle and a model is freed
    (GPU memory included) as soon as the last reference to it goes, without a collection."""

    __slots__ = ("layer", "method")

    def __init__(self, bound: Callable) -> None:
        self.layer = weakref.ref(bound.__self__)  # type: ignore[attr-defined]
        self.method = bound.__func__  # type: ignore[attr-defined]

    def __call__(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        layer = self.layer()
        if layer is None:
            raise RuntimeError("the layer this parameter belonged to is gone")
        self.method(layer, param, loaded, shard_id)


def set_weight_loader(
    param: nn.Parameter, loader: WeightLoader, shard_ids: tuple[ShardId, ...] = (None,)
) -> nn.Parameter:
    """Attach ``loader`` and the shard ids it expects to ``param`` (returned for chaining).
    A layer's own method is held without a reference back to the layer (``_LayerLoader``)."""
    param.weight_loader = _LayerLoader(loader) if inspect.ismethod(loader) else loader  # type: ignore[attr-defined]
    param.shard_ids = shard_ids  # type: ignore[attr-defined]
    return param


def get_weight_loader(param: nn.Parameter) -> WeightLoader:
    """The parameter's loader, or ``default_weight_loader`` for a plain parameter."""
    return getattr(param, "weight_loader", default_weight_loader)


def get_shard_ids(param: nn.Parameter) -> tuple[ShardId, ...]:
    """The shard ids that together write the whole parameter (``(None,)``: one tensor)."""
    return getattr(param, "shard_ids", (None,))


def _check_full_shape(dest: torch.Tensor, loaded: Loaded, dim: int, full: int, what: str) -> None:
    """``loaded`` must be ``dest``'s shape with ``full`` along ``dim`` (and FP8 paired as dest)."""
    expected = list(dest.shape)
    expected[dim] = full
    if list(loaded.shape) != expected:
        raise ValueError(f"{what}: expected checkpoint shape {tuple(expected)}, got {tuple(loaded.shape)}")
    check_fp8_pairing(dest, loaded, what)


def load_slice(
    dest: torch.Tensor, loaded: Loaded, dim: int, start: int, full: int, what: str
) -> None:
    """Copy ``loaded.narrow(dim, start, dest.shape[dim])`` into ``dest``.

    Only that slice of a ``CheckpointTensor`` is read.

    Args:
        dest: the (view of the) parameter to fill.
        loaded: the whole checkpoint tensor, read or not.
        dim: the dimension the checkpoint tensor is sharded along.
        start: this rank's first index along ``dim``.
        full: the checkpoint tensor's expected size along ``dim``.
        what: names the destination in error messages.

    Raises:
        ValueError: ``loaded`` does not have the expected full shape.
    """
    _check_full_shape(dest, loaded, dim, full, what)
    with torch.no_grad():
        dest.copy_(loaded.narrow(dim, start, dest.shape[dim]))


def load_segments(dest: torch.Tensor, loaded: Loaded, dim: int, full: int,
                  segments: Sequence[tuple[int, int, int]], what: str) -> None:
    """Copy several slices of ``loaded`` along ``dim`` into ``dest``: for each
    ``(offset, start, length)``, ``loaded[start:start + length]`` into ``dest[offset:offset + length]``
    (a rank's share of a tensor whose parts are each split over the ranks, e.g. the DeltaNet's
    q, k and v rows). Only those slices of a ``CheckpointTensor`` are read.

    Raises:
        ValueError: ``loaded`` is not ``dest``'s shape with ``full`` along ``dim``.
    """
    _check_full_shape(dest, loaded, dim, full, what)
    with torch.no_grad():
        for offset, start, length in segments:
            dest.narrow(dim, offset, length).copy_(loaded.narrow(dim, start, length))


def check_fp8_pairing(dest: torch.Tensor, loaded: Loaded, what: str) -> None:
    """A checkpoint's e4m3 values go only into an e4m3 parameter and back: a cast either way
    would drop the scale that gives them their meaning.

    Raises:
        ValueError: one of the two is e4m3 and the other not.
    """
    if (loaded.dtype == FP8_DTYPE) != (dest.dtype == FP8_DTYPE):
        raise ValueError(f"{what}: the checkpoint holds {loaded.dtype}, the model {dest.dtype} (an FP8 checkpoint "
                         f"needs its quantization_config; a 16-bit one quantization='fp8')")


def load_unpacked(layer: nn.Module, param: nn.Parameter, loaded: Loaded, shard_id: ShardId,
                  dim: int, full: int) -> None:
    """This rank's slice along ``dim`` of an unpacked layer's full tensor (``full`` long there).

    Raises:
        ValueError: a shard id was given (the layer is not packed), or the shape is wrong.
    """
    what = type(layer).__name__
    if shard_id is not None:
        raise ValueError(f"{what} is not packed; got shard id {shard_id!r}")
    local = param.shape[dim]
    (full,) = in_blocks(layer, param, full)
    load_slice(param.data, loaded, dim, layer.tp_rank * local, full, what)


def in_blocks(layer: nn.Module, param: nn.Parameter, *rows: int) -> tuple[int, ...]:
    """Offsets and sizes along a weight's dimension in the units of ``param``: as they are
    for the weight (or bias), in 128-blocks for the layer's block scales (an offset on a
    block edge, a size rounded up: a partial last block has a scale of its own)."""
    if param is not getattr(layer, "weight_scale_inv", None):
        return rows
    return tuple(cdiv(r, FP8_BLOCK_SIDE) for r in rows)


def default_weight_loader(param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
    """Checked plain copy of a replicated (unsharded) parameter: every rank reads it whole.

    Raises:
        ValueError: a shard id was given, or the shapes differ (checked before reading).
    """
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} is not packed; got shard id {shard_id!r}")
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"parameter: expected checkpoint shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
    check_fp8_pairing(param, loaded, "parameter")
    with torch.no_grad():
        param.data.copy_(read_whole(loaded))


def divide(size: int, tp_size: int, what: str) -> int:
    """``size // tp_size``, or ``ValueError`` naming ``what`` when it does not divide."""
    if size % tp_size:
        raise ValueError(f"{what} ({size}) is not divisible by tp_size ({tp_size})")
    return size // tp_size


def check_tp(tp_rank: int, tp_size: int) -> None:
    """Raises ValueError unless ``0 <= tp_rank < tp_size``."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}")


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: ``num_kv_heads // tp_size``, or 1 when there are fewer
    KV heads than ranks (each head then replicated on ``tp_size // num_kv_heads`` ranks).

    Raises:
        ValueError: neither of ``num_kv_heads`` and ``tp_size`` divides the other.
    """
    if num_kv_heads >= tp_size:
        return divide(num_kv_heads, tp_size, "num_kv_heads")
    if num_kv_heads < 1 or tp_size % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) and tp_size ({tp_size}): "
                         "neither divides the other")
    return 1


def check_tp_divisibility(model_config: ModelConfig, tp_size: int) -> None:
    """Raises ValueError unless ``model_config`` can be split over ``tp_size`` ranks.

    Call it before starting any process; the layers check the same rules (through
    the same functions) when they are built. Requires:

    - ``num_attention_heads % tp_size == 0`` (query heads and o_proj's input);
    - ``num_key_value_heads % tp_size == 0`` or ``tp_size % num_key_value_heads == 0``
      (fewer KV heads than ranks: each is replicated);
    - ``intermediate_size % tp_size == 0`` (gate/up and down_proj), and
      ``moe_intermediate_size % tp_size == 0`` (every expert's, split the same way);
    - with an FP8 checkpoint (128 x 128 block scales), each rank's query rows, key/value
      rows and intermediate sizes a multiple of 128, so no scale block spans two parts;
    - a hybrid model's ``linear_num_key_heads`` and ``linear_num_value_heads`` each
      divisible by ``tp_size`` (``ModelConfig.linear_heads_per_rank``: the DeltaNet shards by
      heads, each rank the value heads of its own q/k heads), and
      ``shared_expert_intermediate_size`` (split as the dense MLP's).

    Nothing of the vocabulary: ``VocabParallelEmbedding`` gives every rank
    ``ceil(vocab / tp_size)`` rows and zero-pads the last shard(s), and the LM head
    drops the padding after its all-gather, so any vocab size works.
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    c = model_config
    if c.is_hybrid:
        c.linear_heads_per_rank(tp_size)
    heads = divide(c.num_attention_heads, tp_size, "num_attention_heads")
    kv_heads = kv_heads_per_rank(c.num_key_value_heads, tp_size)
    parts = {"query heads": heads * c.head_dim, "key/value heads": kv_heads * c.head_dim,
             "intermediate_size": divide(c.intermediate_size, tp_size, "intermediate_size")}
    if c.num_experts:
        parts["moe_intermediate_size"] = divide(c.moe_intermediate_size, tp_size, "moe_intermediate_size")
    if c.shared_expert_intermediate_size:
        parts["shared_expert_intermediate_size"] = divide(c.shared_expert_intermediate_size, tp_size,
                                                          "shared_expert_intermediate_size")
    if c.quantization is not None:  # block scales: every packed part of a rank on a 128 edge
        bad = {name: rows for name, rows in parts.items() if rows % FP8_BLOCK_SIDE}
        if bad:
            raise ValueError(f"an FP8 block-scaled checkpoint needs every rank's part to be a multiple of "
                             f"{FP8_BLOCK_SIDE} rows; at tp_size {tp_size} a rank holds {bad}")


def check_narrow(name: str, shape: torch.Size, dim: int, start: int, length: int) -> None:
    """Raise ``ValueError`` unless ``[start, start + length)`` along ``dim`` lies inside ``shape``
    (a checkpoint tensor's slice, checked before it is read)."""
    if not 0 <= dim < len(shape) or start < 0 or length < 0 or start + length > shape[dim]:
        raise ValueError(f"{name}: cannot narrow shape {tuple(shape)} "
                         f"to [{start}, {start + length}) along dim {dim}")
