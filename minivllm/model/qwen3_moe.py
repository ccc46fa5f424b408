"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with sparse MLP layers, whose
router and experts are ``layers/moe.py``'s; ``ModelConfig.is_sparse_layer`` says which
layers they are (the others keep the dense MLP)."""

from __future__ import annotations

from minivllm.config import ModelConfig
from minivllm.model.decoder import AttentionSpec, DecoderForCausalLM


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Qwen3-MoE (``Qwen3MoeForCausalLM`` checkpoints, e.g. Qwen3-30B-A3B); see
    ``DecoderForCausalLM`` for the arguments."""

    architecture = "Qwen3MoeForCausalLM"

    @classmethod
    def attention_spec(cls, config: ModelConfig) -> AttentionSpec:
        return AttentionSpec(qk_norm=True, qkv_bias=config.attention_bias, o_proj_bias=config.attention_bias)
