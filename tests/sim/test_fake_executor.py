"""The fake executor on hand-made plans: writes and reads go through the block table."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

import sim.fake_executor as fake_executor_module
from minivllm.engine.plan import StepPlan
from minivllm.sampling import SamplingParams
from sim.fake_executor import FakeExecutor, PagingError, fake_next_token

V = 97
P = SamplingParams(temperature=0.0)


def plan(rows: list[tuple[int, list[int], int, tuple[int, ...], bool]], block_size: int = 4) -> StepPlan:
    """rows: (seq_id, fed tokens, start position, block table, sample)."""
    return StepPlan.build(
        seq_ids=[r[0] for r in rows], token_chunks=[r[1] for r in rows],
        start_positions=[r[2] for r in rows], block_tables=[r[3] for r in rows],
        sample=[r[4] for r in rows], sampling_params=[P] * len(rows), block_size=block_size,
    )


def test_fake_next_token_is_the_documented_hash() -> None:
    ctx = [3, 1, 4, 1, 5]
    want = xxhash.xxh64_intdigest(np.asarray(ctx, dtype=np.int64).tobytes()) % V
    assert fake_next_token(ctx, V) == want
    assert fake_next_token(np.array(ctx, dtype=np.int32), V) == want  # dtype-independent
    assert fake_next_token(ctx + [-1], V) != fake_next_token(ctx + [0], V)


def test_prefill_writes_through_the_block_table_and_samples() -> None:
    ex = FakeExecutor(V, block_size=4, num_blocks=4)
    res = ex.execute(plan([(7, [5, 6, 7, 8, 9], 0, (2, 0), True)]))
    assert ex.kv[2].tolist() == [5, 6, 7, 8]
    assert ex.kv[0].tolist() == [9, -1, -1, -1]
    assert (ex.kv[[1, 3]] == -1).all()
    assert res.sampled == {7: fake_next_token([5, 6, 7, 8, 9], V)}


def test_decode_reads_the_whole_context_back() -> None:
    ex = FakeExecutor(V, block_size=4, num_blocks=4)
    t = ex.execute(plan([(7, [5, 6, 7, 8, 9], 0, (2, 0), True)])).sampled[7]
    res = ex.execute(plan([(7, [t], 5, (2, 0), True)]))
    assert ex.kv[0].tolist() == [9, t, -1, -1]
    assert res.sampled == {7: fake_next_token([5, 6, 7, 8, 9, t], V)}


def test_unwritten_slots_read_as_minus_one() -> None:
    ex = FakeExecutor(V, block_size=4, num_blocks=4)
    # Claims 2 cached tokens that were never written.
    res = ex.execute(plan([(1, [42], 2, (3,), True)]))
    assert res.sampled == {1: fake_next_token([-1, -1, 42], V)}


def test_wrong_block_table_changes_the_output() -> None:
    def run(decode_table: tuple[int, ...]) -> int:
        ex = FakeExecutor(V, block_size=4, num_blocks=4)
        t = ex.execute(plan([(0, [1, 2, 3, 4, 5, 6], 0, (1, 2), True)])).sampled[0]
        return ex.execute(plan([(0, [t], 6, decode_table, True)])).sampled[0]

    right = run((1, 2))
    t = fake_next_token([1, 2, 3, 4, 5, 6], V)
    assert right == fake_next_token([1, 2, 3, 4, 5, 6, t], V)
    assert run((1, 3)) != right   # last block swapped: reads -1, -1, t
    assert run((0, 2)) != right   # first block swapped: reads -1s


def test_shared_prefix_block_is_read_by_both_and_non_samplers_return_nothing() -> None:
    ex = FakeExecutor(V, block_size=2, num_blocks=6)
    ex.execute(plan([(0, [10, 11, 12], 0, (4, 5), False)], block_size=2))
    res = ex.execute(plan([(0, [13], 3, (4, 5), True), (1, [20], 2, (4, 1), True),
                           (2, [30, 31], 0, (2,), False)], block_size=2))
    assert res.sampled == {0: fake_next_token([10, 11, 12, 13], V), 1: fake_next_token([10, 11, 20], V)}
    assert ex.kv[2].tolist() == [30, 31]


def test_plan_outside_the_pool_is_a_clear_error() -> None:
    ex = FakeExecutor(V, block_size=4, num_blocks=2)
    with pytest.raises(PagingError, match="outside the pool"):
        ex.execute(plan([(0, [1, 2], 0, (2,), True)]))
    with pytest.raises(PagingError, match="block size|block_size"):
        ex.execute(plan([(0, [1], 0, (0,), True)], block_size=2))


def test_two_different_tokens_in_one_slot_is_an_error() -> None:
    ex = FakeExecutor(V, block_size=4, num_blocks=2)
    with pytest.raises(PagingError, match="different tokens"):
        ex.execute(plan([(0, [1, 2], 0, (1,), True), (1, [1, 3], 0, (1,), True)]))
    # The same tokens (two sequences computing an equal block in one step) are fine.
    ex.execute(plan([(0, [1, 2], 0, (0,), True), (1, [1, 2], 0, (0,), True)]))


def test_uses_the_shared_prepare_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = fake_executor_module.prepare_inputs

    def spy(p: StepPlan):  # type: ignore[no-untyped-def]
        calls.append(p)
        return real(p)

    monkeypatch.setattr(fake_executor_module, "prepare_inputs", spy)
    p = plan([(0, [1], 0, (0,), True)])
    FakeExecutor(V, 4, 1).execute(p)
    assert calls == [p]


def test_num_kv_blocks_and_validation() -> None:
    assert FakeExecutor(V, 4, 9).num_kv_blocks() == 9
    with pytest.raises(ValueError):
        FakeExecutor(V, 4, 0)
