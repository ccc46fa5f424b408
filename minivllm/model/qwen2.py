"""Qwen2 and Qwen2.5: the shared decoder (``minivllm.model.decoder``) with a bias on q, k and v.

Hugging Face's Qwen2 hard-codes it: q/k/v projections always carry a bias
(config.json has no switch for it), o_proj never does, and there is no q/k
norm. Sliding-window layers (``use_sliding_window``) are refused by
``ModelConfig.from_hf_json``; the released Qwen2.5 checkpoints do not use them.
"""

from __future__ import annotations

from minivllm.config import ModelConfig
from minivllm.model.decoder import AttentionSpec, DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 / Qwen2.5 (``Qwen2ForCausalLM`` checkpoints); see ``DecoderForCausalLM`` for the arguments."""

    architecture = "Qwen2ForCausalLM"

    @classmethod
    def attention_spec(cls, config: ModelConfig) -> AttentionSpec:
        return AttentionSpec(qk_norm=False, qkv_bias=True, o_proj_bias=False)
