"""The Gated DeltaNet layer (Qwen3.5's and Qwen3-Next's linear attention): its weights, its forward over the
step's state slots (``ops/metadata.py: StateMetadata``), and the state tensors' allocation.

Per token, with the checkpoint's names (every op through ``Ops``)::

    [qkv | z | b | a] = in_proj(h)           in_proj_qkv, in_proj_z, in_proj_b, in_proj_a packed
    qkv = silu(causal depthwise conv1d(qkv))  K taps, the last K - 1 inputs kept in the conv state
    q, k (Hk heads of K), v (H heads of V) = split(qkv)
    g = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b)
    o = gated delta rule(l2norm(q), l2norm(k), v, g, beta)   state (H, K, V) per slot, float32
    out = out_proj(rms_norm(o) * weight * silu(z))           per value head

Tensor parallelism shards by heads: each of N ranks holds ``Hk / N`` q/k heads and the
``H / N`` value heads that read them, so the conv, the gating and the delta rule run on the
rank's heads alone and only ``out_proj`` (row-parallel) leaves a partial sum. The checkpoint's
``in_proj_qkv`` rows and conv channels are q (all heads), k (all), v (all), so a rank's part
of either is three slices (``qkv_segments``)::

    checkpoint rows   [ q0 q1 | k0 k1 | v0 v1 v2 v3 ]          (Hk = 2, H = 4)
    rank 0 (N = 2)    [ q0 | k0 | v0 v1 ]    rank 1: [ q1 | k1 | v2 v3 ]

z, b, a, ``A_log`` and ``dt_bias`` split by value head; the norm weight (one head's) is
replicated; the state tensors hold the rank's heads (``ModelConfig.conv_state_shape``).

Qwen3-Next's checkpoints fuse the four projections into two whose rows go by q/k head, each
head's q, k, its ``r = H / Hk`` value heads' v and z (and b, a) together::

    in_proj_qkvz rows  [ q0 k0 v0 v1 z0 z1 | q1 k1 v2 v3 z2 z3 ]      (Hk = 2, H = 4, r = 2)
    in_proj_ba rows    [ b0 b1 a0 a1 | b2 b3 a2 a3 ]

``fused_in_proj_rows`` says where Qwen3.5's four parts lie in them, so the loader reads each
part as a tensor of its own (``layers/weights.py: RowRuns``) and the layer, its sharding by
heads included, is the one above. The conv's channels are q, k, v in both checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.layers.linear import LinearBase, RowParallelLinear
from minivllm.layers.norm import RMSNorm
from minivllm.layers.weights import Loaded, ShardId, check_tp, load_segments, set_weight_loader
from minivllm.ops.dispatch import Ops
from minivllm.ops.metadata import AttentionMetadata


def allocate_linear_state(config: ModelConfig, num_slots: int, dtype: torch.dtype,
                          device: torch.device | str, tp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed ``(conv_state, recurrent_state)`` of ``num_slots`` slots for every linear-attention
    layer, one rank's heads of ``tp_size``: ``ModelConfig.conv_state_shape`` in ``dtype`` (the
    model's) and ``recurrent_state_shape`` in float32 (the recurrence accumulates over the whole
    sequence)."""
    conv = torch.zeros(config.conv_state_shape(num_slots, tp_size), dtype=dtype, device=device)
    recurrent = torch.zeros(config.recurrent_state_shape(num_slots, tp_size), dtype=torch.float32, device=device)
    return conv, recurrent


Segment = tuple[int, int, int]  # (offset in the rank's rows, start in the checkpoint's rows, rows)


def qkv_segments(config: ModelConfig, tp_rank: int, tp_size: int) -> tuple[Segment, ...]:
    """Where rank ``tp_rank``'s q, k and v rows (of ``in_proj_qkv``, or channels of the conv)
    come from: its slice of each of the checkpoint's three parts, packed in that order.

    Raises:
        ValueError: the DeltaNet heads do not split over ``tp_size``.
    """
    key_heads, value_heads = config.linear_heads_per_rank(tp_size)
    key, value = key_heads * config.linear_key_head_dim, value_heads * config.linear_value_head_dim
    full_key = config.linear_num_key_heads * config.linear_key_head_dim
    return ((0, tp_rank * key, key), (key, full_key + tp_rank * key, key),
            (2 * key, 2 * full_key + tp_rank * value, value))


