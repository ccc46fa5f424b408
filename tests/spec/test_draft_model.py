"""Speculative decoding with a draft model (CPU, float32): the draft runs in the target's
executor, its K/V in a cache of its own under the target's block tables. Greedy decoding
with drafts gives exactly the tokens without them (both scheduling modes, prefix-cache
hits, a pool that preempts, n > 1); the target as its own draft keeps >= 98% of the drafts,
which a draft cache that lags the target's (a skipped write, a stale slot) would not; a
perturbed copy keeps some and loses some; a draft model that cannot serve is refused by name."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import (conftest sets it too)

import pytest  # noqa: E402
import torch  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.testing import TinyConfig, make_hf_model, save_hf_model  # noqa: E402

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6] * 2, [7, 7, 8, 7, 7, 8, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
PARAMS = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, n=2),
          SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The target, and a copy of it with every weight perturbed (a draft that is often right)."""
    target = make_hf_model(TinyConfig(), seed=5)
    target_dir = save_hf_model(target, tmp_path_factory.mktemp("target"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in target.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.std())
    return target_dir, save_hf_model(target, tmp_path_factory.mktemp("perturbed"))


def _generate(path, speculative, pool=64):
    options = dict(skip_tokenizer_init=True, block_size=4, num_blocks=pool, max_num_seqs=4, max_model_len=64)
    outs = {}
    with LLM(path, device="cpu", dtype="float32", kernels="torch", speculative_config=speculative, **options) as llm:
        for mode in (False, True):
            llm.engine.set_async_scheduling(mode)
            for run in ("cold", "warm"):  # the second run hits the prefix cache
                outs[mode, run] = [o.token_ids
                                   for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        stats = llm.engine.stats
    return outs, stats


@pytest.fixture(scope="module")
def plain(models):
    outs, _ = _generate(models[0], None)
    assert len(set(map(str, outs.values()))) == 1
    return outs[False, "cold"]


@pytest.mark.parametrize("pool", [64, 12], ids=["roomy", "preempting"])
def test_the_target_as_its_own_draft_keeps_almost_every_draft(models, plain, pool: int) -> None:
    target, _ = models
    outs, stats = _generate(target, {"model": target, "num_speculative_tokens": 4}, pool)
    assert all(v == plain for v in outs.values())
    assert stats.num_cached_tokens > 0, stats
    assert stats.num_draft_tokens > 40, stats
    assert stats.num_accepted_tokens >= 0.98 * stats.num_draft_tokens, stats
    assert (stats.num_preemptions > 0) == (pool == 12), stats


def test_a_perturbed_draft_changes_how_many_steps_not_what_comes_out(models, plain) -> None:
    target, perturbed = models
    outs, stats = _generate(target, {"model": perturbed, "num_speculative_tokens": 3})
    assert all(v == plain for v in outs.values())
    assert 0.2 * stats.num_draft_tokens < stats.num_accepted_tokens < 0.95 * stats.num_draft_tokens, stats


def test_sampled_rows_and_rows_without_drafts_beside_drafted_ones(models) -> None:
    """A seeded sampled row replays; a row with penalties (no drafts) beside drafted ones keeps
    the draft's cache up: the drafted rows still keep nearly every draft."""
    target, _ = models
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=4, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3)]
    spec = {"model": target, "num_speculative_tokens": 3}
    with LLM(target, device="cpu", dtype="float32", kernels="torch", skip_tokenizer_init=True,
             block_size=4, num_blocks=64, max_model_len=64) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(target, device="cpu", dtype="float32", kernels="torch", skip_tokenizer_init=True,
             block_size=4, num_blocks=64, max_model_len=64, speculative_config=spec) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        again = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.token_ids for o in outs]
    assert got[0] == want[0] and got[2] == want[2] and again == got
    greedy, sampled, penalised = outs
    assert greedy.num_accepted_tokens >= 0.98 * greedy.num_draft_tokens > 10, greedy
    assert 0 < sampled.num_draft_tokens and penalised.num_draft_tokens == 0


def test_a_draft_model_that_cannot_serve_is_refused(models, tmp_path) -> None:
    target, _ = models
    other_vocab = save_hf_model(make_hf_model(TinyConfig(vocab_size=101), seed=1), tmp_path / "vocab")
    short = save_hf_model(make_hf_model(TinyConfig(max_position_embeddings=32), seed=1), tmp_path / "short")
    for draft, words in ((other_vocab, "vocab_size 101 is not the target's 97"),
                         (short, "max_position_embeddings 32 < max_model_len 64"),
                         (str(tmp_path / "none"), "none")):
        with pytest.raises((ValueError, FileNotFoundError, OSError), match=words):
            LLM(target, device="cpu", skip_tokenizer_init=True, max_model_len=64,
                speculative_config={"model": draft, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="prompt_lookup_max is for method 'ngram'"):
        LLM(target, device="cpu", skip_tokenizer_init=True,
            speculative_config={"model": target, "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="needs the draft model's directory"):
        LLM(target, device="cpu", skip_tokenizer_init=True,
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2})


def test_masked_rows_beside_rows_drafting_on_the_device() -> None:
    """A grammar row and a row under token rules take no drafts from the draft model; beside
    them a plain row and a row asking for logprobs do: every output as without drafts, in
    both scheduling modes, and the logprobs too."""
    import numpy as np

    fixture = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "tiny-qwen3")
    prompts = ["1+2+1+2+1+2=", "12+34=", "3+3+3+3=", "50+27="]
    params = [SamplingParams(temperature=0, max_tokens=12, structured_outputs={"regex": "(1\\+2\\+){2}[0-9]{1,3}"}),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, min_tokens=6, bad_words=["9"]),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)]
    runs = {}
    for name, spec in (("plain", None), ("drafted", {"model": fixture, "num_speculative_tokens": 3})):
        with LLM(fixture, device="cpu", dtype="float32", kernels="torch", num_blocks=64,
                 speculative_config=spec) as llm:
            for mode in (False, True):
                llm.engine.set_async_scheduling(mode)
                runs[name, mode] = llm.generate(prompts, params, use_tqdm=False)
    want = runs["plain", False]
    for mode in (False, True):
        got = runs["drafted", mode]
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert got[0].num_draft_tokens == got[2].num_draft_tokens == 0
        assert got[1].num_accepted_tokens >= 0.98 * got[1].num_draft_tokens > 0
        assert got[3].num_draft_tokens > 0
        for g, w in zip(got[3].logprobs, want[3].logprobs):
            assert g.keys() == w.keys()
            np.testing.assert_allclose([g[t] for t in w], list(w.values()), atol=1e-4)
