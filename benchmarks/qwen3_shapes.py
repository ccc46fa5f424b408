"""Random-weight checkpoints at real model shapes, written with transformers.

Benchmarks and the GPU suite build the model they need instead of downloading weights.
Each entry of ``SHAPES`` is a published config.json in numbers (transformers config
keyword arguments): Qwen3-0.6B, Qwen3-8B (untied head, about 16 GB in bf16: the
tensor-parallel benchmark), one TP=2 rank's share of Qwen3-8B as a model of its own (not
published: a stand-in), Qwen2.5-0.5B (q/k/v bias, no ``head_dim`` key: 896 / 14 = 64) and
Llama-3.2-1B (``llama3`` RoPE scaling, factor 32) and Qwen3-30B-A3B (Qwen3-MoE, 128
experts, 8 per token). ``SMOKE_SHAPES`` overrides any of them into a tiny model for CPU
runs of the benchmarks' code paths (with ``SMOKE_MOE_SHAPES``, a tiny MoE too).
"""

from __future__ import annotations

import copy
import os
from typing import Any, Mapping

QWEN3_0_6B: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0,
    rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=True,
    attention_bias=False, bos_token_id=151643, eos_token_id=151645,
)

QWEN3_8B: dict[str, Any] = dict(
    QWEN3_0_6B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
)

# One rank's share of Qwen3-8B at TP=2, as a whole model for one GPU: half the heads (KV
# heads too), half the MLP, half the vocabulary (the LM head's shard; ids kept inside it).
# Its batch-1 step is a TP=2 rank's work without the all-reduces, the logits' all-gather
# and the wait for the peer: what TP=2 would take if communication were free.
QWEN3_8B_RANK_OF_2: dict[str, Any] = dict(
    QWEN3_8B, num_attention_heads=16, num_key_value_heads=4, intermediate_size=6144,
    vocab_size=151936 // 2, bos_token_id=151936 // 2 - 2, eos_token_id=151936 // 2 - 1,
)

QWEN2_5_0_5B: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, rope_theta=1_000_000.0,
    rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True,
    use_sliding_window=False, max_window_layers=21, bos_token_id=151643, eos_token_id=151645,
)

LLAMA_3_2_1B: dict[str, Any] = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
    max_position_embeddings=131072, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    bos_token_id=128000, eos_token_id=128001,
)

# Qwen3-30B-A3B: 48 layers, every one sparse; 128 experts of 768, 8 per token, renormalised.
QWEN3_30B_A3B: dict[str, Any] = dict(
    QWEN3_0_6B, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, tie_word_embeddings=False, moe_intermediate_size=768,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
)

# A tiny model of any family above (smoke runs on the CPU: every code path, none of the cost).
SMOKE_SHAPES: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
    bos_token_id=1, eos_token_id=2,
)
# With SMOKE_SHAPES, what makes a Qwen3-MoE tiny too: 8 experts of 32, 2 per token.
SMOKE_MOE_SHAPES: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)

# --shapes name -> (architecture, i.e. the transformers model class, its config numbers)
SHAPES: Mapping[str, tuple[str, dict[str, Any]]] = {
    "qwen3-0.6b": ("Qwen3ForCausalLM", QWEN3_0_6B),
    "qwen3-8b": ("Qwen3ForCausalLM", QWEN3_8B),
    "qwen3-8b-rank-of-2": ("Qwen3ForCausalLM", QWEN3_8B_RANK_OF_2),
    "qwen2.5-0.5b": ("Qwen2ForCausalLM", QWEN2_5_0_5B),
    "llama-3.2-1b": ("LlamaForCausalLM", LLAMA_3_2_1B),
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", QWEN3_30B_A3B),
}


def write_random_checkpoint(path: str, shapes: str = "qwen3-0.6b", dtype: str = "bfloat16",
                            std: float = 0.02, seed: int = 0, **overrides: Any) -> str:
    """Save a random model of ``SHAPES[shapes]`` (with ``overrides``) to ``path``, unless
    ``path`` already holds a checkpoint.

    Raises:
        ValueError: an unknown ``shapes`` name.
    """
    import torch
    import transformers

    cfg = _hf_config(shapes, std, overrides)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    model_class = getattr(transformers, cfg.architectures[0])
    torch.manual_seed(seed)
    # Built directly in the target dtype: an 8B model in float32 would need 32 GB of host
    # memory. On a GPU when there is one: initialising 8B parameters on the CPU takes
    # minutes; safetensors copies each tensor to the host as it writes.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        try:
            with torch.device(device):
                model = model_class(cfg)
        except (RuntimeError, TypeError, ValueError) as e:  # say so, and build on the CPU
            if device == "cpu":
                raise
            print(f"building {shapes} on the GPU failed ({type(e).__name__}: {e}); on the CPU instead")
            device = "cpu"
            model = model_class(cfg)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the engine that loads it sizes its KV pool from free memory
    return path


def write_random_config(path: str, shapes: str = "qwen3-0.6b", dtype: str = "bfloat16", **overrides: Any) -> str:
    """Save only the config.json of ``SHAPES[shapes]`` (with ``overrides``) to ``path``, unless
    ``path`` already holds one: what ``load_format="dummy"`` needs, in milliseconds at any size.

    Raises:
        ValueError: an unknown ``shapes`` name.
    """
    cfg = _hf_config(shapes, 0.02, overrides)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    cfg.dtype = dtype
    cfg.save_pretrained(path)
    return path


def _hf_config(shapes: str, std: float, overrides: dict[str, Any]) -> Any:
    """The transformers config of ``SHAPES[shapes]`` with ``overrides``, naming its architecture.

    Raises:
        ValueError: an unknown ``shapes`` name.
    """
    import transformers

    if shapes not in SHAPES:
        raise ValueError(f"unknown shapes {shapes!r}; known: {sorted(SHAPES)}")
    architecture, numbers = SHAPES[shapes]
    # A copy: transformers fills in nested dicts (rope_parameters) in place.
    cfg = getattr(transformers, architecture).config_class(**copy.deepcopy({**numbers, **overrides}),
                                                           initializer_range=std)
    cfg.architectures = [architecture]
    return cfg


def write_byte_level_tokenizer(path: str, vocab_size: int, eos_token_id: int, seed: int = 0) -> str:
    """A byte-level BPE tokenizer of ``vocab_size`` ids in ``path`` (next to a random
    checkpoint), for what needs real token text: every byte, then random pieces of words,
    numbers and punctuation as BPE vocabularies hold them (some with a leading space), and
    ``<|im_end|>`` at ``eos_token_id``. No merges: prompts are token ids. Double quotes and
    backslashes occur only as the single-byte tokens, as a model that rarely ends a JSON
    string would have it."""
    import json
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()                                   # the 256 byte characters
    pieces = "abcdefghijklmnopqrstuvwxyz" * 4 + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "0123456789" * 2 + ",.:;-_()[]{}"
    rng = random.Random(seed)
    vocab: dict[str, int] = {}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    while len(vocab) < vocab_size - 1:
        word = "".join(rng.choice(pieces) for _ in range(rng.randint(2, 8)))
        vocab.setdefault(("\u0120" if rng.random() < 0.5 else "") + word, len(vocab))
    ids = sorted(vocab, key=vocab.get)  # type: ignore[arg-type]
    eos = "<|im_end|>"
    ids.insert(eos_token_id, eos)
    vocab = {tok: i for i, tok in enumerate(ids[:vocab_size])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([eos])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                   "clean_up_tokenization_spaces": False}, f)
    return path
