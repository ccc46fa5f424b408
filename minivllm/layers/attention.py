"""Paged attention: the per-step metadata, the backends, and the ``Attention`` module.

No global forward context: the executor builds one frozen ``AttentionMetadata``
per step and the model passes it down to every layer. The KV cache is one
tensor for all layers (see ``ModelExecutor``)::

    kv_cache  (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
              [layer, 0] = K cache of that layer, [layer, 1] = V cache

and each ``Attention`` picks its own layer's slices by index, so nothing is
bound into the modules after construction.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from minivllm.kernels.reference import paged_attention_reference, store_kv_reference

FUSE_QK_NORM_ROPE_ENV = "MINIVLLM_FUSE_QK_NORM_ROPE"  # "0" / "1": the attention layer's default (below)
BackendName = Literal["torch", "triton"]
BACKENDS: tuple[str, ...] = ("torch", "triton")


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one step, on the model's device.

    B sequences feed T tokens (shapes as in ``minivllm/executor/inputs.py``).
    """

    # int64 (T,): cache slot of each fed token (-1 = write nothing).
    slot_mapping: torch.Tensor
    # int32 (B+1,): prefix sums of the tokens fed per sequence.
    cu_seqlens_q: torch.Tensor
    # int32 (B,): keys each sequence attends to (cached + fed).
    kv_lens: torch.Tensor
    # int32 (B, W): block ids per sequence, -1 padded.
    block_tables: torch.Tensor
    # Most tokens fed by one sequence (a host int: kernels size their grid by it).
    max_q_len: int
    # Every sequence feeds exactly one token (T == B): the decode kernel applies.
    is_decode: bool
    # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim): all layers' K/V.
    kv_cache: torch.Tensor
    # int32 (capacity, 2): the prefill kernel's work list (its map mode: a grid that does not
    # depend on the batch, for CUDA graphs of prefill steps); None: the grid from max_q_len.
    tile_map: torch.Tensor | None = None


class AttentionBackend(ABC):
    """How K/V are written to and attention is read from one layer's paged cache."""

    @abstractmethod
    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write ``key``/``value`` (T, Hkv, D) at ``slot_mapping`` (T,) into the caches."""

    @abstractmethod
    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of ``q`` (T, H, D) over each sequence's paged context -> (T, H, D)."""

    @abstractmethod
    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention of one query per sequence ``q`` (B, H, D) -> (B, H, D)."""

    def fuses_qk_norm_rope(self, device: torch.device) -> bool:
        """Whether :meth:`qk_norm_rope_store` runs for tensors on ``device`` (default: never)."""
        return False

    def qk_norm_rope_store(self, qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor | None,
                           k_weight: torch.Tensor | None, eps: float, cos_sin_cache: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> torch.Tensor:
        """Per-head q/k RMSNorm (none when the weights are None) + RoPE of the packed ``qkv``
        (T, (H + 2 Hkv) D), K/V stored at ``slot_mapping``; returns q (T, H, D). Only where
        :meth:`fuses_qk_norm_rope`."""
        raise NotImplementedError(f"{type(self).__name__} has no fused qk_norm_rope_store")


class TorchAttentionBackend(AttentionBackend):
    """The plain-torch reference (any device; syncs the host once per layer)."""

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention_reference(q, k_cache, v_cache, meta.cu_seqlens_q, meta.kv_lens,
                                         meta.block_tables, scale)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self.prefill(q, k_cache, v_cache, meta, scale)


class TritonAttentionBackend(AttentionBackend):
    """Our Triton kernels (CUDA, or the CPU under ``TRITON_INTERPRET=1``).

    The kernel modules are imported here, not at module import, so the torch
    backend never needs Triton.

    Args:
        fuse_qk_norm_rope: run the model's q/k norm + RoPE + K/V store as one kernel
            (:mod:`minivllm.kernels.qk_norm_rope_store`). None (default): on CUDA
            only, unless ``MINIVLLM_FUSE_QK_NORM_ROPE`` is "0" (never) or "1"
            (also on the CPU interpreter). The CPU default keeps the unfused path,
            which the parity tests check against Hugging Face.
    """

    def __init__(self, fuse_qk_norm_rope: bool | None = None) -> None:
        from minivllm.kernels.decode_attention import decode_attention
        from minivllm.kernels.prefill_attention import prefill_attention
        from minivllm.kernels.qk_norm_rope_store import qk_norm_rope_store
        from minivllm.kernels.store_kv import store_kv

        self._store_kv = store_kv
        self._prefill = prefill_attention
        self._decode = decode_attention
        self._qk_norm_rope_store = qk_norm_rope_store
        if fuse_qk_norm_rope is None:
            fuse_qk_norm_rope = {"0": False, "1": True}.get(os.environ.get(FUSE_QK_NORM_ROPE_ENV, ""))
        self.fuse_qk_norm_rope = fuse_qk_norm_rope

    def fuses_qk_norm_rope(self, device: torch.device) -> bool:
        if self.fuse_qk_norm_rope is None:
            return device.type == "cuda"
        return self.fuse_qk_norm_rope

    def qk_norm_rope_store(self, qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor | None,
                           k_weight: torch.Tensor | None, eps: float, cos_sin_cache: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> torch.Tensor:
        return self._qk_norm_rope_store(qkv, positions, q_weight, k_weight, eps, cos_sin_cache,
                                        k_cache, v_cache, slot_mapping)

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self._store_kv(key, value, k_cache, v_cache, slot_mapping)

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self._prefill(q, k_cache, v_cache, meta.cu_seqlens_q, meta.kv_lens,
                             meta.block_tables, scale, meta.max_q_len, tile_map=meta.tile_map)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self._decode(q, k_cache, v_cache, meta.kv_lens, meta.block_tables, scale)


def make_attention_backend(name: str) -> AttentionBackend:
    """The backend called ``name`` ("torch" or "triton").

    Raises:
        ValueError: an unknown name.
        ImportError: "triton" when the kernels cannot be imported.
    """
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")


class Attention(nn.Module):
    """Stores the new tokens' K/V in this layer's cache, then attends over it
    (``attend`` alone when a fused kernel has stored them already).

    Args:
        num_heads: query heads (on this rank).
        num_kv_heads: KV heads (on this rank).
        head_dim: D.
        layer_idx: which ``kv_cache[layer_idx]`` this layer owns.
        backend: the attention implementation (shared by all layers).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 backend: AttentionBackend) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.scale = head_dim ** -0.5
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """``q`` (T, H, D), ``k``/``v`` (T, Hkv, D) of the fed tokens -> (T, H, D)."""
        self.backend.store_kv(k, v, *self.kv_caches(meta), meta.slot_mapping)
        return self.attend(q, meta)

    def kv_caches(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V caches, each (N, bs, Hkv, D) (views of ``meta.kv_cache``)."""
        return meta.kv_cache[self.layer_idx, 0], meta.kv_cache[self.layer_idx, 1]

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of ``q`` (T, H, D) over the cache, whose K/V already hold the fed
        tokens (stored by ``forward`` or by a fused kernel) -> (T, H, D)."""
        k_cache, v_cache = self.kv_caches(meta)
        if meta.is_decode:
            return self.backend.decode(q, k_cache, v_cache, meta, self.scale)
        return self.backend.prefill(q, k_cache, v_cache, meta, self.scale)

    def extra_repr(self) -> str:
        return (f"layer_idx={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, backend={type(self.backend).__name__}")
