"""Hybrid models in the simulator: a recurrent state per running sequence (a state slot)
beside the paged KV cache, and state snapshots at block boundaries for prefix-cache hits.

The fake executor's hybrid model hashes each context followed by the fold the row's slot
holds, so any state the engine hands over wrongly changes a token the oracle (which folds
the plain token list) predicts. Random hybrid traces through the real engine in both
scheduling modes, with preemption, chunked prefill, prefix hits, aborts, n > 1, drafts and
grammars as the traces draw them; the bugs a state cache invites, each of which the checks
must catch; and the state cache's own rules."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from minivllm.engine.block_manager import InvariantError
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.sequence import Sequence
from minivllm.engine.state_cache import STATE_CONTINUE, STATE_RESET, StateCache
from minivllm.sampling import SamplingParams
from sim.fake_executor import FOLD_EMPTY, FakeExecutor, PagingError, fold_tokens, hybrid_context
from sim.runner import _Run
from sim.traces import generate_trace

# Hybrid traces in test_random_traces_of_hybrid_models: CHUNKS x TRACES_PER_CHUNK, half with one step
# in flight; a quarter of make sim's random traces are hybrid too.
CHUNKS, TRACES_PER_CHUNK = 8, 250


def _trace(seed: int, **overrides):
    return generate_trace(seed, {"hybrid": True, "async_scheduling": seed % 2 == 0, **overrides})


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_traces_of_hybrid_models(chunk: int) -> None:
    """Every output equals the oracle's and every invariant holds after every step; over the
    chunk, prefix hits resumed from snapshots and sequences were preempted."""
    resumed = preempted = 0
    for seed in range(30_000 + chunk * TRACES_PER_CHUNK, 30_000 + (chunk + 1) * TRACES_PER_CHUNK):
        run = _Run(_trace(seed), "check", None)
        result = run.run()
        assert result.ok, f"seed {seed}: {result.violations[:3]}"
        resumed += run.engine.stats.num_cached_tokens > 0
        preempted += run.engine.stats.num_preemptions
    assert resumed > TRACES_PER_CHUNK // 10 and preempted > 0, (resumed, preempted)


def _failures(monkeypatch: pytest.MonkeyPatch, **overrides) -> list[int]:
    """Seeds of the first 200 hybrid traces that fail (stopping at the tenth)."""
    found = []
    for seed in range(200):
        if not _Run(_trace(seed, **overrides), "check", None).run().ok:
            found.append(seed)
            if len(found) == 10:  # caught: the other traces cannot change the verdict
                break
    return found


def test_checks_catch_a_reused_slot_not_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    real = StateCache.take_slot

    def take_slot(self, seq, restore):
        real(self, seq, restore)
        if seq.state_init == STATE_RESET:
            seq.state_init = STATE_CONTINUE  # the last holder's state stays
    monkeypatch.setattr(StateCache, "take_slot", take_slot)
    assert len(_failures(monkeypatch)) >= 10


def test_checks_catch_a_snapshot_restored_one_block_off(monkeypatch: pytest.MonkeyPatch) -> None:
    real = StateCache.take_slot

    def take_slot(self, seq, restore):
        if restore is not None:  # the snapshot of the block before the hit's last, where there is one
            by_snap = {s: h for h, s in self.snapshot_of.items()}
            at = seq.block_hashes.index(by_snap[restore])
            if at and seq.block_hashes[at - 1] in self.snapshot_of:
                restore = self.snapshot_of[seq.block_hashes[at - 1]]
        real(self, seq, restore)
    monkeypatch.setattr(StateCache, "take_slot", take_slot)
    assert len(_failures(monkeypatch)) >= 10


def test_checks_catch_a_snapshot_taken_before_its_blocks_last_token(monkeypatch: pytest.MonkeyPatch) -> None:
    real = LLMEngine._snapshot_saves

    def saves(self, state, seq, start, end):
        return tuple((offset - 1, snap) if offset > 1 else (offset, snap)
                     for offset, snap in real(self, state, seq, start, end))
    monkeypatch.setattr(LLMEngine, "_snapshot_saves", saves)
    assert len(_failures(monkeypatch)) >= 10


def test_checks_catch_two_rows_slots_swapped(monkeypatch: pytest.MonkeyPatch) -> None:
    real = LLMEngine._build_plan

    def build(self, out):
        plan = real(self, out)
        if plan.num_seqs < 2:
            return plan
        slots = plan.state_slots.copy()
        slots[[0, 1]] = slots[[1, 0]]
        slots.setflags(write=False)
        return dataclasses.replace(plan, state_slots=slots)
    monkeypatch.setattr(LLMEngine, "_build_plan", build)
    assert len(_failures(monkeypatch)) >= 10


def test_checks_catch_a_preempted_sequence_resuming_with_its_old_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recomputed sequence (it has completion tokens) continues from its slot as it is: the
    slot it had, freed last, is the one it takes again."""
    real = StateCache.take_slot

    def take_slot(self, seq, restore):
        real(self, seq, restore)
        if seq.num_output_tokens:
            seq.state_init = STATE_CONTINUE
    monkeypatch.setattr(StateCache, "take_slot", take_slot)
    assert len(_failures(monkeypatch)) >= 10


