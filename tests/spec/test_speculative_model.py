"""Speculative decoding on a real model (CPU, float32): greedy decoding with n-gram drafts
gives exactly the tokens of greedy decoding without them, through ``LLM``, in both scheduling
modes, with prefix caching, a pool small enough to preempt, n > 1 and stop strings; and the
drafts were scored and accepted."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import (conftest sets it too)

import pytest  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.testing import ReplayProposer, TinyConfig, make_hf_model, save_hf_model  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
TINY_QWEN3 = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "tiny-qwen3")


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    return save_hf_model(make_hf_model(TinyConfig(), seed=5), tmp_path_factory.mktemp("spec"))


def _generate(path, prompts, params, speculative, proposer=None, **options):
    outs = {}
    with LLM(path, device="cpu", dtype="float32", kernels="torch", speculative_config=speculative, **options) as llm:
        if proposer is not None:
            llm.engine.proposer = proposer
        for mode in (False, True):
            llm.engine.set_async_scheduling(mode)
            outs[mode] = [(o.token_ids, o.text, o.finish_reason)
                          for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.stats
    return outs, stats


@pytest.mark.parametrize("pool", [64, 12], ids=["roomy", "preempting"])
def test_greedy_with_ngram_drafts_equals_greedy_without(random_model, pool: int) -> None:
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 3, [7, 7, 8, 7, 7, 8, 7], [11, 12, 13, 11, 12, 13, 11, 12, 13, 11]]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, n=2),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)]
    options = dict(skip_tokenizer_init=True, block_size=4, num_blocks=pool, max_num_seqs=4, max_model_len=64)
    plain, _ = _generate(random_model, prompts, params, None, **options)
    drafted, stats = _generate(random_model, prompts, params, NGRAM, **options)
    assert drafted[False] == drafted[True] == plain[False]
    assert stats.num_draft_tokens > 20 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert (stats.num_preemptions > 0) == (pool == 12), stats


def test_stops_inside_drafts_beside_a_sampled_row(random_model) -> None:
    """max_tokens and a stop token met inside an accepted run, beside a rejection-sampled row
    (its tokens are its own draws: they need not equal those without drafts)."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3
    options = dict(skip_tokenizer_init=True, block_size=4, num_blocks=64, max_model_len=64)
    with LLM(random_model, device="cpu", dtype="float32", kernels="torch", **options) as llm:
        free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                            use_tqdm=False)[0].token_ids
    stop = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop]),
              SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)]
    plain, _ = _generate(random_model, [prompt] * 3, params, None, **options)
    # Drafts that replay the greedy run, every one right: runs of 5 tokens, which the stops cut.
    replay = ReplayProposer({tuple(prompt): free}, len(prompt), 4, 1.0, TinyConfig().vocab_size)
    drafted, stats = _generate(random_model, [prompt] * 3, params, NGRAM, proposer=replay, **options)
    assert drafted[False][:2] == drafted[True][:2] == plain[False][:2]
    assert drafted[False][0][0] == free[:9] and drafted[False][1][0][-1] == stop
    assert drafted[False][2] == drafted[True][2] and len(drafted[False][2][0]) == 12  # seeded: replays
    assert stats.num_accepted_tokens > 0