Run = tuple[int, int]  # (first row in a fused checkpoint tensor, rows)


@dataclass(frozen=True)
class FusedRows:
    """A fused checkpoint tensor's layout: its rows, and for each part it fuses (by the name
    of Qwen3.5's separate tensor), that part's runs of rows in it, in the part's order."""

    rows: int
    parts: tuple[tuple[str, tuple[Run, ...]], ...]


def fused_in_proj_rows(config: ModelConfig) -> dict[str, FusedRows]:
    """Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba`` (by name) -> their layouts (module doc):
    ``in_proj_qkv`` is every head's q, then every head's k, then every head's v rows."""
    heads, dk, dv = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    r = config.linear_num_value_heads // heads
    qkvz, ba = 2 * dk + 2 * r * dv, 2 * r  # one q/k head's rows in each

    def each_head(offset: int, rows: int, group: int) -> tuple[Run, ...]:
        return tuple((h * group + offset, rows) for h in range(heads))

    qkv = each_head(0, dk, qkvz) + each_head(dk, dk, qkvz) + each_head(2 * dk, r * dv, qkvz)
    return {"in_proj_qkvz": FusedRows(heads * qkvz, (("in_proj_qkv", qkv),
                                                     ("in_proj_z", each_head(2 * dk + r * dv, r * dv, qkvz)))),
            "in_proj_ba": FusedRows(heads * ba, (("in_proj_b", each_head(0, r, ba)),
                                                 ("in_proj_a", each_head(r, r, ba))))}


