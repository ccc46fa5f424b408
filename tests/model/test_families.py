"""Qwen2/2.5 and Llama-3.x beside Qwen3, float32 against transformers.

Per-step logits of every family are in ``test_model_parity.py`` (its CONFIGS);
here: the registry, each family's attention parts, the ``llama3`` RoPE
frequencies and table against transformers' own, logits over a context far past
the scaled model's pre-training length, greedy generation through the whole
engine (paged, small pool, prefix cache on) token-identical to ``generate``, and
the chat template taken from a non-Qwen checkpoint's tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from minivllm import LLM, SamplingParams
from minivllm.config import SUPPORTED_ARCHITECTURES, Llama3RopeScaling, ModelConfig
from minivllm.layers.rotary import RotaryEmbedding, llama3_scaled_frequencies
from minivllm.model.loader import load_weights
from minivllm.model.registry import MODEL_CLASSES, build_model, model_class
from minivllm.testing import (LLAMA3_SCALING, TinyConfig, chunked_then_decoded_diff, hf_generate,
                         make_hf_model, make_model_executor, random_tokens, save_hf_model)

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_TOKENIZER = ROOT / "fixtures" / "tiny-qwen3"
BS = 4
NEW = 10

FAMILIES = {
    "qwen2-bias": TinyConfig(family="qwen2", vocab_size=101, hidden_size=32, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rope_theta=1e6),
    "llama3-scaled-tied": TinyConfig(family="llama", vocab_size=101, tie_word_embeddings=True,
                                     max_position_embeddings=128, rope_theta=500_000.0,
                                     rope_scaling=LLAMA3_SCALING),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    hf = make_hf_model(FAMILIES[name], seed=7)
    return name, hf, save_hf_model(hf, tmp_path_factory.mktemp(name))


# ---- registry and structure ------------------------------------------------------------------

def test_registry_is_the_supported_architectures() -> None:
    assert tuple(MODEL_CLASSES) == SUPPORTED_ARCHITECTURES
    for name, cls in MODEL_CLASSES.items():
        assert model_class(name) is cls and cls.architecture == name
    with pytest.raises(ValueError, match="MistralForCausalLM(.|\n)*Qwen3ForCausalLM.*Qwen2ForCausalLM.*Llama"):
        model_class("MistralForCausalLM")


def test_model_class_refuses_another_familys_config(family) -> None:
    _, _, path = family
    config = ModelConfig.from_hf_json(path)
    other = next(cls for name, cls in MODEL_CLASSES.items() if name != config.architecture)
    with pytest.raises(ValueError, match=f"got a {config.architecture} config"):
        other(config)


def test_attention_parts_per_family_and_qkv_bias_loaded(family) -> None:
    name, hf, path = family
    model = build_model(ModelConfig.from_hf_json(path))
    load_weights(model, path)
    attn = model.model.layers[1].self_attn
    assert attn.q_norm is None and attn.k_norm is None
    assert attn.o_proj.bias is None
    sd = hf.state_dict()
    if name.startswith("qwen2"):
        want = torch.cat([sd[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"])
        assert torch.equal(attn.qkv_proj.bias, want) and want.abs().min() > 0
    else:
        assert attn.qkv_proj.bias is None
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == hf.config.tie_word_embeddings


# ---- llama3 RoPE -----------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim, theta, scaling", [
    (16, 500_000.0, LLAMA3_SCALING),  # the tests' model: all three bands
    (64, 500_000.0, dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=8192)),  # Llama-3.2-1B
], ids=["tiny", "llama-3.2-1b"])
def test_llama3_frequencies_match_transformers(head_dim: int, theta: float, scaling: dict) -> None:
    cfg = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                   max_position_embeddings=131072,
                                   rope_parameters={"rope_type": "llama3", "rope_theta": theta, **scaling})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    plain = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    got = llama3_scaled_frequencies(plain, Llama3RopeScaling(**scaling))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    changed = got != plain
    assert not changed[0] and changed[-1], "expected an unchanged high band and a scaled low band"
    torch.testing.assert_close(got[-1], plain[-1] / scaling["factor"], rtol=1e-6, atol=0)


def test_llama3_table_matches_transformers_and_differs_from_plain() -> None:
    cfg = FAMILIES["llama3-scaled-tied"]
    positions = torch.arange(cfg.max_position_embeddings)
    cos, sin = LlamaRotaryEmbedding(cfg.hf_config())(torch.zeros(1), positions[None])  # (1, P, D)
    ours = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                           Llama3RopeScaling(**LLAMA3_SCALING)).cos_sin_cache       # (P, D) [cos | sin]
    half = cfg.head_dim // 2
    torch.testing.assert_close(ours[:, :half], cos[0, :, :half], rtol=0, atol=2e-6)
    torch.testing.assert_close(ours[:, half:], sin[0, :, :half], rtol=0, atol=2e-6)
    plain = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta).cos_sin_cache
    assert (plain[64:] - ours[64:]).abs().max() > 0.5


def test_logits_far_past_the_pretraining_context_match_hf(family) -> None:
    """An 84-token prompt in two chunks (the second over the cached first), then decodes:
    positions reach 2.7x the scaled model's original_max_position_embeddings (32)."""
    name, hf, path = family
    ex = make_model_executor(path, device="cpu", dtype="float32", kernels="torch", block_size=BS,
                             num_blocks=32, max_num_seqs=2, max_num_batched_tokens=64)
    seq = random_tokens(np.random.default_rng(4), 84, hf.config.vocab_size)
    table = tuple(range(31, 8, -1))  # 23 scattered-order blocks: 92 slots
    worst = chunked_then_decoded_diff(ex, hf, seq, 50, table, BS)
    print(f"\n[families] {name}: 84-88 positions max|diff| = {float(worst):.3e}")
    assert worst <= 1e-4


