"""The engine's per-step shortcuts keep the outputs' meaning.

Each output's prompt and cumulative completion are built incrementally (the
prompt tuple once per sequence, the completion extended by the new tokens), and
the scheduler takes a short path for a decode into a block with a free slot.
These pin what the shortcuts must not change: an output already returned never
changes, its tuples are exactly the tokens at the time it was returned, and
decodes crossing block boundaries still get their blocks."""

from __future__ import annotations

import pytest

from minivllm.outputs import RequestOutput
from minivllm.sampling import SamplingParams
from tests.engine.test_engine import greedy_tokens, make_engine

PROMPT = list(range(1, 11))  # 10 tokens: 2 full blocks of 4 and 2 more


def frozen_copy(o: RequestOutput) -> tuple:
    """A deep copy of what a caller sees in ``o`` (lists, so no tuple is shared with it)."""
    return (list(o.prompt_token_ids), list(o.token_ids), list(o.new_token_ids),
            None if o.logprobs is None else [dict(d) for d in o.logprobs], o.finish_reason)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_outputs_already_returned_never_change(async_scheduling: bool) -> None:
    engine = make_engine(num_blocks=32, block_size=4, max_model_len=64)
    engine.set_async_scheduling(async_scheduling)
    engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=9, n=2, logprobs=1,
                                                   ignore_eos=True))
    returned: list[tuple[RequestOutput, tuple]] = []
    while engine.has_unfinished_requests():
        returned.extend((o, frozen_copy(o)) for o in engine.step())
        engine.check_invariants()
        for o, seen in returned:  # every earlier output, after every later step
            assert frozen_copy(o) == seen
    want = greedy_tokens(PROMPT, 9)
    for index in (0, 1):
        mine = [o for o, _ in returned if o.index == index]
        assert [len(o.token_ids) for o in mine] == list(range(1, 10))
        for o in mine:
            assert type(o.token_ids) is tuple and type(o.prompt_token_ids) is tuple
            assert o.prompt_token_ids == tuple(PROMPT)
            assert o.token_ids == tuple(want[:len(o.token_ids)])
            assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids)
        assert sum((o.new_token_ids for o in mine), ()) == mine[-1].token_ids
        assert mine[-1].finish_reason == "length"


def test_aborted_unspawned_completions_report_the_prompt() -> None:
    engine = make_engine()
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=5, n=3))
    engine.abort_request("r")  # before its prompt is computed: completions 1 and 2 never existed
    outs = engine.step()
    assert sorted(o.index for o in outs) == [0, 1, 2]
    assert all(o.prompt_token_ids == tuple(PROMPT) and o.token_ids == () and o.finish_reason == "abort"
               for o in outs)


@pytest.mark.parametrize("policy", ["mixed", "prefill_first"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_decodes_across_block_boundaries_get_their_blocks(policy: str, async_scheduling: bool) -> None:
    # block_size 4: the decodes fill blocks and cross into fresh ones many times; a
    # fast path that skipped an allocation would fail the block table invariants.
    engine = make_engine(num_blocks=32, block_size=4, policy=policy, max_model_len=64)
    engine.set_async_scheduling(async_scheduling)
    for i in range(3):
        engine.add_request(f"r{i}", PROMPT[:7 + i], SamplingParams(temperature=0, max_tokens=17,
                                                                   ignore_eos=True))
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            final[o.request_id] = o
        engine.check_invariants()
        for seq in engine.scheduler.running:
            assert len(seq.block_table) * 4 >= seq.num_computed_tokens
    for i in range(3):
        assert list(final[f"r{i}"].token_ids) == greedy_tokens(PROMPT[:7 + i], 17)
    assert engine.num_free_blocks == 32
