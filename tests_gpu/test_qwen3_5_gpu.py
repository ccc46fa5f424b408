"""Qwen3.5 hybrid models (dense and MoE) on the GPU, float32, through ``LLM`` with the Triton
kernels (the conv and the delta rule token by token, eagerly: no CUDA graphs for hybrid models
yet): greedy tokens equal transformers' (on the CPU) in both scheduling modes, and a second
call whose prompts share a prefix resumes from state snapshots with the same tokens."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.testing import hf_generate
from tests.model.test_qwen3_5 import MODELS, make_hf

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")]
NEW = 8


@pytest.mark.parametrize("name", ["dense-lin-first", "moe-shared-full-first"])
def test_hybrid_model_on_the_gpu_gives_transformers_tokens(name: str, tmp_path) -> None:
    arch, settings = MODELS[name]
    hf = make_hf(arch, settings, seed=3)
    hf.save_pretrained(tmp_path)
    rng = np.random.default_rng(0)
    vocab = hf.config.vocab_size
    prefix = rng.integers(0, vocab, 40).tolist()
    plain = [rng.integers(0, vocab, n).tolist() for n in (70, 9, 33)]
    shared = [prefix + rng.integers(0, vocab, n).tolist() for n in (3, 11)]
    want = {i: hf_generate(hf, p, NEW) for i, p in enumerate(plain + shared)}
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    with LLM(str(tmp_path), device="cuda", dtype="float32", skip_tokenizer_init=True, block_size=16,
             num_blocks=64, max_model_len=128, state_snapshot_interval=1) as llm:
        for mode in (False, True):
            llm.engine.set_async_scheduling(mode)
            got = [list(o.token_ids) for o in llm.generate(plain, greedy, use_tqdm=False)]
            assert got == [want[i] for i in range(3)], mode
        cold = llm.generate(shared[:1], greedy, use_tqdm=False)
        warm = llm.generate(shared[1:], greedy, use_tqdm=False)
    assert list(cold[0].token_ids) == want[3] and list(warm[0].token_ids) == want[4]
    assert warm[0].num_cached_tokens == 32  # the deepest snapshot short of the shared 40 tokens
    del hf
    gc.collect()
    torch.cuda.empty_cache()
