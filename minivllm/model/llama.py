"""Llama (3.x): the shared decoder (``minivllm.model.decoder``), no q/k norm.

``attention_bias`` (config.json, false in every Llama 3 release) puts a bias on
q, k, v and o alike. Llama 3.1's ``llama3`` RoPE frequency scaling is read by
``ModelConfig.from_hf_json`` and applied in the rotary table
(``minivllm.layers.rotary``); the head is tied (3.2-1B/3B) or not (3.1-8B) as
config.json says.
"""

from __future__ import annotations

from minivllm.config import ModelConfig
from minivllm.model.decoder import AttentionSpec, DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama (``LlamaForCausalLM`` checkpoints); see ``DecoderForCausalLM`` for the arguments."""

    architecture = "LlamaForCausalLM"

    @classmethod
    def attention_spec(cls, config: ModelConfig) -> AttentionSpec:
        return AttentionSpec(qk_norm=False, qkv_bias=config.attention_bias, o_proj_bias=config.attention_bias)
