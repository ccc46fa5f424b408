"""The Gated DeltaNet layer (Qwen3.5's linear attention): its weights, its forward over the
step's state slots (``ops/metadata.py: StateMetadata``), and the state tensors' allocation.

Per token, with the checkpoint's names (every op through ``Ops``)::

    [qkv | z | b | a] = in_proj(h)           in_proj_qkv, in_proj_z, in_proj_b, in_proj_a packed
    qkv = silu(causal depthwise conv1d(qkv))  K taps, the last K - 1 inputs kept in the conv state
    q, k (Hk heads of K), v (H heads of V) = split(qkv)
    g = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b)
    o = gated delta rule(l2norm(q), l2norm(k), v, g, beta)   state (H, K, V) per slot, float32
    out = out_proj(rms_norm(o) * weight * silu(z))           per value head

Tensor parallelism is not served yet (the model refuses tp_size > 1): the projections are the
parallel linear classes so that it can follow, but the packed ``in_proj`` would need its qkv
part split by q, k and v heads (not contiguously), and the conv channels with it.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from minivllm.layers.norm import RMSNorm
from minivllm.layers.weights import default_weight_loader, set_weight_loader
from minivllm.ops.dispatch import Ops
from minivllm.ops.metadata import AttentionMetadata


def allocate_linear_state(config: ModelConfig, num_slots: int, dtype: torch.dtype,
                          device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed ``(conv_state, recurrent_state)`` of ``num_slots`` slots for every linear-attention
    layer: ``ModelConfig.conv_state_shape`` in ``dtype`` (the model's) and
    ``recurrent_state_shape`` in float32 (the recurrence accumulates over the whole sequence)."""
    conv = torch.zeros(config.conv_state_shape(num_slots), dtype=dtype, device=device)
    recurrent = torch.zeros(config.recurrent_state_shape(num_slots), dtype=torch.float32, device=device)
    return conv, recurrent


def _vector(size: int, fill: float) -> nn.Parameter:
    """A replicated (size,) parameter loaded whole; ``fill`` its dummy value."""
    param = nn.Parameter(torch.empty(size), requires_grad=False)
    param.fill_value = fill  # type: ignore[attr-defined]
    return set_weight_loader(param, default_weight_loader)


class DepthwiseConv(nn.Module):
    """The conv's filters, (channels, 1, K) as checkpoints store them (``conv1d.weight``)."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer's weights and forward (module doc).

    Args:
        config: a hybrid model's shapes.
        layer_idx: the decoder layer; its index among the linear-attention layers picks its
            row of the state tensors (``ModelConfig.kind_index``).
    """

    def __init__(self, config: ModelConfig, layer_idx: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.state_index = config.kind_index(layer_idx)
        key_dim, value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.split_sizes = (key_dim, key_dim, value_dim)
        self.in_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.linear_conv_dim, value_dim, self.num_v_heads, self.num_v_heads],
            tp_rank=tp_rank, tp_size=tp_size)
        self.conv1d = DepthwiseConv(config.linear_conv_dim, config.linear_conv_kernel_dim)
        self.A_log = _vector(self.num_v_heads, 0.0)
        self.dt_bias = _vector(self.num_v_heads, 1.0)
        self.norm = RMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_dim, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size)

    def forward(self, ops: Ops, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """(T, hidden) normed input -> (T, hidden) this rank's partial sum of out_proj; the
        step's sequences' state slots read and updated in place.

        Raises:
            ValueError: the metadata carries no state.
        """
        state = meta.state
        if state is None:
            raise ValueError("a linear-attention layer needs AttentionMetadata.state (the state slots)")
        t = h.shape[0]
        proj, out = self.in_proj, self.out_proj
        qkv, z, b, a = ops.linear(h, proj.weight, scale=proj.weight_scale).split(proj.local_sizes, dim=-1)
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
        return ops.linear(o, out.weight, out.partial_bias, out=ops.partial_out(o, out.weight), scale=out.weight_scale)
