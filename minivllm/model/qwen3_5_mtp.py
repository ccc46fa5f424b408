"""The multi-token-prediction head of Qwen3.5 and of Qwen3-Next (``mtp.*`` in the checkpoints, the
same tensors in both, which transformers drops on load): one gated full-attention decoder layer
that reads the target model's final hidden state at position t beside the embedding of token
t + 1, and predicts token t + 2 through the target's LM head. The speculative-decoding proposer
``method: "mtp"`` runs it (``executor/mtp.py``).

    x = fc([norm_e(embed(token t + 1)) | norm_h(hidden t)])      (2 H -> H, replicated)
    x = decoder_layer(x at position t)                           (its own K/V: the MTP cache)
    out = norm(x)                                                -> logits of token t + 2

Its K/V at position t is computed from ``x`` alone (one layer), so keeping the cache up with
the target needs only the K/V half of the layer (``store_kv``); a draft needs all of it
(``forward``). The embedding and the LM head are the target's (``mtp_use_dedicated_embeddings``
false, as in the released checkpoints). The layer is the target's gated-attention layer class:
with tensor parallelism it is sharded as the target's layers are.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from minivllm.config import HYBRID_ARCHITECTURES, MTP_LAYERS_KEYS, ModelConfig
from minivllm.layers.embedding import VocabParallelEmbedding
from minivllm.layers.norm import RMSNorm1p
from minivllm.layers.rotary import RotaryEmbedding
from minivllm.model.qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5ForCausalLM
from minivllm.ops.dispatch import Ops
from minivllm.ops.metadata import AttentionMetadata


def check_mtp_config(config: ModelConfig) -> None:
    """What the MTP proposer serves: a hybrid (Qwen3.5, Qwen3-Next) with one MTP layer on the
    shared embedding.

    Raises:
        ValueError: naming the field (``mtp_num_hidden_layers``, or Qwen3-Next's
            ``num_nextn_predict_layers``, 0 or more than 1; ``mtp_use_dedicated_embeddings``) or
            the architecture.
    """
    if not config.is_hybrid or config.architecture not in HYBRID_ARCHITECTURES:
        raise ValueError(f"speculative_config method 'mtp': {config.architecture} has no MTP head "
                         "(Qwen3.5 / Qwen3.6 and Qwen3-Next checkpoints have one)")
    if config.mtp_num_hidden_layers != 1:
        key = MTP_LAYERS_KEYS.get(config.architecture, "mtp_num_hidden_layers")
        raise ValueError(f"speculative_config method 'mtp' needs {key} 1, got {config.mtp_num_hidden_layers}"
                         + (" (the checkpoint has no MTP head)" if config.mtp_num_hidden_layers == 0 else ""))
    if config.mtp_use_dedicated_embeddings:
        raise ValueError("mtp_use_dedicated_embeddings: an MTP head with embeddings of its own is not served")


def mtp_layer_config(config: ModelConfig) -> ModelConfig:
    """The MTP layer's shapes as a one-layer full-attention model (its KV cache has one row).
    Its MLP is what the model's layer 0 has (vLLM's reading: the layer is ``mtp.layers.0``):
    sparse in a MoE model unless ``mlp_only_layers`` or ``decoder_sparse_step`` make layer 0
    dense (Qwen3-Next; a Qwen3.5-MoE model's layers are all sparse)."""
    return dataclasses.replace(config, num_hidden_layers=1, layer_types=("full_attention",),
                               mlp_only_layers=() if config.is_sparse_layer(0) else (0,), decoder_sparse_step=1,
                               mtp_num_hidden_layers=0)


class Qwen3_5MTP(nn.Module):
    """The ``mtp.*`` weights and the two passes over them (module doc).

    Args:
        config: the target model's shapes (checked by ``check_mtp_config``).
        embed_tokens: the target's embedding (shared, not a parameter of this module).
        ops, tp_rank, tp_size: as the target's.
    """

    def __init__(self, config: ModelConfig, embed_tokens: VocabParallelEmbedding, ops: Ops,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        check_mtp_config(config)
        self.config = layer_config = mtp_layer_config(config)
        self.ops = ops
        self._embed = [embed_tokens]  # in a list: the target owns (and loads) it
        h, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = RMSNorm1p(h, eps), RMSNorm1p(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)  # replicated: every rank the whole matrix
        self.fc.weight.requires_grad_(False)
        rotary = RotaryEmbedding(config.rotary_dim, config.max_position_embeddings, config.rope_theta)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_config, 0, rotary, ops, tp_rank, tp_size)])
        self.norm = RMSNorm1p(h, eps)

    def fuse_inputs(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """(T,) tokens t + 1 and (T, H) the target's hidden states at t -> (T, H) the layer's input."""
        ops, emb = self.ops, self._embed[0]
        e = ops.embed(input_ids, emb.weight, emb.vocab_start, emb.vocab_end)
        e = ops.rms_norm_1p(e, self.pre_fc_norm_embedding.weight, self.pre_fc_norm_embedding.eps)
        h = ops.rms_norm_1p(hidden, self.pre_fc_norm_hidden.weight, self.pre_fc_norm_hidden.eps)
        return ops.project(torch.cat([e, h.to(e.dtype)], dim=-1), self.fc.weight)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """The whole head: (T,) tokens t + 1, (T,) positions t, (T, H) hidden states at t -> (T, H)
        its normed output (``compute_logits`` of the target gives token t + 2's logits; the
        next draft step reads it as its hidden state). Writes its K/V at ``meta.slot_mapping``."""
        layer = self.layers[0]
        partial, residual = layer(positions, self.fuse_inputs(input_ids, hidden), None, meta)
        out, _ = self.ops.add_rms_norm_1p(partial, residual, self.norm.weight, self.norm.eps)
        return out

    def store_kv(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """Only the layer's K/V of these tokens, stored at ``meta.slot_mapping`` (-1: none): its
        input norm, q/k/v projection, k norm, RoPE and the store; no attention, no MLP."""
        ops, layer = self.ops, self.layers[0]
        attn = layer.self_attn
        x = self.fuse_inputs(input_ids, hidden)
        norm = layer.input_layernorm
        attn.store_kv(ops, positions, ops.rms_norm_1p(x, norm.weight, norm.eps), meta)


def attach_mtp(model: Qwen3_5ForCausalLM) -> Qwen3_5MTP:
    """Build ``model``'s MTP head (``model.mtp``, on its embedding, sharded as its layers) before
    its weights are loaded, so the loader reads ``mtp.*`` too; returns it.

    Raises:
        ValueError: the model has no MTP head the proposer serves (``check_mtp_config``).
    """
    if not isinstance(model, Qwen3_5ForCausalLM):
        raise ValueError(f"speculative_config method 'mtp': {type(model).__name__} has no MTP head")
    model.mtp = Qwen3_5MTP(model.config, model.model.embed_tokens, model.ops, model.tp_rank, model.tp_size)
    return model.mtp
