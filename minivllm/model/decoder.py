"""The decoder that Qwen3, Qwen2/2.5 and Llama-3.x share, over a paged KV cache, tensor-parallel ready.

Token-major throughout: a step's tokens from all sequences are concatenated into one
(T, ...) batch; the attention metadata says which sequence each belongs to. Every op
runs through the model's ``Ops`` (``minivllm/ops/dispatch.py``), which the executor built:
Triton kernels or torch references, the GEMV kernel, PDL, the tensor-parallel
communicator. A layer has two forwards, chosen once per model forward from the batch
shape (``Ops.few_rows``):

    DecoderLayer.forward (any batch)             DecoderLayer.forward_few_rows (<= 16 rows)
    h, res = add_rms_norm(h, res)                qkv, res = norm_gemv(h, res)       one kernel at 1 row
    qkv = linear(h)                              .
    q = qk_norm_rope_store(qkv)   [q/k norm, RoPE, K/V into the cache: one kernel]
    o = attention(q)              [decode or prefill kernel, from the metadata]
    p = o_proj(o)                 [this rank's partial sum, written where the next norm reads it]
    h, res = add_rms_norm(p, res) [sums the ranks' partials under TP]
    g = linear(h)                                g, res = norm_gemv(p, res)        one kernel at 1 row
    p = down(silu_and_mul(g))                    p = gemv(g, gated)                SiLU-and-mul inside

and the next layer's first norm (or the final norm) adds ``p`` to the residual stream.
Positions come from the caller (the plan), never from cu_seqlens, so chunked prefill and
prefix hits need no special case here.

Why one parameterised decoder and not a layer class per family: the three families
differ in three booleans of the attention block (``AttentionSpec``: per-head q/k norm,
bias on q/k/v, bias on o_proj) and in nothing else of the layer, MLP, model, head, weight
names or tensor-parallel sharding; each family module states its differences in one
``attention_spec``, the way Hugging Face's modeling files hard-code them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Iterator, Mapping

import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.layers.attention import Attention, kv_cache_scale
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.layers.moe import SparseMoeBlock
from minivllm.layers.norm import RMSNorm
from minivllm.layers.rotary import RotaryEmbedding
from minivllm.layers.weights import Loaded, ShardId
from minivllm.ops.dispatch import Ops
from minivllm.ops.metadata import AttentionMetadata

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


class DecoderAttention(nn.Module):
    """Self-attention block's weights: packed QKV, optional per-head q/k norm, RoPE table,
    this layer's KV cache, output projection."""

    def __init__(self, config: ModelConfig, spec: AttentionSpec, layer_idx: int, rotary: RotaryEmbedding,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        d = config.head_dim
        fp8 = config.quantization is not None  # the checkpoint's 128 x 128 block-scaled e4m3
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, d, config.num_attention_heads, config.num_key_value_heads,
            bias=spec.qkv_bias, tp_rank=tp_rank, tp_size=tp_size, fp8_block=fp8)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size,
                                        bias=spec.o_proj_bias, tp_rank=tp_rank, tp_size=tp_size, fp8_block=fp8)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if spec.qk_norm else None
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, layer_idx)
        self.k_scale, self.v_scale = kv_cache_scale(), kv_cache_scale()   # read by an FP8 cache only

    def attend(self, ops: Ops, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """(T,) positions, (T, (H + 2 Hkv) D) -> (T, H D): [q/k norm +] RoPE with k and v
        stored in the cache (one kernel), then attention over the cache."""
        self.rotary_emb.check_positions(positions)
        # q_norm and k_norm share config.rms_norm_eps; a block without them passes no weights.
        q_w, k_w, eps = ((self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
                         if self.q_norm is not None and self.k_norm is not None else (None, None, 0.0))
        k_cache, v_cache = self.attn.kv_caches(meta)
        q = ops.qk_norm_rope_store(qkv, positions, q_w, k_w, eps, self.rotary_emb.cos_sin_cache,
                                   k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale)  # (T, H, D)
        o = ops.attention(q, k_cache, v_cache, meta, self.attn.scale, self.k_scale, self.v_scale)
        return o.reshape(qkv.shape[0], self.num_heads * self.head_dim)


class DecoderMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``'s weights, gate and up packed in one matrix; of
    ``config.intermediate_size`` unless ``intermediate_size`` says otherwise (a shared expert)."""

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int, intermediate_size: int | None = None) -> None:
        super().__init__()
        i = config.intermediate_size if intermediate_size is None else intermediate_size
        fp8 = config.quantization is not None
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [i, i], tp_rank=tp_rank, tp_size=tp_size,
                                                       fp8_block=fp8)
        self.down_proj = RowParallelLinear(i, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size, fp8_block=fp8)


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP; each residual add runs inside the norm after it.

    Both forwards return ``(partial, residual)``: this rank's partial sum of the MLP output
    and the residual stream before it, both (T, hidden); the next norm adds them.
    """

    def __init__(self, config: ModelConfig, spec: AttentionSpec, layer_idx: int, rotary: RotaryEmbedding,
                 ops: Ops, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.ops = ops
        self.self_attn = DecoderAttention(config, spec, layer_idx, rotary, tp_rank, tp_size)
        self.mlp: DecoderMLP | SparseMoeBlock = (SparseMoeBlock(config, tp_rank, tp_size)
                                                 if config.is_sparse_layer(layer_idx)
                                                 else DecoderMLP(config, tp_rank, tp_size))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Any batch, layer by layer: norms, cuBLAS GEMMs, the SiLU-and-mul kernel."""
        ops, attn, mlp = self.ops, self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:  # the first layer: the embedding is the residual stream
            h, residual = ops.rms_norm(hidden, norm1.weight, norm1.eps), hidden
        else:
            h, residual = ops.add_rms_norm(hidden, residual, norm1.weight, norm1.eps)
        qkv_proj, o_proj = attn.qkv_proj, attn.o_proj
        o = attn.attend(ops, positions, ops.linear(h, qkv_proj.weight, qkv_proj.bias, scale=qkv_proj.weight_scale),
                        meta)
        partial = ops.linear(o, o_proj.weight, o_proj.partial_bias, out=ops.partial_out(o, o_proj.weight),
                             scale=o_proj.weight_scale)
        h, residual = ops.add_rms_norm(partial, residual, norm2.weight, norm2.eps)
        if isinstance(mlp, SparseMoeBlock):
            return self.experts(h), residual
        up, down = mlp.gate_up_proj, mlp.down_proj
        act = ops.silu_and_mul(ops.linear(h, up.weight, up.bias, scale=up.weight_scale))
        partial = ops.linear(act, down.weight, down.partial_bias, out=ops.partial_out(act, down.weight),
                             scale=down.weight_scale)
        return partial, residual

    def experts(self, h: torch.Tensor) -> torch.Tensor:
        """A sparse layer's MLP: the routed experts' partial sum of the normed ``h`` (T, hidden)."""
        mlp = self.mlp
        assert isinstance(mlp, SparseMoeBlock)
        return self.ops.moe(h, mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj,
                            mlp.top_k, mlp.norm_topk_prob, scales=mlp.experts.scales)

    def forward_few_rows(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                         meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """At most 16 rows (decode at small batch), kernel by kernel: every matmul is a GEMV
        that streams its weight once; at one row each norm runs inside the GEMV after it, and
        SiLU-and-mul inside the down projection's GEMV at any row count."""
        ops, attn, mlp = self.ops, self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        qkv_proj, o_proj = attn.qkv_proj, attn.o_proj
        qkv, residual = ops.norm_gemv(hidden, residual, norm1.weight, norm1.eps,
                                      qkv_proj.weight, qkv_proj.bias, scale=qkv_proj.weight_scale)
        o = attn.attend(ops, positions, qkv, meta)
        partial = ops.gemv(o, o_proj.weight, o_proj.partial_bias, out=ops.partial_out(o, o_proj.weight),
                           scale=o_proj.weight_scale)
        if isinstance(mlp, SparseMoeBlock):
            h, residual = ops.add_rms_norm(partial, residual, norm2.weight, norm2.eps)
            return self.experts(h), residual
        up, down = mlp.gate_up_proj, mlp.down_proj
        gate_up, residual = ops.norm_gemv(partial, residual, norm2.weight, norm2.eps, up.weight, up.bias,
                                          scale=up.weight_scale)
        partial = ops.gemv(gate_up, down.weight, down.partial_bias, gated=True,
                           out=ops.partial_out(gate_up, down.weight), scale=down.weight_scale)
        return partial, residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (``model.*`` in HF checkpoints)."""

    def __init__(self, config: ModelConfig, spec: AttentionSpec, ops: Ops, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.ops = ops
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size)
        # One cos/sin table shared by every layer.
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                 config.rope_scaling)
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec, i, rotary, ops, tp_rank, tp_size) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """(T,) token ids and positions -> (T, hidden) final hidden states."""
        ops = self.ops
        ops.begin_forward()
        emb = self.embed_tokens
        hidden = ops.embed(input_ids, emb.weight, emb.vocab_start, emb.vocab_end)
        residual: torch.Tensor | None = None
        few = ops.few_rows(input_ids.shape[0])
        for layer in self.layers:
            step = layer.forward_few_rows if few else layer
            hidden, residual = step(positions, hidden, residual, meta)
        hidden, _ = ops.add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)
        return hidden


class DecoderForCausalLM(nn.Module):
    """A decoder with its LM head; logits only for the rows the caller asks for.

    A family subclasses it, naming its ``architecture`` and stating its
    ``attention_spec``; ``minivllm.model.registry`` picks the subclass.

    Args:
        config: the model's shapes; its ``architecture`` must be the class's.
        ops: what every op runs (default: the torch references, one rank).
        tp_rank: this process's tensor-parallel rank.
        tp_size: number of tensor-parallel ranks (``ops.comm`` must be set when > 1).

    Attributes:
        architecture: ``architectures[0]`` of the checkpoints this class loads.
        packed_modules_mapping: checkpoint module name -> (packed module, shard id),
            read by the loader.
        tie_word_embeddings: the LM head is the embedding (no ``lm_head.weight``
            parameter of its own).

    Raises:
        ValueError: ``config.architecture`` is another class's, or ``tp_size > 1`` without
            a communicator.
    """

    architecture: ClassVar[str]
    packed_modules_mapping: Mapping[str, tuple[str, ShardId]] = PACKED_MODULES

    def __init__(self, config: ModelConfig, *, ops: Ops | None = None, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        if config.architecture != self.architecture:
            raise ValueError(f"{type(self).__name__} loads {self.architecture} checkpoints, "
                             f"got a {config.architecture} config")
        ops = ops if ops is not None else Ops(triton=False, use_gemv=False, pdl=False)
        if tp_size > 1 and ops.comm is None:
            raise ValueError(f"tp_size={tp_size} needs an Ops with a communicator")
        self.config = config
        self.ops = ops
        self.tie_word_embeddings = config.tie_word_embeddings
        self.model = self.build_decoder(config, ops, tp_rank, tp_size)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def attention_spec(cls, config: ModelConfig) -> AttentionSpec:
        """What this family's attention block has (each family states it)."""
        raise NotImplementedError(f"{cls.__name__} states no attention_spec")

    @classmethod
    def build_decoder(cls, config: ModelConfig, ops: Ops, tp_rank: int, tp_size: int) -> nn.Module:
        """The ``model.*`` part: the shared decoder with this family's attention block (a family
        whose layers differ in more than ``AttentionSpec`` builds its own)."""
        return DecoderModel(config, cls.attention_spec(config), ops, tp_rank, tp_size)

    def skip_reason(self, name: str) -> str | None:
        """Why the loader leaves the checkpoint tensor ``name`` unread, or None: it loads it
        (the shared decoder serves every tensor of its checkpoints)."""
        return None

    def checkpoint_parts(self, name: str, tensor: Loaded) -> Iterator[tuple[str, Loaded]]:
        """The checkpoint tensor ``name`` as our modules spell it, before the packing rules: here
        itself, as it is."""
        yield name, tensor

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """(T,) token ids, (T,) positions -> (T, hidden) hidden states (no logits)."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_rows: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """(S, hidden) rows that sample -> (S, vocab) logits; ``gather=False`` under tensor
        parallelism: this rank's vocab columns only (``ParallelLMHead.forward``)."""
        return self.lm_head(hidden_rows, self.ops.comm, gather)
