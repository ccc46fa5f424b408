"""Qwen3-MoE on the CPU against transformers' ``Qwen3MoeForCausalLM``: float32 logits of
tiny configs (top-1, top-2 renormalised, top-k = every expert; dense layers among sparse
ones), greedy tokens through the whole engine (prefix caching, chunked prefill,
preemption), tensor parallelism on gloo, and the loader's and config's refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from minivllm import LLM, SamplingParams
from minivllm.config import ModelConfig
from minivllm.testing import chunked_then_decoded_diff, hf_generate, make_model_executor, random_tokens, randomize_weights

BS = 4
NEW = 16
# name -> Qwen3MoeConfig settings beyond the shared tiny shapes
CONFIGS = {
    "top1": dict(num_experts=4, num_experts_per_tok=1, norm_topk_prob=False),
    "top2-norm-dense-layer": dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                  num_hidden_layers=3),
    "all-experts-step2": dict(num_experts=3, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2,
                              num_hidden_layers=4),
}


def moe_config(**overrides) -> transformers.Qwen3MoeConfig:
    settings = {**dict(vocab_size=97, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
                       rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False),
                **overrides}
    cfg = transformers.Qwen3MoeConfig(**settings)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg


def make_moe(tmp: Path, seed: int = 0, **overrides) -> tuple[transformers.PreTrainedModel, str]:
    torch.manual_seed(seed)
    hf = transformers.Qwen3MoeForCausalLM(moe_config(**overrides)).float().eval()
    randomize_weights(hf, 0.5)
    hf.save_pretrained(tmp)
    return hf, str(tmp)


@pytest.fixture(scope="module", params=list(CONFIGS))
def moe(request, tmp_path_factory):
    name = request.param
    hf, path = make_moe(tmp_path_factory.mktemp(name), seed=3, **CONFIGS[name])
    return name, hf, path


def test_config_reads_the_routing_and_the_sparse_layers(moe) -> None:
    name, hf, path = moe
    c, want = ModelConfig.from_hf_json(path), CONFIGS[name]
    assert (c.architecture, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (
        "Qwen3MoeForCausalLM", want["num_experts"], want["num_experts_per_tok"], 24, want["norm_topk_prob"])
    sparse = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    assert [c.is_sparse_layer(i) for i in range(c.num_hidden_layers)] == sparse and any(sparse)


@pytest.mark.parametrize("written", [None, True, False])
def test_optional_routing_fields_default_as_transformers_reads_them(tmp_path: Path, written) -> None:
    """A config.json may omit ``norm_topk_prob``, ``decoder_sparse_step`` and
    ``mlp_only_layers``; each absent one means what transformers' Qwen3MoeConfig takes
    (``norm_topk_prob`` False there: no renormalisation), else the router weighs differently."""
    c = moe_config(**CONFIGS["top2-norm-dense-layer"]).to_dict()
    for key in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
        c.pop(key)
    if written is not None:
        c["norm_topk_prob"] = written
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in c.items() if v is not None}))
    ours, theirs = ModelConfig.from_hf_json(str(tmp_path)), transformers.AutoConfig.from_pretrained(tmp_path)
    assert ours.norm_topk_prob is theirs.norm_topk_prob
    assert written is None or ours.norm_topk_prob is written
    assert [ours.is_sparse_layer(i) for i in range(ours.num_hidden_layers)] == [
        i not in theirs.mlp_only_layers and (i + 1) % theirs.decoder_sparse_step == 0
        for i in range(theirs.num_hidden_layers)]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_logits_match_transformers(moe, kernels: str) -> None:
    """A 30-token prompt in two chunks (the second over the cached first), then decodes; the
    torch reference experts and the Triton kernels (interpreted here, with every other op's)."""
    name, hf, path = moe
    ex = make_model_executor(path, device="cpu", dtype="float32", kernels=kernels, block_size=BS,
                             num_blocks=16, max_num_seqs=2, max_num_batched_tokens=64)
    seq = random_tokens(np.random.default_rng(1), 30, hf.config.vocab_size)
    worst = chunked_then_decoded_diff(ex, hf, seq, 17, tuple(range(15, 3, -1)), BS)
    print(f"\n[moe] {name}, {kernels}: max|logits diff| = {float(worst):.3e}")
    assert worst <= 1e-4


def shared_prefix_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab, 24).tolist() for _ in range(2)]
    return [prefixes[i % 2] + rng.integers(0, vocab, int(rng.integers(3, 9))).tolist() for i in range(6)]


