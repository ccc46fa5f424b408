"""Speculative decoding on the GPU (CUDA graphs on, float32): greedy with n-gram drafts gives
exactly greedy without them, at Qwen3-0.6B shapes and on the trained fixture with grammars,
in both scheduling modes; sampled rows are rejection-sampled and seeded ones replay."""

from __future__ import annotations

import gc

import pytest
import torch
import transformers

from minivllm import LLM, SamplingParams
from minivllm.testing import QWEN3_0_6B, randomize_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def qwen3_0_6b(tmp_path_factory) -> str:
    cfg = transformers.Qwen3Config(**dict(QWEN3_0_6B, bos_token_id=None, eos_token_id=None))
    cfg.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg).float().eval()
    randomize_weights(hf, 0.5)
    path = str(tmp_path_factory.mktemp("qwen3-0.6b"))
    hf.save_pretrained(path)
    del hf
    gc.collect()
    return path


def _run(path: str, prompts, params, speculative, **options):
    outs = {}
    with LLM(path, device="cuda", dtype="float32", speculative_config=speculative, num_blocks=512, **options) as llm:
        for mode in (False, True):
            llm.engine.set_async_scheduling(mode)
            outs[mode] = [(o.token_ids, o.text) for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.stats
    gc.collect()
    torch.cuda.empty_cache()
    return outs, stats


def test_greedy_with_drafts_equals_greedy_without_at_qwen3_0_6b_shapes(qwen3_0_6b: str) -> None:
    base = [[3, 1, 4, 1, 5, 9, 2, 6] * 6, [7, 7, 8] * 10, list(range(100, 160))]
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2),
              SamplingParams(temperature=0.9, seed=5, max_tokens=32, ignore_eos=True)]
    opts = dict(skip_tokenizer_init=True, max_model_len=256)
    plain, _ = _run(qwen3_0_6b, base, params, None, **opts)
    drafted, stats = _run(qwen3_0_6b, base, params, NGRAM, **opts)
    assert drafted[False][:3] == drafted[True][:3] == plain[False][:3]  # the greedy completions
    assert drafted[False][3] == drafted[True][3]                        # the seeded one replays
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats


def test_grammars_and_stop_strings_with_drafts_on_the_gpu() -> None:
    prompts = ["1+2+1+2+1+2=", "12+34=", "50+27="]
    params = [SamplingParams(temperature=0, max_tokens=14, structured_outputs={"regex": "(1\\+2\\+){2}[0-9]{1,3}"}),
              SamplingParams(temperature=0, max_tokens=12, stop=["6"]),
              SamplingParams(temperature=0, max_tokens=12, min_tokens=6, bad_words=["7"])]
    plain, _ = _run("fixtures/tiny-qwen3", prompts, params, None)
    drafted, stats = _run("fixtures/tiny-qwen3", prompts, params, NGRAM)
    assert drafted[False] == drafted[True] == plain[False]
    assert stats.num_accepted_tokens > 0, stats