# ---- the state cache's own rules ---------------------------------------------------------------

def _seq(n: int, prompt: int = 10) -> Sequence:
    return Sequence(n, f"r{n}", list(range(prompt)), SamplingParams(max_tokens=4))


def test_snapshot_boundaries_follow_the_rule() -> None:
    """Every interval-th full block in (start, end], and the prompt's last full block."""
    state = StateCache(2, 4, snapshot_interval=3)
    seq = _seq(0, prompt=22)  # block size 4: the prompt's last full block is the 5th
    assert state.boundaries(seq, 0, 22, 4) == [3, 5]
    assert state.boundaries(seq, 12, 30, 4) == [5, 6]   # 12 is block 3's end, not in (12, 30]
    assert state.boundaries(seq, 13, 14, 4) == []


def test_reserved_snapshots_bind_to_hashes_or_go_back_and_are_evicted_with_them() -> None:
    state = StateCache(2, 2, snapshot_interval=1)
    a, b = _seq(0), _seq(1)
    state.take_slot(a, None)
    state.take_slot(b, None)
    sa, sb = state.reserve(a, 1, _never), state.reserve(b, 1, _never)
    assert {sa, sb} == {0, 1} and state.reserve(a, 2, _never) is None  # the pool is empty
    state.bind(a, [111, 222], 2)
    state.bind(b, [111], 1)  # an equal prefix has its snapshot: b's goes back
    assert state.snapshot_of == {111: sa} and state.free_snapshots == [sb] and not b.pending_snapshots
    assert state.deepest([111, 222]) == 1 and state.deepest([333]) == 0
    state.drop(111)
    assert state.snapshot_of == {} and sorted(state.free_snapshots) == [0, 1]
    state.release(a)
    state.release(b)
    assert sorted(state.free_slots) == [0, 1] and a.state_slot is None and not state.check([], set())


def _never(block_hash: int) -> bool:
    return False


def test_a_full_pool_gives_up_its_oldest_snapshot_of_a_block_nobody_holds() -> None:
    state = StateCache(1, 2, snapshot_interval=1)
    a = _seq(0)
    state.take_slot(a, None)
    for blocks, h in ((1, 11), (2, 22)):
        state.reserve(a, blocks, _never)
        state.bind(a, [11, 22], blocks)
    assert state.snapshot_of == {11: 0, 22: 1} or state.snapshot_of == {11: 1, 22: 0}
    assert state.reserve(a, 3, _never) is None                 # both blocks in use: nothing to give up
    snap = state.reserve(a, 3, lambda h: h == 22)              # only 22's block is free
    assert snap is not None and 22 not in state.snapshot_of and 11 in state.snapshot_of
    assert a.pending_snapshots == {3: snap}


def _run_alone(engine: LLMEngine, params: SamplingParams, rid: str, prompt: list[int]) -> int:
    """Run one request to its end alone, invariants checked each step; its num_cached_tokens."""
    engine.add_request(rid, prompt, params)
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            cached = max(cached, out.num_cached_tokens)
        engine.check_invariants()
    return cached