ENGINE = dict(device="cpu", dtype="float32", kernels="torch", skip_tokenizer_init=True, block_size=BS,
              num_blocks=24, max_num_seqs=6, max_num_batched_tokens=16, max_model_len=64,
              enable_prefix_caching=True)


def test_engine_greedy_matches_transformers_generate(moe) -> None:
    """Six prompts over two shared prefixes in a pool too small for all of them, a 16-token
    step budget: prefix hits, chunked prefills and preemption."""
    name, hf, path = moe
    prompts = shared_prefix_prompts(hf.config.vocab_size)
    want = [hf_generate(hf, p, NEW) for p in prompts]
    with LLM(path, **ENGINE) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
        stats = llm.engine.stats
    assert [list(o.token_ids) for o in outs] == want
    assert stats.num_preemptions > 0 and stats.num_cached_tokens > 0 and stats.num_chunked_prefills > 0


def test_tensor_parallel_experts_equal_one_rank(tmp_path: Path) -> None:
    """TP=2 on gloo: every rank holds half of every expert's intermediate dimension."""
    hf, path = make_moe(tmp_path, seed=5, **CONFIGS["top2-norm-dense-layer"])
    prompts = shared_prefix_prompts(hf.config.vocab_size, seed=2)[:4]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = []
    for tp in (1, 2):
        with LLM(path, **ENGINE, tensor_parallel_size=tp) as llm:
            outs.append([o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)])
    assert outs[0] == outs[1]


def _rewrite(path: str, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_loader_names_a_missing_or_misshaped_expert(tmp_path: Path) -> None:
    _, path = make_moe(tmp_path, **CONFIGS["top1"])
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.experts.2.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing(.|\n)*layers\.1\.mlp\.experts\.gate_up_proj \(shard \(2, 1\)\)"):
        LLM(path, **ENGINE)
    _rewrite(path, lambda t: t.update({"model.layers.1.mlp.experts.2.up_proj.weight": torch.zeros(24, 31)}))
    with pytest.raises(ValueError, match=r"experts\.2\.up_proj(.|\n)*expert 2 up_proj: expected checkpoint shape"):
        LLM(path, **ENGINE)
    _rewrite(path, lambda t: t.update({"model.layers.1.mlp.experts.2.up_proj.weight": torch.zeros(24, 32),
                                       "model.layers.1.mlp.experts.4.up_proj.weight": torch.zeros(24, 32)}))
    with pytest.raises(ValueError, match=r"experts\.4\.up_proj(.|\n)*no expert part \(4, 1\)"):
        LLM(path, **ENGINE)


@pytest.mark.parametrize("change, match", [
    ({"shared_expert_intermediate_size": 16}, "shared experts are not supported"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok .5. exceeds num_experts .4."),
    ({"moe_intermediate_size": None}, r"lacks required field\(s\) \['moe_intermediate_size'\]"),
    ({"mlp_only_layers": [7]}, "mlp_only_layers must be a tuple of layer indices"),
])
def test_config_refusals_name_the_field(tmp_path: Path, change: dict, match: str) -> None:
    c = moe_config(**CONFIGS["top1"]).to_dict()
    c.update(change)
    c = {k: v for k, v in c.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_json(str(tmp_path))


def test_cli_and_server_run_a_moe_checkpoint(tmp_path: Path, capsys) -> None:
    """The tiny fixture's tokenizer beside a MoE checkpoint of its vocabulary: the CLI and the
    OpenAI server answer what the offline ``LLM`` answers."""
    from minivllm.__main__ import main as cli_main
    from tests.server.utils import add_fixture_tokenizer, assert_server_completes_as_llm

    _, path = make_moe(tmp_path, seed=9, vocab_size=100, **CONFIGS["top2-norm-dense-layer"])
    add_fixture_tokenizer(path)
    opts = dict(device="cpu", dtype="float32", block_size=BS, num_blocks=16, max_model_len=64)
    with LLM(path, **opts) as llm:
        want = assert_server_completes_as_llm(llm, "12+34=")
    assert cli_main(["generate", "--model", path, "--device", "cpu", "--dtype", "float32", "--block-size", "4",
                     "--num-blocks", "16", "--max-model-len", "64", "--max-tokens", "4", "--ignore-eos",
                     "12+34="]) == 0
    assert want and want in capsys.readouterr().out