def _vector(size: int, fill: float, tp_rank: int, tp_size: int) -> nn.Parameter:
    """A (size / tp_size,) per-value-head parameter, rank ``tp_rank``'s slice of the checkpoint's
    (size,) vector; ``fill`` its dummy value."""
    local = size // tp_size
    param = nn.Parameter(torch.empty(local), requires_grad=False)
    param.fill_value = fill  # type: ignore[attr-defined]

    def load(p: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        if shard_id is not None:
            raise ValueError(f"a per-head vector is not packed; got shard id {shard_id!r}")
        load_segments(p.data, loaded, 0, size, [(0, tp_rank * local, local)], "per-head vector")

    return set_weight_loader(param, load)


class DepthwiseConv(nn.Module):
    """The conv's filters, (channels, 1, K) as checkpoints store them (``conv1d.weight``); on
    a rank, its q, k and v channels (``qkv_segments``)."""

    def __init__(self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.segments = qkv_segments(config, tp_rank, tp_size)
        channels = sum(rows for _, _, rows in self.segments)
        self.full_channels = config.linear_conv_dim
        self.weight = nn.Parameter(torch.empty(channels, 1, config.linear_conv_kernel_dim), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        """Copy this rank's q, k and v channels of the full (conv_dim, 1, K) filters.

        Raises:
            ValueError: a shard id was given, or the checkpoint shape is wrong.
        """
        if shard_id is not None:
            raise ValueError(f"DepthwiseConv is not packed; got shard id {shard_id!r}")
        load_segments(param.data, loaded, 0, self.full_channels, self.segments, "DepthwiseConv")


class DeltaNetInProj(LinearBase):
    """The DeltaNet's four input projections in one column-parallel matmul, rank ``tp_rank``'s
    rows packed as ``[q | k | v | z | b | a]`` of its heads (module doc). Shard ids: 0
    ``in_proj_qkv`` (three slices, ``qkv_segments``), 1 ``in_proj_z``, 2 ``in_proj_b``, 3
    ``in_proj_a`` (each this rank's value heads' rows).

    Attributes:
        local_sizes: the rank's (qkv, z, b, a) rows, the split of the matmul's output.

    Raises:
        ValueError: the DeltaNet heads do not split over ``tp_size``.
    """

    def __init__(self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        check_tp(tp_rank, tp_size)
        qkv = qkv_segments(config, tp_rank, tp_size)
        _, heads = config.linear_heads_per_rank(tp_size)
        z = heads * config.linear_value_head_dim
        local_sizes = (sum(rows for _, _, rows in qkv), z, heads, heads)
        super().__init__(config.hidden_size, sum(local_sizes), False, tp_rank, tp_size)
        self.local_sizes = local_sizes
        value_rows = config.linear_num_value_heads * config.linear_value_head_dim
        # shard id -> (checkpoint rows, segments of the rank's rows within the packed weight)
        base = [sum(self.local_sizes[:i]) for i in range(4)]
        self._layout: dict[int, tuple[int, tuple[Segment, ...]]] = {
            0: (config.linear_conv_dim, qkv),
            1: (value_rows, ((base[1], tp_rank * z, z),)),
            2: (config.linear_num_value_heads, ((base[2], tp_rank * heads, heads),)),
            3: (config.linear_num_value_heads, ((base[3], tp_rank * heads, heads),)),
        }
        set_weight_loader(self.weight, self.weight_loader, (0, 1, 2, 3))

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        """Copy this rank's rows of part ``shard_id`` into their places in the packed weight.

        Raises:
            ValueError: an unknown shard id, or the checkpoint shape is wrong.
        """
        if shard_id not in self._layout:
            raise ValueError(f"DeltaNetInProj: shard id must be in 0..3, got {shard_id!r}")
        full, segments = self._layout[shard_id]  # type: ignore[index]
        load_segments(param.data, loaded, 0, full, segments, f"DeltaNetInProj shard {shard_id}")


class GatedDeltaNet(nn.Module):
    """One linear-attention layer's weights and forward (module doc).

    Args:
        config: a hybrid model's shapes.
        layer_idx: the decoder layer; its index among the linear-attention layers picks its
            row of the state tensors (``ModelConfig.kind_index``).
        tp_rank, tp_size: this rank of the ranks the heads are split over (module doc).

    Raises:
        ValueError: the DeltaNet heads do not split over ``tp_size``.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.num_k_heads, self.num_v_heads = config.linear_heads_per_rank(tp_size)  # this rank's
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.state_index = config.kind_index(layer_idx)
        key_dim, value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.split_sizes = (key_dim, key_dim, value_dim)
        self.in_proj = DeltaNetInProj(config, tp_rank, tp_size)
        self.conv1d = DepthwiseConv(config, tp_rank, tp_size)
        self.A_log = _vector(config.linear_num_value_heads, 0.0, tp_rank, tp_size)
        self.dt_bias = _vector(config.linear_num_value_heads, 1.0, tp_rank, tp_size)
        self.norm = RMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(config.linear_num_value_heads * self.head_v_dim, config.hidden_size,
                                          tp_rank=tp_rank, tp_size=tp_size)

    def forward(self, ops: Ops, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """(T, hidden) normed input -> (T, hidden) this rank's partial sum of out_proj; the
        step's sequences' state slots read and updated in place.

        Raises:
            ValueError: the metadata carries no state.
        """
        proj = self.in_proj
        return self.forward_projected(ops, ops.project(h, proj.weight, scale=proj.weight_scale), meta)

    def forward_projected(self, ops: Ops, projected: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """:meth:`forward` from its input projection ``projected`` (T, rows of ``in_proj``; the
        decoder layer fuses its norm into it).

        Raises:
            ValueError: the metadata carries no state.
        """
        state = meta.state
        if state is None:
            raise ValueError("a linear-attention layer needs AttentionMetadata.state (the state slots)")
        t = projected.shape[0]
        out = self.out_proj
        qkv, z, b, a = projected.split(self.in_proj.local_sizes, dim=-1)
        qkv = ops.causal_conv1d(qkv, self.conv1d.weight[:, 0], state.conv_state[self.state_index],
                                meta.cu_seqlens_q, state)                                      # (T, conv_dim)
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        g, beta = ops.gdn_gating(a, b, self.A_log, self.dt_bias)                               # (T, H) each
        o = ops.gated_delta_rule(q.reshape(t, self.num_k_heads, self.head_k_dim),
                                 k.reshape(t, self.num_k_heads, self.head_k_dim),
                                 v.reshape(t, self.num_v_heads, self.head_v_dim), g, beta,
                                 state.recurrent_state[self.state_index], meta.cu_seqlens_q, state,
                                 decode=meta.is_decode)                                        # (T, H, V)
        o = ops.rms_norm_gated(o, z.reshape(o.shape), self.norm.weight, self.norm.eps).reshape(t, -1)
        return ops.project(o, out.weight, out.partial_bias, out=ops.partial_out(o, out.weight),
                           scale=out.weight_scale)
