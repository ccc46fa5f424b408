"""Qwen3.5 (dense and MoE): a hybrid decoder of Gated DeltaNet layers (linear attention,
``layers/linear_attention.py``) and gated full-attention layers, as ``layer_types`` orders them
(three DeltaNet layers to one attention layer in the released models).

What differs from the shared decoder (``decoder.py``), so the layers are this module's own:

- every RMSNorm but the DeltaNet's output norm is zero-centred, ``(1 + w) * norm(x)``
  (``RMSNorm1p``), the q/k norms included;
- q_proj yields, per head, the query and a gate of the same size; the attention output is
  scaled by ``sigmoid(gate)`` before o_proj (``attn_output_gate``);
- RoPE turns only the first ``partial_rotary_factor`` share of each head (rotate-half layout);
  the checkpoints' multimodal RoPE gives a text token one position in all its sections,
  which is plain RoPE of that position;
- MoE layers add a shared expert scaled per token by ``sigmoid(shared_expert_gate(x))``, and
  always renormalise the top-k routing weights.

Full-attention layers use the paged KV cache (its row: the layer's index among them,
``ModelConfig.kind_index``); DeltaNet layers the state slots of ``AttentionMetadata.state``.
The vision-language checkpoints (``*ForConditionalGeneration``) keep the text model under
``model.language_model.``; their vision tower is skipped, and every checkpoint's MTP head unless
the model has one attached (``model/qwen3_5_mtp.py``). Qwen3-Next is this model read from
checkpoints that fuse the DeltaNet's projections (``model/qwen3_next.py``).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Iterator, Mapping

import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.layers.attention import Attention, kv_cache_scale
from minivllm.layers.embedding import VocabParallelEmbedding
from minivllm.layers.linear import QKVParallelLinear, RowParallelLinear
from minivllm.layers.linear_attention import GatedDeltaNet
from minivllm.layers.moe import SparseMoeBlock
from minivllm.layers.norm import RMSNorm1p
from minivllm.layers.rotary import RotaryEmbedding
from minivllm.layers.weights import Loaded, ShardId, check_tp_divisibility
from minivllm.model.decoder import PACKED_MODULES, AttentionSpec, DecoderForCausalLM, DecoderMLP
from minivllm.ops.dispatch import Ops
from minivllm.ops.metadata import AttentionMetadata

# The shared decoder's packing, and the DeltaNet's four input projections in one matmul.
QWEN3_5_PACKED_MODULES: Mapping[str, tuple[str, ShardId]] = MappingProxyType({
    **PACKED_MODULES,
    "in_proj_qkv": ("in_proj", 0), "in_proj_z": ("in_proj", 1), "in_proj_b": ("in_proj", 2),
    "in_proj_a": ("in_proj", 3),
})
# Checkpoint name prefixes the text model does not serve -> why (logged by the loader).
SKIPPED_PREFIXES: Mapping[str, str] = MappingProxyType({
    "model.visual.": "the vision tower (only the text model is served)",
    "mtp.": "the multi-token-prediction head (loaded for speculative_config method 'mtp')",
})
LANGUAGE_MODEL_PREFIX = "model.language_model."


class GatedAttention(nn.Module):
    """Qwen3.5's full attention: q (with its gate), k, v packed; zero-centred q/k norm; partial
    RoPE; paged attention; ``sigmoid(gate)`` on the output; o_proj.

    The gated q_proj is packed as ``2 H`` heads of ``head_dim`` rows (each head's query rows, then
    its gate rows, as the checkpoint orders them), so sharding by heads keeps pairs together.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        d, heads = config.head_dim, config.num_attention_heads
        self.gated = config.attn_output_gate
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, heads * (2 if self.gated else 1),
                                          config.num_key_value_heads, bias=config.attention_bias,
                                          tp_rank=tp_rank, tp_size=tp_size)
        self.num_heads = self.qkv_proj.num_heads // (2 if self.gated else 1)
        self.num_kv_heads, self.head_dim = self.qkv_proj.num_kv_heads, d
        self.o_proj = RowParallelLinear(heads * d, config.hidden_size, bias=config.attention_bias,
                                        tp_rank=tp_rank, tp_size=tp_size)
        self.q_norm, self.k_norm = RMSNorm1p(d, config.rms_norm_eps), RMSNorm1p(d, config.rms_norm_eps)
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, config.kind_index(layer_idx))
        self.k_scale, self.v_scale = kv_cache_scale(), kv_cache_scale()

    def forward(self, ops: Ops, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """(T,) positions, (T, hidden) normed input -> (T, hidden) this rank's partial sum of o_proj."""
        return self.forward_projected(ops, positions, self.project_qkv(ops, h), meta)

    def project_qkv(self, ops: Ops, h: torch.Tensor) -> torch.Tensor:
        """The packed q (with its gate), k, v projection of (T, hidden) normed ``h``."""
        proj = self.qkv_proj
        return ops.project(h, proj.weight, proj.bias, scale=proj.weight_scale)

    def forward_projected(self, ops: Ops, positions: torch.Tensor, qkv: torch.Tensor,
                          meta: AttentionMetadata) -> torch.Tensor:
        """:meth:`forward` from its projection ``qkv`` (:meth:`project_qkv`; the decoder layer
        fuses its norm into it)."""
        q, gate = self.store_kv_projected(ops, positions, qkv, meta)
        k_cache, v_cache = self.attn.kv_caches(meta)
        o = ops.attention(q, k_cache, v_cache, meta, self.attn.scale, self.k_scale, self.v_scale).reshape(qkv.shape[0], -1)
        if gate is not None:
            o = ops.sigmoid_mul(o, gate)
        o_proj = self.o_proj
        return ops.project(o, o_proj.weight, o_proj.partial_bias, out=ops.partial_out(o, o_proj.weight),
                           scale=o_proj.weight_scale)

    def store_kv(self, ops: Ops, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The projection, q/k norm, RoPE and K/V store of (T, hidden) normed ``h``: returns
        (T, H, D) q and the (T, H D) gate (None without ``attn_output_gate``)."""
        return self.store_kv_projected(ops, positions, self.project_qkv(ops, h), meta)

    def store_kv_projected(self, ops: Ops, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`store_kv` from its projection ``qkv``."""
        t, d, heads, kv_heads = qkv.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        q, k, v = qkv.split([qkv.shape[1] - 2 * kv_heads * d, kv_heads * d, kv_heads * d], dim=-1)
        gate = None
        if self.gated:
            q, gate = q.reshape(t, heads, 2 * d).split(d, dim=-1)   # (T, H, D) each
            gate = gate.reshape(t, heads * d)
        self.rotary_emb.check_positions(positions)
        k_cache, v_cache = self.attn.kv_caches(meta)
        q = ops.qk_norm_1p_rope_store(q.reshape(t, heads, d), k.reshape(t, kv_heads, d), v.reshape(t, kv_heads, d),
                                      positions, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                      self.rotary_emb.cos_sin_cache, k_cache, v_cache, meta.slot_mapping,
                                      self.k_scale, self.v_scale)
        return q, gate


class SharedExpertMoeBlock(SparseMoeBlock):
    """The routed experts (``SparseMoeBlock``) plus, when ``shared_expert_intermediate_size``
    is set, a dense shared expert whose output each token scales by
    ``sigmoid(shared_expert_gate(x))`` (replicated (1, hidden) weight)."""

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__(config, tp_rank, tp_size)
        size = config.shared_expert_intermediate_size
        self.shared_expert = DecoderMLP(config, tp_rank, tp_size, intermediate_size=size) if size else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if size else None
        if self.shared_expert_gate is not None:
            self.shared_expert_gate.weight.requires_grad_(False)


def dense_mlp(ops: Ops, mlp: DecoderMLP, h: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(h)) * up(h))``: (T, hidden) -> this rank's (T, hidden) partial sum."""
    up = mlp.gate_up_proj
    return mlp_down(ops, mlp, ops.project(h, up.weight, up.bias, scale=up.weight_scale))


def mlp_down(ops: Ops, mlp: DecoderMLP, gate_up: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate) * up)`` of the MLP's (T, 2 I) ``gate_up`` projection."""
    down = mlp.down_proj
    return ops.project(gate_up, down.weight, down.partial_bias, gated=True, scale=down.weight_scale)


