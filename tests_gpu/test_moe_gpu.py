"""Qwen3-MoE at Qwen3-30B-A3B's layer shapes on the GPU against transformers.

Hidden 2048, 32 query / 4 KV heads, head_dim 128, 128 experts, top-8 renormalised,
moe_intermediate 768 (``minivllm/testing.py``), with 4 of its 48 layers: a random
float32 checkpoint (weights std 0.5, norm weights near 1) written with ``save_pretrained``
here. The checks are ``test_model_gpu.py``'s: float32 logits relative <= 1e-4 over a
300-token context (the Triton expert kernels, eager); float32 greedy through ``LLM`` over
16 prompts with shared prefixes, CUDA graphs on, one step in flight and synchronous,
token-identical to transformers' ``generate``; bf16 by the top-5 rule at the first
differing token.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers

from minivllm import LLM, SamplingParams
from minivllm.testing import SHAPES, make_model_executor, randomize_weights, release_memory
from tests_gpu.test_model_gpu import (
    NEW, assert_top5_at_first_difference, fp32_logit_error, hf_greedy, shared_prefix_prompts,
)

LAYERS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(HF float32 model on the GPU, path, prompts, HF's float32 greedy tokens)."""
    architecture, numbers = SHAPES["qwen3-30b-a3b"]
    numbers = copy.deepcopy(dict(numbers, num_hidden_layers=LAYERS, bos_token_id=None, eos_token_id=None))
    cfg = transformers.Qwen3MoeConfig(**numbers)
    cfg.architectures = [architecture]
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    randomize_weights(hf, 0.5)
    path = str(tmp_path_factory.mktemp("qwen3-moe"))
    hf.save_pretrained(path)
    prompts = shared_prefix_prompts(cfg.vocab_size)
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    yield hf, path, prompts, expected
    del hf
    release_memory()


def test_logits_match_hf_fp32(checkpoint) -> None:
    hf, path, _, _ = checkpoint
    ex = make_model_executor(path, device="cuda", dtype="float32", kernels="triton", block_size=16,
                             num_blocks=64, max_num_seqs=4, max_num_batched_tokens=1024, max_model_len=1024,
                             enforce_eager=True)
    rel = fp32_logit_error(ex, hf, "qwen3-moe")
    del ex
    release_memory()
    assert rel <= 1e-4


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_fp32_matches_hf_with_graphs(checkpoint, async_scheduling: bool) -> None:
    _, path, prompts, expected = checkpoint
    llm = None
    try:
        llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_num_seqs=16, max_model_len=512,
                  num_blocks=2048, max_num_batched_tokens=256, async_scheduling=async_scheduling)
        got = [list(o.token_ids) for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)]
        print(f"qwen3-moe {'async' if async_scheduling else 'sync'}: cached tokens "
              f"{llm.engine.stats.num_cached_tokens}")
        assert got == expected
        assert llm.engine.executor.graph_runner.num_replays > 0 and llm.engine.stats.num_cached_tokens > 0
    finally:
        del llm
        release_memory()


def test_bf16_top5_at_first_difference(checkpoint) -> None:
    """Last: it rounds the HF model's weights to bf16 (the fixture's other users ran before)."""
    hf, path, _, _ = checkpoint
    hf16 = hf.to(torch.bfloat16)
    ex = make_model_executor(path, device="cuda", dtype="bfloat16", kernels="triton", block_size=16,
                             num_blocks=64, max_num_seqs=4, max_num_batched_tokens=1024, max_model_len=1024,
                             enforce_eager=True)
    prompt = np.random.default_rng(1).integers(0, hf.config.vocab_size, 40).tolist()
    agreed = assert_top5_at_first_difference(ex, hf16, prompt, 32)
    print(f"qwen3-moe: bf16 greedy agreed for {agreed} of 32 tokens")
