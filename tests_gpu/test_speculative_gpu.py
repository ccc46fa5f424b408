"""Speculative decoding on the GPU (CUDA graphs on, float32): greedy with n-gram drafts gives
exactly greedy without them, at Qwen3-0.6B shapes and on the trained fixture with grammars,
in both scheduling modes; sampled rows are rejection-sampled and seeded ones replay."""

from __future__ import annotations

import gc

import pytest
import torch
import transformers

from minivllm import LLM, SamplingParams
from minivllm.testing import QWEN3_0_6B, ReplayProposer, randomize_weights

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
    """Drafts replayed from the greedy run, half of them wrong (random weights repeat no
    n-gram, so lookup would find none): the same tokens, drafts kept and refused, both modes;
    a seeded sampled row replays."""
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 6, [7, 7, 8] * 16, list(range(100, 148))]
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, seed=5, max_tokens=32, ignore_eos=True)
    with LLM(qwen3_0_6b, device="cuda", dtype="float32", speculative_config=NGRAM, num_blocks=512,
             skip_tokenizer_init=True, max_model_len=256) as llm:
        llm.engine.proposer = None
        plain = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        truth = {tuple(p): t for p, t in zip(prompts, plain)}
        runner = llm.engine.executor.prefill_graph_runner
        replays = runner.num_replays
        runs = {}
        for mode in (False, True):
            llm.engine.set_async_scheduling(mode)
            llm.engine.proposer = ReplayProposer(truth, 48, 4, 0.5, llm.model_config.vocab_size)
            runs[mode] = [o.token_ids for o in llm.generate(prompts + prompts[:1], [greedy] * 3 + [sampled],
                                                            use_tqdm=False)]
        stats = llm.engine.stats
        # 3-4 rows of 1 + up to 4 tokens: every drafted step in the 64-token graph
        assert runner.replays_by_bucket[64] >= 20 and runner.num_replays - replays >= 20, runner.replays_by_bucket
    assert runs[False][:3] == runs[True][:3] == plain
    assert runs[False][3] == runs[True][3] and len(runs[False][3]) == 32
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_grammars_and_stop_strings_with_drafts_on_the_gpu() -> None:
    prompts = ["1+2+1+2+1+2=", "12+34=", "50+27="]
    params = [SamplingParams(temperature=0, max_tokens=14, structured_outputs={"regex": "(1\\+2\\+){2}[0-9]{1,3}"}),
              SamplingParams(temperature=0, max_tokens=12, stop=["6"]),
              SamplingParams(temperature=0, max_tokens=12, min_tokens=6, bad_words=["7"])]
    plain, _ = _run("fixtures/tiny-qwen3", prompts, params, None)
    drafted, stats = _run("fixtures/tiny-qwen3", prompts, params, NGRAM)
    assert drafted[False] == drafted[True] == plain[False]
    assert stats.num_accepted_tokens > 0, stats


def test_a_draft_model_on_the_gpu_at_qwen3_0_6b_shapes(qwen3_0_6b: str) -> None:
    """The target as its own draft, graphs on (the draft's decode steps replay its own): the
    same tokens as without drafts in both modes, nearly every draft kept, beside a seeded
    sampled row that replays."""
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 6, [7, 7, 8] * 16, list(range(100, 148))]
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, seed=5, max_tokens=32, ignore_eos=True)
    options = dict(skip_tokenizer_init=True, max_model_len=256)
    plain, _ = _run(qwen3_0_6b, prompts, greedy, None, **options)
    spec = {"model": qwen3_0_6b, "num_speculative_tokens": 4}
    with LLM(qwen3_0_6b, device="cuda", dtype="float32", speculative_config=spec, num_blocks=512, **options) as llm:
        assert llm.engine.executor.drafter.graphs
        runs = {}
        for mode in (False, True):
            llm.engine.set_async_scheduling(mode)
            runs[mode] = llm.generate(prompts + prompts[:1], [greedy] * 3 + [sampled], use_tqdm=False)
        replays = llm.engine.executor.drafter.num_replays
    for mode in (False, True):
        assert [o.token_ids for o in runs[mode][:3]] == [t for t, _ in plain[False]]
        for o in runs[mode][:3]:
            assert o.num_accepted_tokens >= 0.98 * o.num_draft_tokens > 20, o
    assert runs[False][3].token_ids == runs[True][3].token_ids and len(runs[False][3].token_ids) == 32
    assert replays > 10
    gc.collect()
    torch.cuda.empty_cache()


def test_logprobs_of_drafted_rows_on_the_gpu(qwen3_0_6b: str) -> None:
    """Greedy rows asking for logprobs take drafts: each kept token's logprobs (its own and
    the top 3) are those decoding without drafts reports, within float32 rounding."""
    import numpy as np

    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 6
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=3)
    with LLM(qwen3_0_6b, device="cuda", dtype="float32", speculative_config=NGRAM, num_blocks=512,
             skip_tokenizer_init=True, max_model_len=256) as llm:
        llm.engine.proposer = None
        plain = llm.generate([prompt], params, use_tqdm=False)[0]
        llm.engine.proposer = ReplayProposer({tuple(prompt): plain.token_ids}, 48, 4, 0.7,
                                             llm.model_config.vocab_size)
        drafted = llm.generate([prompt], params, use_tqdm=False)[0]
        assert llm.engine.stats.num_accepted_tokens > 5
    assert drafted.token_ids == plain.token_ids and len(drafted.logprobs) == 32
    for got, want in zip(drafted.logprobs, plain.logprobs):
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[t] for t in want], list(want.values()), atol=2e-3)
    gc.collect()
    torch.cuda.empty_cache()
