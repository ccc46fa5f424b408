"""Requests with ``n > 1`` completions and with logprobs, through the real engine on the
fake executor: the prompt is computed once, every completion is reported under its
index, aborts end all of them, and a request asking for prompt logprobs computes its
whole prompt. (The random traces check the outputs against the oracle; these pin the
sharing and the bookkeeping, which outputs alone cannot show.)"""

from __future__ import annotations

import pytest

from minivllm.sampling import SamplingParams
from sim.oracle import fake_logprobs_dict
from tests.engine.test_engine import VOCAB, greedy_tokens, make_engine

PROMPT = list(range(1, 15))  # 14 tokens: 3 full blocks of 4 and 2 more


def run(engine) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
        engine.check_invariants()
    return outs


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_n_completions_share_the_prompt(async_scheduling: bool) -> None:
    engine = make_engine(num_blocks=32, block_size=4)
    engine.set_async_scheduling(async_scheduling)
    engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=5, n=3, ignore_eos=True))
    final = {o.index: o for o in run(engine) if o.finished}
    assert sorted(final) == [0, 1, 2]
    assert all(o.request_id == "r" and list(o.token_ids) == greedy_tokens(PROMPT, 5) for o in final.values())
    # The first computes the prompt; the others hit its 3 full blocks and compute 2 tokens.
    assert engine.stats.num_cached_tokens == 2 * 12
    assert engine.stats.num_prefill_tokens == 14 + 2 * 2
    assert engine.num_free_blocks == 32


def test_n_completions_with_a_seed_are_seeded_apart() -> None:
    # The engine derives sample i's seed (seed + i); the fake model ignores seeds, so
    # check the params the plans carried.
    engine = make_engine()
    seen = {}
    submit = engine.executor.submit

    def spy(plan):
        for sid, p in zip(plan.seq_ids, plan.sampling_params):
            seen[sid] = p.seed
        return submit(plan)

    engine.executor.submit = spy
    engine.add_request("r", PROMPT, SamplingParams(temperature=1.0, seed=7, max_tokens=2, n=3))
    run(engine)
    assert sorted(seen.values()) == [7, 8, 9]


@pytest.mark.parametrize("when", ["before_spawn", "after_spawn"])
def test_abort_ends_every_completion(when: str) -> None:
    engine = make_engine()
    engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=20, n=3, ignore_eos=True))
    steps = 0 if when == "before_spawn" else 3
    for _ in range(steps):
        engine.step()
    assert engine.abort_request("r")
    outs = run(engine)
    aborts = {o.index: o for o in outs if o.finish_reason == "abort"}
    assert sorted(aborts) == [0, 1, 2]
    assert not engine.abort_request("r")  # finished now
    assert engine.num_free_blocks == 32


def test_a_request_id_stays_taken_while_any_completion_runs() -> None:
    engine = make_engine()
    engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=1, n=2, ignore_eos=True))
    outs = []
    while not any(o.finished and o.index == 0 for o in outs):
        outs.extend(engine.step())
    assert not any(o.finished and o.index == 1 for o in outs)  # created when the first finished
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("r", PROMPT, SamplingParams())
    run(engine)
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("r", PROMPT, SamplingParams())


def test_logprobs_follow_the_tokens_and_prompt_logprobs_skip_the_cache() -> None:
    engine = make_engine()
    engine.add_request("warm", PROMPT, SamplingParams(temperature=0, max_tokens=1))
    run(engine)
    cached_before = engine.stats.num_cached_tokens
    engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                   logprobs=2, prompt_logprobs=1))
    (out,) = [o for o in run(engine) if o.finished]
    assert engine.stats.num_cached_tokens == cached_before  # the cached prompt was not read
    tokens = greedy_tokens(PROMPT, 3)
    assert list(out.token_ids) == tokens
    assert list(out.logprobs) == [fake_logprobs_dict(PROMPT + tokens[:i], t, 2, VOCAB) for i, t in enumerate(tokens)]
    assert len(out.logprobs[0]) == 2  # the sampled token is the most likely: top 2 hold it
    assert out.prompt_logprobs[0] is None
    assert list(out.prompt_logprobs[1:]) == [fake_logprobs_dict(PROMPT[:j], PROMPT[j], 1, VOCAB)
                                             for j in range(1, len(PROMPT))]
