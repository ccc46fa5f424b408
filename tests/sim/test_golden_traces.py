"""Replay every recorded trace in fixtures/traces/ and check what each golden trace is about.

Each golden trace pins a known failure case of the original design; besides the
step-by-step replay, the tests below assert the decision that matters there.
To re-record one after an intended scheduler change:
``python -m sim record --trace fixtures/traces/X.jsonl --out fixtures/traces/X.jsonl``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from minivllm.engine.trace import ExpectEvent, Trace, load
from sim.runner import RunResult, run_trace

TRACES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"
FILES = sorted(TRACES.glob("*.jsonl"))


def replay(name: str) -> tuple[Trace, RunResult]:
    trace = load(TRACES / f"{name}.jsonl")
    result = run_trace(trace, "replay")
    assert result.ok, (result.mismatch_step, result.mismatch, result.violations)
    return trace, result


def first_scheduled(trace: Trace) -> dict[str, int]:
    """Request id -> the first step it was scheduled in."""
    first: dict[str, int] = {}
    for e in trace.expects:
        for rid in e.scheduled:
            first.setdefault(rid, e.step)
    return first


def step(trace: Trace, n: int) -> ExpectEvent:
    return next(e for e in trace.expects if e.step == n)


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_replay_matches(path: Path) -> None:
    trace = load(path)
    result = run_trace(trace, "replay" if trace.expects else "check")
    assert result.mismatch is None, f"{path.name}: step {result.mismatch_step}: {result.mismatch}"
    assert not result.violations, result.violations


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_golden_inputs_in_the_other_mode(path: Path) -> None:
    """Decisions differ between modes, outputs do not: each golden trace's inputs run in the
    other mode too, judged by the oracle and the invariants."""
    trace = load(path)
    other = dataclasses.replace(trace, expects=(), scheduler=dataclasses.replace(
        trace.scheduler, async_scheduling=not trace.scheduler.async_scheduling))
    result = run_trace(other)
    assert result.ok, result.violations


def test_golden_set_is_present() -> None:
    names = {p.stem for p in FILES}
    assert {"pool_full_at_next_token", "budget_cuts_prefill_batch", "budget_cuts_prefill_batch_chunked",
            "tail_preemption_most_recent", "shared_prefix_three_seqs", "append_boundary_new_block",
            "exact_budget_fit", "prefill_remainder_one_token", "async_free_retired_after_step",
            "async_no_preemption_in_flight", "async_nothing_past_max_tokens", "async_abort_drops_sample",
            "async_register_after_step"} <= names


def test_pool_full_at_next_token_preempts_instead_of_losing() -> None:
    trace, result = replay("pool_full_at_next_token")
    preempting = [e for e in trace.expects if e.preempted]
    assert [(e.scheduled, e.preempted) for e in preempting] == [({"a": 1}, ("b",))]
    assert preempting[0].free_blocks == 1
    assert result.outputs["b"].finish_reason == "length" and len(result.outputs["b"].token_ids) == 4


def test_budget_cut_keeps_the_sequence_waiting() -> None:
    trace, result = replay("budget_cuts_prefill_batch")
    assert step(trace, 0).scheduled == {"a": 5}
    assert step(trace, 1).scheduled == {"b": 5, "c": 2}
    assert set(result.outputs) == {"a", "b", "c"}
    trace, result = replay("budget_cuts_prefill_batch_chunked")
    assert step(trace, 0).scheduled == {"a": 5, "b": 3}
    assert step(trace, 1).scheduled == {"a": 1, "b": 3, "c": 2}
    assert result.chunked_prefills >= 1 and set(result.outputs) == {"a", "b", "c"}


def test_tail_preemption_picks_the_most_recently_admitted() -> None:
    trace, _ = replay("tail_preemption_most_recent")
    admitted = first_scheduled(trace)
    assert admitted["a"] < admitted["b"] < admitted["c"]
    first = next(e for e in trace.expects if e.preempted)
    # All three were running; 'a' needed a block; the tail 'c' goes, not 'b'.
    assert set(step(trace, first.step - 1).scheduled) == {"a", "b", "c"}
    assert first.preempted == ("c",) and "a" in first.scheduled and "b" in first.scheduled


def test_shared_prefix_is_computed_once_and_blocks_are_shared() -> None:
    trace, result = replay("shared_prefix_three_seqs")
    first = first_scheduled(trace)
    assert step(trace, first["a"]).scheduled["a"] == 9
    assert step(trace, first["b"]).scheduled["b"] == 1
    assert step(trace, first["c"]).scheduled["c"] == 1
    assert result.cached_tokens == 16
    # 16 blocks: 'a' holds 3, 'b' and 'c' share its 2 prefix blocks and add 1 each.
    assert step(trace, first["c"]).free_blocks == 16 - 5


def test_append_at_block_boundary_needs_a_new_block() -> None:
    trace, result = replay("append_boundary_new_block")
    # Prefill: 4 tokens = 1 full block each; 1 of 3 blocks left.
    assert step(trace, 0).scheduled == {"a": 4, "b": 4} and step(trace, 0).free_blocks == 1
    # 5 tokens (5 % 4 == 1): feeding the 5th needs a block: 'a' takes the last, 'b' preempts itself.
    s1 = step(trace, 1)
    assert s1.scheduled == {"a": 1} and s1.preempted == ("b",) and s1.free_blocks == 1
    assert {o.finish_reason for o in result.outputs.values()} == {"length"}


def test_exact_budget_fit_is_scheduled_in_the_same_step() -> None:
    trace, _ = replay("exact_budget_fit")
    s1 = step(trace, 1)
    assert s1.scheduled == {"a": 1, "b": 7}
    assert (s1.prefill_tokens, s1.decode_tokens) == (7, 1)


def test_one_token_prefill_remainder_is_prefill() -> None:
    trace, result = replay("prefill_remainder_one_token")
    assert [(e.prefill_tokens, e.decode_tokens) for e in trace.expects] == [(5, 0), (1, 0), (0, 1), (0, 1)]
    assert (result.prefill_tokens, result.decode_tokens) == (6, 2)


def test_trace_recorded_on_an_h200_replays_on_the_cpu() -> None:
    """Real traffic on the GPU (``python3 -m benchmarks.record_trace`` on one H200, CUDA
    graphs, one step in flight: tiny Qwen3, seeded sampling, n = 2, a stop string, an
    abort, a pool small enough to preempt) replays decision for decision here on the
    recorded tokens; the hash model in their place diverges, so the replay rests on them."""
    trace, result = replay("live_h200_tiny_qwen3")
    assert trace.fake_model == "recorded" and trace.scheduler.async_scheduling
    assert result.steps == len(trace.expects) and result.preemptions > 0 and result.aborts == 1
    assert result.cached_tokens > 0 and result.chunked_prefills > 0
    hashed = run_trace(dataclasses.replace(trace, fake_model="hash"), "replay")
    assert hashed.mismatch is not None
