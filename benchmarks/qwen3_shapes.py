"""Random-weight checkpoints at real Qwen3 shapes, written with transformers.

No machine here can download weights, so benchmarks and the GPU suite build
the model they need: ``QWEN3_0_6B`` is Qwen3-0.6B's config.json in numbers.
"""

from __future__ import annotations

import os
from typing import Any

QWEN3_0_6B: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0,
    rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=True,
    attention_bias=False, bos_token_id=151643, eos_token_id=151645,
)


def write_random_qwen3(path: str, dtype: str = "bfloat16", std: float = 0.02, seed: int = 0,
                       **overrides: Any) -> str:
    """Save a random ``Qwen3ForCausalLM`` (Qwen3-0.6B shapes unless overridden) to ``path``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    cfg = Qwen3Config(**{**QWEN3_0_6B, **overrides}, initializer_range=std)
    cfg.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(path)
    return path