def test_hits_resume_after_the_snapshot_pool_filled() -> None:
    """Two snapshots and prompts of new prefixes one after another: each new prompt's
    boundaries take snapshots from finished ones, so a prompt sharing the latest prefix still
    resumes from one (a pool that only filled would make every later hit recompute all)."""
    from minivllm.config import CacheConfig, SchedulerConfig

    engine = LLMEngine(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64),
                       CacheConfig(block_size=4, num_blocks=64, state_snapshot_interval=2),
                       FakeExecutor(50, 4, 64, state_slots=2, state_snapshots=2))
    run = functools.partial(_run_alone, engine, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    for i in range(4):
        assert run(f"p{i}", [10 + i] * 12) == 0
    assert run("again", [13] * 12 + [1, 2]) == 12  # the snapshot at the newest prompt's last full block


def test_a_branch_point_gets_a_snapshot_and_the_next_prompt_on_it_resumes_there() -> None:
    """Prompts on a shared 12-token prefix (3 blocks of 4), snapshots every 100 blocks: the
    first snapshots only its own last full block; the second finds the prefix's K/V cached
    but no snapshot in it, so it recomputes and snapshots where its prompt branches off; the
    third resumes from that snapshot. Outputs as the oracle's (the executor checks them)."""
    from minivllm.config import CacheConfig, SchedulerConfig

    engine = LLMEngine(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64),
                       CacheConfig(block_size=4, num_blocks=64, state_snapshot_interval=100),
                       FakeExecutor(50, 4, 64, state_slots=2, state_snapshots=8))
    shared = [7, 8, 9, 10] * 3

    run = functools.partial(_run_alone, engine, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert run("a", shared + [1] * 6) == 0
    assert run("b", shared + [2] * 6) == 0   # K/V of 12 tokens cached, no state there yet
    assert run("c", shared + [3] * 6) == 12


def test_invariants_catch_a_slot_held_twice_and_a_stale_snapshot() -> None:
    state = StateCache(2, 1, snapshot_interval=1)
    a, b = _seq(0), _seq(1)
    state.take_slot(a, None)
    b.state_slot = a.state_slot
    assert any("two live sequences" in e for e in state.check([a, b], set()))
    state.snapshot_of[5] = state.free_snapshots.pop()
    assert any("no block carries" in e for e in state.check([a], set()))


def test_admission_waits_for_a_state_slot() -> None:
    """One slot and two requests: the second runs only once the first has finished."""
    from minivllm.config import CacheConfig, SchedulerConfig

    ex = FakeExecutor(50, 4, 32, state_slots=1)
    engine = LLMEngine(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32),
                       CacheConfig(block_size=4, num_blocks=32), ex)
    for r in ("a", "b"):
        engine.add_request(r, [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    running = []
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
        running.append(len(engine.scheduler.running))
    assert max(running) == 1


def test_the_fake_executor_refuses_a_bad_state_plan() -> None:
    """A hybrid executor refuses a plan without state slots, and a plain one a plan with them;
    two rows on one slot and a snapshot saved past the known tokens are errors."""
    from minivllm.engine.plan import StepPlan

    def plan(slots, saves=None, num_drafts=None):
        n = len(slots)
        return StepPlan.build(list(range(n)), [[1, 2, 3]] * n, [0] * n, [(i,) for i in range(n)], [True] * n,
                              [SamplingParams(temperature=0)] * n, 4, state_slots=slots,
                              state_init=[STATE_RESET] * n, state_saves=saves, num_drafts=num_drafts)
    with pytest.raises(PagingError, match="without state slots"):
        FakeExecutor(50, 4, 8, state_slots=2).execute(StepPlan.build([0], [[1]], [0], [(0,)], [True],
                                                                     [SamplingParams()], 4))
    with pytest.raises(PagingError, match="model without recurrent state"):
        FakeExecutor(50, 4, 8).execute(plan([0]))
    with pytest.raises(PagingError, match="share a state slot"):
        FakeExecutor(50, 4, 8, state_slots=2).execute(plan([1, 1]))
    with pytest.raises(PagingError, match="known fed tokens"):
        FakeExecutor(50, 4, 8, state_slots=2, state_snapshots=1).execute(plan([0], saves=[((3, 0),)],
                                                                              num_drafts=[2]))


def test_the_hybrid_fake_model_reads_the_fold_from_the_slot() -> None:
    """A reset slot gives the oracle's token; a slot that continues with garbage does not."""
    from minivllm.engine.plan import StepPlan
    from sim.fake_executor import fake_next_token

    prompt = [4, 8, 15, 16]
    want = fake_next_token(hybrid_context(prompt), 50)
    assert hybrid_context(prompt)[-1] == fold_tokens(FOLD_EMPTY, prompt)
    for init, equal in ((STATE_RESET, True), (STATE_CONTINUE, False)):
        p = StepPlan.build([0], [prompt], [0], [(0,)], [True], [SamplingParams(temperature=0)], 4,
                           state_slots=[0], state_init=[init])
        assert (FakeExecutor(50, 4, 8, state_slots=1).execute(p).sampled[0] == want) == equal


def test_the_engine_invariants_see_a_waiting_sequence_with_a_slot() -> None:
    from minivllm.config import CacheConfig, SchedulerConfig

    engine = LLMEngine(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=32),
                       CacheConfig(block_size=4, num_blocks=16), FakeExecutor(50, 4, 16, state_slots=2))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    engine.scheduler.waiting[0].state_slot = 1
    with pytest.raises(InvariantError, match="not bare"):
        engine.check_invariants()
