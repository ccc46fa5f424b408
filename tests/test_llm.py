"""The whole engine on the real (tiny, random) Qwen3: greedy output through LLM is
token-identical to Hugging Face, under paging, preemption, prefix caching and
chunked prefill; bad input is rejected and the engine keeps serving."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.testing import TinyConfig, make_hf_model, save_hf_model

CFG = TinyConfig(vocab_size=113, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
NEW = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    hf = make_hf_model(CFG, seed=3)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("llm"))


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full recomputation (no cache: nothing to get wrong)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def shared_prefix_prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, CFG.vocab_size, k).tolist() for k in (13, 21)]
    return [prefixes[i % 2] + rng.integers(0, CFG.vocab_size, int(rng.integers(1, 9))).tolist()
            for i in range(n)]


def make_llm(path: str, **opts) -> LLM:
    base = dict(device="cpu", kernels="torch", skip_tokenizer_init=True, block_size=4,
                max_model_len=96)
    return LLM(path, **{**base, **opts})


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_matches_hf_under_preemption_caching_and_chunking(model, async_scheduling: bool) -> None:
    hf, path = model
    prompts = shared_prefix_prompts(12, seed=0)
    # 40 blocks of 4 = 160 slots for 12 sequences of up to 61 tokens: preemption is forced.
    llm = make_llm(path, num_blocks=40, max_num_seqs=8, max_num_batched_tokens=24,
                   enable_prefix_caching=True, chunked_prefill=True, async_scheduling=async_scheduling)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
                        use_tqdm=False)
    stats = llm.engine.stats
    assert stats.num_preemptions > 0 and stats.num_cached_tokens > 0 and stats.num_chunked_prefills > 0
    for prompt, out in zip(prompts, outs):
        assert list(out.token_ids) == hf_greedy(hf, prompt, NEW)
    llm.engine.check_invariants()


def test_prefix_cache_across_generate_calls(model) -> None:
    hf, path = model
    prompts = shared_prefix_prompts(4, seed=1)
    llm = make_llm(path, num_blocks=64, policy="prefill_first")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    cached = llm.engine.stats.num_cached_tokens
    second = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats.num_cached_tokens - cached >= sum(len(p) // 4 * 4 - 4 for p in prompts)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert list(first[0].token_ids) == hf_greedy(hf, prompts[0], 8)


def test_bad_prompts_are_rejected_and_the_engine_keeps_serving(model) -> None:
    _, path = model
    llm = make_llm(path, num_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=4)
    for bad, match in (([], "empty"), ([1, CFG.vocab_size], "outside the vocabulary"),
                       (list(range(95)), "max_model_len"), ("text", "token ids")):
        with pytest.raises(ValueError, match=match):
            llm.generate([[1, 2, 3], bad], params, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert len(out[0].token_ids) == 4


def test_options_are_checked(model) -> None:
    _, path = model
    with pytest.raises(TypeError, match="max_num_sequences"):
        make_llm(path, max_num_sequences=4)
    with pytest.raises(ValueError, match="policy"):
        make_llm(path, policy="fastest")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make_llm(path, max_model_len=1000)
    with pytest.raises(ValueError, match="not a local directory"):
        LLM("/nonexistent/model-dir-xyz", device="cpu")


def test_seeded_sampling_through_the_engine_is_reproducible(model) -> None:
    _, path = model
    llm = make_llm(path, num_blocks=64)
    p = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=123, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], p, use_tqdm=False)[0].token_ids
    crowd = llm.generate([[1, 2], [5, 6, 7], [9] * 10], [SamplingParams(max_tokens=5), p,
                                                         SamplingParams(max_tokens=7)],
                         use_tqdm=False)[1].token_ids
    assert alone == crowd


def test_hub_id_offline_and_not_cached_is_a_clear_error(tmp_path) -> None:
    import os
    import subprocess
    import sys

    code = ("from minivllm import LLM\n"
            "try:\n    LLM('Qwen/Qwen3-0.6B', device='cpu')\n"
            "except ValueError as e:\n    print('VALUEERROR', e)\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert "VALUEERROR model 'Qwen/Qwen3-0.6B' is not a local directory" in r.stdout, r.stdout + r.stderr


def test_too_big_prompt_queues_nothing_and_next_generate_works(model) -> None:
    """Regression: a prompt the pool cannot hold, after a good one, used to queue the good one
    and break the next generate() with a KeyError."""
    _, path = model
    llm = make_llm(path, num_blocks=12, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="prompt 1: .*KV blocks"):
        llm.generate([[1, 2, 3], [9] * 50], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert len(out) == 1 and len(out[0].token_ids) == 4


def test_llm_freezes_imported_objects_but_a_dropped_llm_is_freed(model) -> None:
    """The first LLM() of a process freezes what was alive before it (no full collection
    rescans torch's objects every few hundred steps), never an LLM: two built in a row
    both stay in the collector's generations, and each, dropped, is freed (without a
    collection: tests/test_lifecycle.py)."""
    import gc
    import weakref

    first = make_llm(model[1])
    second = make_llm(model[1])
    assert gc.get_freeze_count() > 1000
    tracked = {id(o) for o in gc.get_objects()}  # frozen objects are not listed
    assert id(first.engine) in tracked and id(second.engine) in tracked
    refs = [weakref.ref(llm.engine.executor.model) for llm in (first, second)]
    del first, second
    gc.collect()
    assert all(r() is None for r in refs)
