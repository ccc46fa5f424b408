"""executor/inputs.py against a per-token loop, on random plans (hypothesis)."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from minivllm.engine.plan import StepPlan
from minivllm.executor.inputs import padded_block_table, prepare_inputs
from minivllm.sampling import SamplingParams


@st.composite
def plans(draw: st.DrawFn) -> StepPlan:
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    pool = list(range(draw(st.integers(260, 400))))  # room for 6 x 42 tokens at bs 1
    n = draw(st.integers(1, 6))
    chunks, starts, tables, sample = [], [], [], []
    free = draw(st.permutations(pool))
    for _ in range(n):
        start = draw(st.integers(0, 30))
        q = draw(st.integers(1, 12))
        need = -(-(start + q) // bs)
        tables.append(tuple(free[:need]))
        free = free[need:]
        chunks.append(draw(st.lists(st.integers(0, 999), min_size=q, max_size=q)))
        starts.append(start)
        sample.append(draw(st.booleans()))
    return StepPlan.build(list(range(n)), chunks, starts, tables, sample,
                          [SamplingParams()] * n, bs)


@settings(max_examples=200, deadline=None)
@given(plans())
def test_prepare_inputs_matches_a_per_token_loop(plan: StepPlan) -> None:
    b = prepare_inputs(plan)
    pos, slots, last = [], [], []
    row0 = 0
    for r in range(plan.num_seqs):
        q, s = int(plan.query_lens[r]), int(plan.start_positions[r])
        for i in range(q):
            p = s + i
            pos.append(p)
            slots.append(plan.block_tables[r][p // plan.block_size] * plan.block_size + p % plan.block_size)
        row0 += q
        if plan.sample[r]:
            last.append(row0 - 1)
    assert b.positions.tolist() == pos
    assert b.slot_mapping.tolist() == slots
    assert b.sample_indices.tolist() == last
    assert b.cu_seqlens_q.tolist() == [0, *np.cumsum(plan.query_lens).tolist()]
    assert b.kv_lens.tolist() == (plan.start_positions + plan.query_lens).tolist()
    assert b.cu_seqlens_k.tolist() == [0, *np.cumsum(b.kv_lens).tolist()]
    assert len(set(slots)) == len(slots)  # distinct blocks -> distinct slots
    for r, t in enumerate(plan.block_tables):
        assert b.block_tables[r, :len(t)].tolist() == list(t)
        assert (b.block_tables[r, len(t):] == -1).all()


def test_uncovered_tokens_are_an_error() -> None:
    plan = StepPlan.build([0], [[1, 2, 3]], [2], [(5,)], [True], [SamplingParams()], 4)
    with pytest.raises(ValueError, match="does not cover"):
        prepare_inputs(plan)


def test_padded_block_table_width() -> None:
    assert padded_block_table(((1, 2), ()), width=3).tolist() == [[1, 2, -1], [-1, -1, -1]]
    with pytest.raises(ValueError, match="width"):
        padded_block_table(((1, 2, 3),), width=2)