def test_sampled_rows_accept_what_the_model_would_say(random_model) -> None:
    """Rejection sampling scores each draft at its own position: at a low temperature it
    keeps what greedy verification keeps, at a high one far less."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3
    rates = {}
    for temperature in (0.0, 0.05, 5.0):
        params = SamplingParams(temperature=temperature, seed=1, max_tokens=24, ignore_eos=True)
        _, stats = _generate(random_model, [prompt] * 4, params, NGRAM, skip_tokenizer_init=True, block_size=4,
                             num_blocks=64, max_model_len=64)
        rates[temperature] = stats.num_accepted_tokens / max(stats.num_draft_tokens, 1)
    assert rates[0.0] > 0.1 and abs(rates[0.05] - rates[0.0]) < 0.05 and rates[5.0] < 0.5 * rates[0.0], rates


def test_text_and_stop_strings_with_drafts() -> None:
    """The trained fixture with its tokenizer: texts and stop strings as without drafts."""
    prompts = ["12+34=", "1+2+3+1+2+3+1+2+3=", "50+27="]
    params = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0, max_tokens=12, stop=["3"]),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, include_stop_str_in_output=True,
                             stop=["77"])]
    plain, _ = _generate(TINY_QWEN3, prompts, params, None, num_blocks=64)
    drafted, _ = _generate(TINY_QWEN3, prompts, params, NGRAM, num_blocks=64)
    assert drafted[False] == drafted[True] == plain[False]


def test_a_bad_speculative_config_is_refused(random_model) -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(random_model, device="cpu", skip_tokenizer_init=True, speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="unknown SpeculativeConfig key"):
        LLM(random_model, device="cpu", skip_tokenizer_init=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "draft_tp": 1})


def test_grammars_with_drafts() -> None:
    """Drafts are cut where the grammar refuses them and every scored position is masked:
    constrained greedy output as without drafts, in both scheduling modes."""
    prompts = ["1+2+1+2+1+2=", "12+12+12=", "3+3+3+3="]
    params = [SamplingParams(temperature=0, max_tokens=14, structured_outputs={"regex": "(1\\+2\\+){2}[0-9]{1,3}"}),
              SamplingParams(temperature=0, max_tokens=14, structured_outputs={"choice": ["12+12+12", "36"]}),
              SamplingParams(temperature=0, max_tokens=14, min_tokens=6, bad_words=["9"])]
    plain, _ = _generate(TINY_QWEN3, prompts, params, None, num_blocks=64)
    drafted, stats = _generate(TINY_QWEN3, prompts, params, NGRAM, num_blocks=64)
    assert drafted[False] == drafted[True] == plain[False]
    assert stats.num_accepted_tokens > 0, stats


def test_logprobs_of_drafted_rows_are_those_without_drafts(random_model) -> None:
    """A row asking for logprobs takes drafts too: each accepted token's logprobs (its own and
    the top 3) are those decoding without drafts reports, greedy and seeded-sampled."""
    import numpy as np

    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3
    options = dict(skip_tokenizer_init=True, block_size=4, num_blocks=64, max_model_len=64)
    with LLM(random_model, device="cpu", dtype="float32", kernels="torch", **options) as llm:
        free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                            use_tqdm=False)[0].token_ids
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=2, max_tokens=20, ignore_eos=True, logprobs=0)]
    with LLM(random_model, device="cpu", dtype="float32", kernels="torch", **options) as llm:
        plain = llm.generate([prompt] * 3, params, use_tqdm=False)
        llm.engine.proposer = ReplayProposer({tuple(prompt): free}, len(prompt), 4, 0.7, TinyConfig().vocab_size)
        drafted = llm.generate([prompt] * 3, params, use_tqdm=False)
        assert llm.engine.stats.num_accepted_tokens > 5
    assert drafted[0].token_ids == plain[0].token_ids and len(drafted[0].logprobs) == 20
    for got, want in zip(drafted[0].logprobs, plain[0].logprobs):
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[t] for t in want], list(want.values()), atol=1e-4)
    sampled = drafted[2]
    assert len(sampled.logprobs) == 20 and all(t in lp for t, lp in zip(sampled.token_ids, sampled.logprobs))


def test_logprobs_of_a_drafted_row_under_a_grammar() -> None:
    """Masked drafted positions report the masked distribution's logprobs, as without drafts."""
    import numpy as np

    params = SamplingParams(temperature=0, max_tokens=14, logprobs=2,
                            structured_outputs={"regex": "(1\\+2\\+){2}[0-9]{1,3}"})
    outs = []
    for spec in (None, NGRAM):
        with LLM(TINY_QWEN3, device="cpu", dtype="float32", kernels="torch", num_blocks=64,
                 speculative_config=spec) as llm:
            outs.append(llm.generate(["1+2+1+2+1+2="], params, use_tqdm=False)[0])
            accepted = llm.engine.stats.num_accepted_tokens
    assert accepted > 0 and outs[0].token_ids == outs[1].token_ids
    for want, got in zip(outs[0].logprobs, outs[1].logprobs):
        assert want.keys() == got.keys()
        np.testing.assert_allclose([got[t] for t in want], list(want.values()), atol=1e-4)