def moe_mlp(ops: Ops, mlp: SharedExpertMoeBlock, h: torch.Tensor) -> torch.Tensor:
    """Routed experts plus the gated shared expert: (T, hidden) -> (T, hidden) partial sum."""
    out = ops.moe(h, mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.top_k,
                  mlp.norm_topk_prob, scales=mlp.experts.scales)
    if mlp.shared_expert is None or mlp.shared_expert_gate is None:
        return out
    shared = ops.sigmoid_mul(dense_mlp(ops, mlp.shared_expert, h), ops.linear(h, mlp.shared_expert_gate.weight))
    return out + shared


class Qwen3_5DecoderLayer(nn.Module):
    """Pre-norm token mixer (``linear_attn`` or ``self_attn``, as ``layer_types`` says) and MLP
    (dense or experts); returns ``(partial, residual)`` as ``DecoderLayer`` does, and each
    residual add runs inside the zero-centred norm after it."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, ops: Ops,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.ops = ops
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if config.layer_kind(layer_idx) == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, layer_idx, tp_rank, tp_size)
        else:
            self.self_attn = GatedAttention(config, layer_idx, rotary, tp_rank, tp_size)
        self.mlp: DecoderMLP | SharedExpertMoeBlock = (
            SharedExpertMoeBlock(config, tp_rank, tp_size) if config.is_sparse_layer(layer_idx)
            else DecoderMLP(config, tp_rank, tp_size))
        self.input_layernorm = RMSNorm1p(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm1p(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(T,) positions, (T, hidden) partial and residual (None: ``hidden`` is the embedding)
        -> this layer's MLP partial sum and the residual stream before it."""
        ops, norm1, norm2 = self.ops, self.input_layernorm, self.post_attention_layernorm
        # Each norm goes with the projection after it (``Ops.norm_project``: one kernel at one row).
        first = self.linear_attn.in_proj if self.linear_attn is not None else self.self_attn.qkv_proj  # type: ignore[union-attr]
        projected, residual = ops.norm_project(hidden, residual, norm1.weight, norm1.eps, first.weight, first.bias,
                                               scale=first.weight_scale, unit_offset=True)
        if self.linear_attn is not None:
            partial = self.linear_attn.forward_projected(ops, projected, meta)
        else:
            assert self.self_attn is not None
            partial = self.self_attn.forward_projected(ops, positions, projected, meta)
        if isinstance(self.mlp, SharedExpertMoeBlock):
            h, residual = ops.add_rms_norm_1p(partial, residual, norm2.weight, norm2.eps)
            return moe_mlp(ops, self.mlp, h), residual
        up = self.mlp.gate_up_proj
        gate_up, residual = ops.norm_project(partial, residual, norm2.weight, norm2.eps, up.weight, up.bias,
                                             scale=up.weight_scale, unit_offset=True)
        return mlp_down(ops, self.mlp, gate_up), residual


