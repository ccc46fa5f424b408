"""Qwen3 dense: the shared decoder (``minivllm.model.decoder``) with per-head q/k RMSNorm.

Qwen3's ``attention_bias`` (config.json) puts a bias on q, k, v and o alike;
the released checkpoints have none.
"""

from __future__ import annotations

from minivllm.config import ModelConfig
from minivllm.model.decoder import AttentionSpec, DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3 (``Qwen3ForCausalLM`` checkpoints); see ``DecoderForCausalLM`` for the arguments."""

    architecture = "Qwen3ForCausalLM"

    @classmethod
    def attention_spec(cls, config: ModelConfig) -> AttentionSpec:
        return AttentionSpec(qk_norm=True, qkv_bias=config.attention_bias, o_proj_bias=config.attention_bias)