# ---- the whole engine ------------------------------------------------------------------------

def long_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Four ~80-token prompts over two shared 64-token prefixes (prefix-cache hits)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab, 64).tolist() for _ in range(2)]
    return [prefixes[i % 2] + rng.integers(0, vocab, int(rng.integers(10, 20))).tolist() for i in range(4)]


def test_engine_greedy_matches_hf_generate(family) -> None:
    name, hf, path = family
    prompts = long_prompts(hf.config.vocab_size)
    want = [hf_generate(hf, p, NEW) for p in prompts]
    # 28 blocks of 4 for four sequences of up to 93 tokens (24 blocks each, 16 of them a shared
    # prefix) and a 32-token budget: prefills are chunked and a sequence is preempted.
    with LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, block_size=BS, num_blocks=28,
             max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, enable_prefix_caching=True) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
                            use_tqdm=False)
        stats = llm.engine.stats
    assert [list(o.token_ids) for o in outs] == want
    print(f"\n[families] {name}: preemptions {stats.num_preemptions}, cached tokens {stats.num_cached_tokens}")
    assert stats.num_preemptions > 0 and stats.num_cached_tokens > 0


@pytest.fixture
def llama_chat_checkpoint(tmp_path) -> str:
    """A tiny Llama checkpoint with the fixture's tokenizer and its own (non-Qwen) template."""
    cfg = TinyConfig(family="llama", vocab_size=100, tie_word_embeddings=True)
    path = save_hf_model(make_hf_model(cfg), tmp_path)
    shutil.copy(FIXTURE_TOKENIZER / "tokenizer.json", path)
    tok_cfg = json.loads((FIXTURE_TOKENIZER / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                                "{% if add_generation_prompt %}[assistant]{% endif %}")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f)
    return path


def test_chat_template_comes_from_a_llama_checkpoints_tokenizer(llama_chat_checkpoint, capsys) -> None:
    """A Llama checkpoint with its own (non-Qwen) template: ``chat`` formats with it, and
    the CLI's ``--chat`` gives the same reply."""
    from minivllm.__main__ import main as cli_main

    path = llama_chat_checkpoint
    with LLM(path, device="cpu", dtype="float32", block_size=BS, num_blocks=16, max_model_len=64) as llm:
        out, = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=2),
                        use_tqdm=False)
        assert llm.tokenizer.decode(list(out.prompt_token_ids)) == "[user]hi[assistant]"
    assert cli_main(["generate", "--model", path, "--device", "cpu", "--dtype", "float32", "--block-size", "4",
                     "--num-blocks", "16", "--max-model-len", "64", "--max-tokens", "2", "--chat", "hi"]) == 0
    assert out.text and out.text in capsys.readouterr().out


def test_llama_checkpoint_is_served_like_qwen3(llama_chat_checkpoint) -> None:
    """The OpenAI server over a Llama checkpoint: chat (its own template) and completions
    answer what the offline ``LLM`` answers."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from minivllm.server.app import build_app
    from minivllm.server.protocol import ServerConfig

    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    messages = [{"role": "user", "content": "hi"}]
    with LLM(llama_chat_checkpoint, device="cpu", dtype="float32", block_size=BS, num_blocks=16,
             max_model_len=64) as llm:
        want_chat = llm.chat(messages, greedy, use_tqdm=False)[0].text
        want_text = llm.generate(["12+34="], greedy, use_tqdm=False)[0].text
        assert want_chat and want_text and want_chat != want_text
        with TestClient(build_app(llm, ServerConfig("tiny-llama"))) as client:
            common = dict(model="tiny-llama", max_tokens=4, temperature=0, ignore_eos=True)
            r = client.post("/v1/chat/completions", json=dict(messages=messages, **common))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == want_chat
            r = client.post("/v1/completions", json=dict(prompt="12+34=", **common))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want_text
