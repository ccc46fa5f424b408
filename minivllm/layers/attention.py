"""Paged attention: the per-step metadata and the ``Attention`` module (the kernels are
chosen by ``Ops``, ``ops/dispatch.py``).

No global forward context: the executor builds one frozen ``AttentionMetadata``
per step and the model passes it down to every layer. The KV cache is one
tensor for all layers (see ``ModelExecutor``)::

    kv_cache  (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
              [layer, 0] = K cache of that layer, [layer, 1] = V cache

and each ``Attention`` picks its own layer's slices by index, so nothing is
bound into the modules after construction.

The cache holds the model's dtype, or with ``kv_cache_dtype="fp8"`` e4m3 values of K and
V quantized by the layer's per-tensor scales (``kernels/fp8.py``): ``kv_cache_scale``
parameters, 1.0 unless the checkpoint stores ``self_attn.k_scale`` / ``self_attn.v_scale``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from minivllm.config import CacheConfig
from minivllm.layers.weights import Loaded, ShardId, read_whole, set_weight_loader
from minivllm.ops.metadata import AttentionMetadata



def kv_cache_torch_dtype(cache_config: CacheConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the KV cache of a model in ``model_dtype``: e4m3 for an FP8 cache
    (``CacheConfig.fp8``), else the model's."""
    return torch.float8_e4m3fn if cache_config.fp8 else model_dtype


def kv_cache_scale() -> nn.Parameter:
    """A layer's K or V cache scale: (1,) float32, 1.0 unless the checkpoint holds one (an
    optional tensor: the loader requires no shard of it). Read only by an FP8 cache."""
    param = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
    param.fill_value = 1.0  # type: ignore[attr-defined]  # the default, for load_format="dummy"
    return set_weight_loader(param, _load_scale, shard_ids=())


def _load_scale(param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
    """A checkpoint's scale (one element, any float dtype) into ``param``.

    Raises:
        ValueError: not one element, or not a finite number > 0.
    """
    if shard_id is not None or loaded.shape.numel() != 1:
        raise ValueError(f"a KV cache scale is one number, got shape {tuple(loaded.shape)}")
    value = float(read_whole(loaded).float().reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"a KV cache scale must be a finite number > 0, got {value}")
    param.data.fill_(value)


class Attention(nn.Module):
    """One layer's view of the paged KV cache: its heads, scale and layer index.

    Args:
        num_heads: query heads (on this rank).
        num_kv_heads: KV heads (on this rank).
        head_dim: D.
        layer_idx: which ``kv_cache[layer_idx]`` this layer owns.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.scale = head_dim ** -0.5

    def kv_caches(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V caches, each (N, bs, Hkv, D) (views of ``meta.kv_cache``)."""
        return meta.kv_cache[self.layer_idx, 0], meta.kv_cache[self.layer_idx, 1]

    def extra_repr(self) -> str:
        return (f"layer_idx={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}")
