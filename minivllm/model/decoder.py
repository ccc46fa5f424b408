"""The decoder that Qwen3, Qwen2/2.5 and Llama-3.x share, over a paged KV cache, tensor-parallel ready.

Token-major throughout: a step's tokens from all sequences are concatenated
into one (T, ...) batch; the attention metadata says which sequence each
belongs to. Per layer::

    h, res = input_layernorm(h, res)            # fused residual add
    qkv = qkv_proj(h)                           # (T, (H + 2 Hkv) D) one matmul (+ bias: Qwen2);
                                                # at batch 1 one kernel with the norm (RMSNorm.into)
    q, k = q_norm(q), k_norm(k)                 # RMSNorm per head, before RoPE (Qwen3 only)
    q, k = rope(positions, q, k)                # llama3 frequency scaling lives in the table
    o = attn(q, k, v)                           # writes K/V to the paged cache
    h = o_proj(o)
    h, res = post_attention_layernorm(h, res)   # (into gate_up_proj, as above)
    h = down_proj(silu(gate) * up)              # gate_up_proj packed

Positions come from the caller (the plan), never from cu_seqlens, so chunked
prefill and prefix hits need no special case here.

Why one parameterised decoder and not a layer class per family: the three
families differ in three booleans of the attention block (``AttentionSpec``:
per-head q/k norm, bias on q/k/v, bias on o_proj) and in nothing else of the
layer, MLP, model, head, weight names or tensor-parallel sharding (RoPE scaling
and the tied head come from the checkpoint's config, whatever the family). A
subclass per family would copy the attention forward, with its fused/unfused
CUDA branch, three times for three flags; here it exists once, and each family
module states its differences in one ``attention_spec`` next to its name, the
way Hugging Face's modeling files hard-code them.

Where the backend fuses (CUDA), every family takes the one q/k-norm + RoPE +
K/V-store kernel (``minivllm/kernels/qk_norm_rope_store.py``); a block without
q/k norm passes no norm weights and the kernel skips the norm. Elsewhere the
block runs the norm (if any) and RoPE as torch code, then the backend's K/V store.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Mapping

import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.layers import all_reduce
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.attention import Attention, AttentionBackend, AttentionMetadata, TorchAttentionBackend
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.fuse import fused
from minivllm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    ShardId,
)
from minivllm.layers.norm import RMSNorm, rms_norm_ref
from minivllm.layers.rotary import RotaryEmbedding, rope_ref

# Checkpoint module name -> (our packed module, shard id in it); the same for every family.
PACKED_MODULES: Mapping[str, tuple[str, ShardId]] = MappingProxyType({
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
})


@dataclass(frozen=True)
class AttentionSpec:
    """What differs between the families' attention blocks.

    Attributes:
        qk_norm: per-head RMSNorm of q and k before RoPE (``q_norm``/``k_norm`` weights).
        qkv_bias: the q, k and v projections add a bias (sharded by heads like the weights).
        o_proj_bias: the output projection adds a (replicated) bias.
    """

    qk_norm: bool
    qkv_bias: bool
    o_proj_bias: bool


@fused
def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q (T, H, D) and k (T, Hkv, D), then RoPE; v made dense.

    One function so that on CUDA it compiles into a couple of kernels instead of ~20.
    """
    q, k = rope_ref(positions, rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps),
                    cos_sin_cache)
    return q, k, v.contiguous()  # kernels want dense rows


@fused
def rope_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
             cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE of q (T, H, D) and k (T, Hkv, D); v made dense (``qk_norm_rope`` without the norms)."""
    q, k = rope_ref(positions, q, k, cos_sin_cache)
    return q, k, v.contiguous()


class DecoderAttention(nn.Module):
    """Self-attention block: packed QKV, optional per-head q/k norm, RoPE, paged attention,
    output projection."""

    def __init__(self, config: ModelConfig, spec: AttentionSpec, layer_idx: int, rotary: RotaryEmbedding,
                 backend: AttentionBackend, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, d, config.num_attention_heads, config.num_key_value_heads,
            bias=spec.qkv_bias, tp_rank=tp_rank, tp_size=tp_size)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * d, config.hidden_size,
            bias=spec.o_proj_bias, tp_rank=tp_rank, tp_size=tp_size, reduce_in_next_norm=True)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if spec.qk_norm else None
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, layer_idx, backend)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The block after its QKV projection, which the layer runs together with the norm before
        it (``RMSNorm.into``): (T,) positions, (T, (H + 2 Hkv) D) -> (T, hidden)."""
        t, d = qkv.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        self.rotary_emb.check_positions(positions)
        backend = self.attn.backend
        if backend.fuses_qk_norm_rope(qkv.device):
            # One kernel: [q/k norm +] RoPE, k and v written to the cache; only q comes back.
            # (q_norm and k_norm share config.rms_norm_eps.)
            q_w, k_w, eps = ((self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
                             if self.q_norm is not None and self.k_norm is not None else (None, None, 0.0))
            q = backend.qk_norm_rope_store(qkv, positions, q_w, k_w, eps, self.rotary_emb.cos_sin_cache,
                                           *self.attn.kv_caches(meta), meta.slot_mapping)
            o = self.attn.attend(q, meta)                      # (T, H, D)
            return self.o_proj(o.reshape(t, q_size))
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, d)
        k, v = k.reshape(t, self.num_kv_heads, d), v.reshape(t, self.num_kv_heads, d)
        cos_sin = self.rotary_emb.cos_sin_cache
        if self.q_norm is not None:
            q, k, v = qk_norm_rope(q, k, v, positions, self.q_norm.weight, self.k_norm.weight,
                                   self.q_norm.eps, cos_sin)
        else:
            q, k, v = rope_qkv(q, k, v, positions, cos_sin)
        o = self.attn(q, k, v, meta)                           # (T, H, D)
        return self.o_proj(o.reshape(t, q_size))


class DecoderMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up packed in one matmul."""

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        i = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [i, i], tp_rank=tp_rank, tp_size=tp_size)
        self.down_proj = RowParallelLinear(i, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size,
                                           reduce_in_next_norm=True)
        self.act_fn = SiluAndMul()

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (T, 2 intermediate) -> (T, hidden)
        """The block after its gate/up projection, which the layer runs together with the norm
        before it (``RMSNorm.into``)."""
        if self.down_proj.takes_gated(h):  # few rows on the GEMV kernel: it applies SiLU-and-mul itself
            return self.down_proj(h, gated=True)
        return self.down_proj(self.act_fn(h))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP, residual adds fused into the following norm."""

    def __init__(self, config: ModelConfig, spec: AttentionSpec, layer_idx: int, rotary: RotaryEmbedding,
                 backend: AttentionBackend, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, spec, layer_idx, rotary, backend, tp_rank, tp_size)
        self.mlp = DecoderMLP(config, tp_rank, tp_size)
        # o_proj and down_proj may leave their all-reduce to the norm after them (the
        # previous layer's down_proj to input_layernorm, the last one's to the final norm).
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, reduces_input=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, reduces_input=True)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp output, residual stream before it)``, both (T, hidden); the
        next layer's input norm adds them."""
        # Each norm goes into the projection after it (one kernel at batch 1: RMSNorm.into).
        qkv, residual = self.input_layernorm.into(self.self_attn.qkv_proj, hidden, residual)
        hidden = self.self_attn(positions, qkv, meta)
        gate_up, residual = self.post_attention_layernorm.into(self.mlp.gate_up_proj, hidden, residual)
        return self.mlp(gate_up), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (``model.*`` in HF checkpoints)."""

    def __init__(self, config: ModelConfig, spec: AttentionSpec, backend: AttentionBackend,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size)
        # One cos/sin table shared by every layer.
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                 config.rope_scaling)
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec, i, rotary, backend, tp_rank, tp_size)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, reduces_input=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """(T,) token ids and positions -> (T, hidden) final hidden states."""
        all_reduce.check_forward_start()
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """A decoder with its LM head; logits only for the rows the caller asks for.

    A family subclasses it, naming its ``architecture`` and stating its
    ``attention_spec``; ``minivllm.model.registry`` picks the subclass.

    Args:
        config: the model's shapes; its ``architecture`` must be the class's.
        attention_backend: paged attention implementation (default: torch reference).
        tp_rank: this process's tensor-parallel rank.
        tp_size: number of tensor-parallel ranks.

    Attributes:
        architecture: ``architectures[0]`` of the checkpoints this class loads.
        packed_modules_mapping: checkpoint module name -> (packed module, shard id),
            read by the loader.
        tie_word_embeddings: the LM head is the embedding (no ``lm_head.weight``
            parameter of its own).

    Raises:
        ValueError: ``config.architecture`` is another class's.
    """

    architecture: ClassVar[str]
    packed_modules_mapping: Mapping[str, tuple[str, ShardId]] = PACKED_MODULES

    def __init__(self, config: ModelConfig, *, attention_backend: AttentionBackend | None = None,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        if config.architecture != self.architecture:
            raise ValueError(f"{type(self).__name__} loads {self.architecture} checkpoints, "
                             f"got a {config.architecture} config")
        self.config = config
        self.tie_word_embeddings = config.tie_word_embeddings
        backend = attention_backend if attention_backend is not None else TorchAttentionBackend()
        self.model = DecoderModel(config, self.attention_spec(config), backend, tp_rank, tp_size)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def attention_spec(cls, config: ModelConfig) -> AttentionSpec:
        """What this family's attention block has (each family states it)."""
        raise NotImplementedError(f"{cls.__name__} states no attention_spec")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """(T,) token ids, (T,) positions -> (T, hidden) hidden states (no logits)."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_rows: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """(S, hidden) rows that sample -> (S, vocab) logits; ``gather=False`` under tensor
        parallelism: this rank's vocab columns only (``ParallelLMHead.forward``)."""
        return self.lm_head(hidden_rows, gather)