class Qwen3_5Model(nn.Module):
    """Embedding, hybrid layers and final zero-centred norm (``model.*``)."""

    def __init__(self, config: ModelConfig, ops: Ops, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.ops = ops
        self.hybrid = config.is_hybrid
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   tp_rank=tp_rank, tp_size=tp_size)
        # One cos/sin table of the rotated dims, shared by the attention layers.
        rotary = RotaryEmbedding(config.rotary_dim, config.max_position_embeddings, config.rope_theta)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, i, rotary, ops, tp_rank, tp_size)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm1p(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """(T,) token ids and positions -> (T, hidden) final hidden states.

        Raises:
            ValueError: a hybrid model's metadata without state slots.
        """
        if self.hybrid and meta.state is None:
            raise ValueError("a hybrid model needs AttentionMetadata.state (the sequences' state slots)")
        ops = self.ops
        ops.begin_forward()
        emb = self.embed_tokens
        hidden = ops.embed(input_ids, emb.weight, emb.vocab_start, emb.vocab_end)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        assert residual is not None
        hidden, _ = ops.add_rms_norm_1p(hidden, residual, self.norm.weight, self.norm.eps)
        return hidden


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    """Qwen3.5 dense (``Qwen3_5ForCausalLM`` checkpoints); see ``DecoderForCausalLM`` for the
    arguments. At most 16 rows (decode at small batch), every projection takes the GEMV path
    (``Ops.project``: the GEMV kernel where it takes the shape), and at one row each
    zero-centred norm runs inside the GEMV of the projection after it (``Ops.norm_project``:
    the DeltaNet's in_proj, the attention's qkv, a dense MLP's gate_up; not an expert layer's
    router), where no all-reduce is left to sum first.

    Tensor parallelism shards the DeltaNet by heads (``layers/linear_attention.py``), the gated
    attention by (query, gate) head pairs, and the MLPs and the shared expert as the shared
    decoder's; the shared expert's (1, hidden) gate is replicated.

    Raises:
        ValueError: shapes that do not split over ``tp_size`` (``check_tp_divisibility``), or
            what ``DecoderForCausalLM`` raises.
    """

    architecture = "Qwen3_5ForCausalLM"
    packed_modules_mapping = QWEN3_5_PACKED_MODULES
    skipped_prefixes: Mapping[str, str] = SKIPPED_PREFIXES

    def __init__(self, config: ModelConfig, *, ops: Ops | None = None, tp_rank: int = 0, tp_size: int = 1) -> None:
        check_tp_divisibility(config, tp_size)
        super().__init__(config, ops=ops, tp_rank=tp_rank, tp_size=tp_size)
        self.has_shared_expert = config.shared_expert_intermediate_size > 0
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # The MTP head, when ``model/qwen3_5_mtp.py: attach_mtp`` built it (its weights then load).
        self.mtp: nn.Module | None = None

    @classmethod
    def attention_spec(cls, config: ModelConfig) -> AttentionSpec:
        return AttentionSpec(qk_norm=True, qkv_bias=config.attention_bias, o_proj_bias=config.attention_bias)

    @classmethod
    def build_decoder(cls, config: ModelConfig, ops: Ops, tp_rank: int, tp_size: int) -> nn.Module:
        return Qwen3_5Model(config, ops, tp_rank, tp_size)

    def skip_reason(self, name: str) -> str | None:
        """The prefixes of ``skipped_prefixes`` (the vision tower; the MTP head unless attached);
        with ``shared_expert_intermediate_size`` 0, the shared expert's empty tensors and its
        gate (which scales nothing)."""
        for prefix, why in self.skipped_prefixes.items():
            if name.startswith(prefix) and not (prefix == "mtp." and self.mtp is not None):
                return why
        if not self.has_shared_expert and (".mlp.shared_expert." in name or ".mlp.shared_expert_gate." in name):
            return "the shared expert of shared_expert_intermediate_size 0"
        return None

    def checkpoint_parts(self, name: str, tensor: Loaded) -> Iterator[tuple[str, Loaded]]:
        """``model.language_model.X`` (the vision-language checkpoints' text model) is ``model.X``."""
        if name.startswith(LANGUAGE_MODEL_PREFIX):
            name = "model." + name[len(LANGUAGE_MODEL_PREFIX):]
        yield name, tensor


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE (``Qwen3_5MoeForCausalLM`` checkpoints): every layer's MLP is routed experts
    plus the gated shared expert."""

    architecture = "Qwen3_5MoeForCausalLM"


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The text model of a Qwen3.5 vision-language checkpoint (config under ``text_config``,
    weights under ``model.language_model.``, vision tower skipped)."""

    architecture = "Qwen3_5ForConditionalGeneration"


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForCausalLM):
    """The text model of a Qwen3.5-MoE vision-language checkpoint."""

    architecture = "Qwen3_5MoeForConditionalGeneration"
