"""The real model shapes of ``minivllm.testing``: the TP=2 rank stand-in is exactly half of Qwen3-8B where
tensor parallelism splits it, and the same everywhere else; the smoke shapes make a
consistent tiny model of every family."""

from __future__ import annotations

from minivllm.testing import QWEN3_8B, QWEN3_8B_RANK_OF_2, SHAPES, SMOKE_SHAPES

SPLIT_BY_TP = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")


def test_rank_of_2_is_half_of_qwen3_8b_where_tp_splits_it() -> None:
    assert SHAPES["qwen3-8b-rank-of-2"] == ("Qwen3ForCausalLM", QWEN3_8B_RANK_OF_2)
    for key in SPLIT_BY_TP:
        assert QWEN3_8B_RANK_OF_2[key] * 2 == QWEN3_8B[key], key
    special = {"bos_token_id", "eos_token_id"}
    assert {k: v for k, v in QWEN3_8B_RANK_OF_2.items() if k not in (*SPLIT_BY_TP, *special)} == \
        {k: v for k, v in QWEN3_8B.items() if k not in (*SPLIT_BY_TP, *special)}
    vocab = QWEN3_8B_RANK_OF_2["vocab_size"]
    assert 0 <= QWEN3_8B_RANK_OF_2["bos_token_id"] < vocab and 0 <= QWEN3_8B_RANK_OF_2["eos_token_id"] < vocab


def test_smoke_shapes_override_every_family_into_one_tiny_model() -> None:
    for _, numbers in SHAPES.values():
        tiny = {**numbers, **SMOKE_SHAPES}
        assert tiny["num_attention_heads"] % tiny["num_key_value_heads"] == 0
        assert tiny["hidden_size"] == tiny["num_attention_heads"] * tiny["head_dim"]
        assert 0 <= tiny["bos_token_id"] < tiny["vocab_size"] and 0 <= tiny["eos_token_id"] < tiny["vocab_size"]
