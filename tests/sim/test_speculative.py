"""Speculative decoding in the simulator: random traces with drafts (the fake proposer at hit
rates 0..1 and k 1..8, on the host or standing for a draft model on the device, and n-gram
lookup) through the real engine in both scheduling modes,
every output equal to the oracle's (which knows nothing of drafts); the bugs drafts invite,
each of which the checks must catch; and the n-gram proposer itself."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from minivllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.trace import loads
from minivllm.sampling import SamplingParams
from minivllm.spec.ngram import NgramProposer
from sim import runner
from sim.fake_executor import FakeExecutor, fake_next_token
from sim.fake_proposer import FakeProposer, make_proposer
from sim.runner import _Run, run_trace
from sim.traces import generate_trace

# Traces with drafts in test_random_traces_with_drafts: CHUNKS x TRACES_PER_CHUNK (half of
# them with one step in flight); make sim runs 10,000 more, 40% of them with drafts.
CHUNKS, TRACES_PER_CHUNK = 8, 250


def _speculative(seed: int, **overrides) -> dict:
    """A fake proposer's config for ``seed`` (k 1..8, hit rates 0..1), unless overridden."""
    rng = np.random.default_rng(seed)
    spec = {"method": "fake", "num_speculative_tokens": int(rng.integers(1, 9)),
            "hit_rate": float(rng.choice([0.0, 0.3, 0.6, 0.8, 0.9, 1.0]))}
    if seed % 3 == 1:  # a third stand for a draft model: drafts made by the executor in the step
        spec["on_device"] = True
    if seed % 5 == 0:  # some with n-gram lookup, on a tiny alphabet it can match
        spec = {"method": "ngram", "num_speculative_tokens": int(rng.integers(1, 6)), "prompt_lookup_min": 1,
                "prompt_lookup_max": 3}
    return {**spec, **overrides}


def _trace(seed: int, **overrides):
    return generate_trace(seed, {"speculative": _speculative(seed), "async_scheduling": seed % 2 == 0, **overrides})


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_traces_with_drafts(chunk: int) -> None:
    """Every output equals the oracle's and every invariant holds after every step, with
    preemption, chunked prefill, prefix caching, aborts, n > 1 and stops as the traces draw
    them; drafts were scored and both accepted and rejected."""
    scored = accepted = 0
    for seed in range(20_000 + chunk * TRACES_PER_CHUNK, 20_000 + (chunk + 1) * TRACES_PER_CHUNK):
        run = _Run(_trace(seed), "check", None)
        result = run.run()
        assert result.ok, f"seed {seed}: {result.violations[:3]}"
        scored += run.engine.stats.num_draft_tokens
        accepted += run.engine.stats.num_accepted_tokens
    assert 0.2 * scored < accepted < 0.9 * scored, (scored, accepted)


def test_drafts_change_how_many_steps_not_what_comes_out() -> None:
    """The same traces with every draft right take fewer steps than without drafts, and with
    every draft wrong no fewer (wrong drafts only take budget and blocks); the outputs are
    the oracle's every time."""
    steps = {}
    right = {"method": "fake", "num_speculative_tokens": 4, "hit_rate": 1.0}
    for name, spec in (("none", None), ("right", right), ("right on device", {**right, "on_device": True}),
                       ("wrong", {"method": "fake", "num_speculative_tokens": 4, "hit_rate": 0.0})):
        total = 0
        for seed in range(40):
            run = _Run(generate_trace(seed, {"speculative": spec, "async_scheduling": False}), "check", None)
            assert run.run().ok, (name, seed)
            total += run.engine.stats.num_steps
        steps[name] = total
    assert max(steps["right"], steps["right on device"]) < 0.8 * steps["none"] <= 0.8 * steps["wrong"], steps


def test_a_stop_inside_the_drafts_ends_the_request_there() -> None:
    """max_tokens 3 and a stop token at the second position, drafts of 4 all right: the
    completion is cut where it must be, and the blocks of everything after go back."""
    vocab = 50
    for first in range(100):
        prompt = [first, 6, 7]
        ctx, truth = list(prompt), []
        for _ in range(6):
            truth.append(fake_next_token(ctx, vocab))
            ctx.append(truth[-1])
        if truth[2] not in truth[:2]:
            break
    for params, want in ((SamplingParams(max_tokens=3, ignore_eos=True), truth[:3]),
                         (SamplingParams(max_tokens=6, ignore_eos=True, stop_token_ids=[truth[2]]), truth[:3])):
        engine = LLMEngine(SchedulerConfig(max_model_len=64), CacheConfig(block_size=2, num_blocks=16),
                           FakeExecutor(vocab, 2, 16), proposer=FakeProposer(4, 1.0, vocab))
        engine.add_request("r", prompt, params)
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
            engine.check_invariants()
        assert list(done[0].token_ids) == want and engine.num_free_blocks == 16
        assert engine.stats.num_draft_tokens >= 1


def test_a_trace_with_drafts_round_trips() -> None:
    trace = _trace(3)
    again = loads(trace.dumps())
    assert again.speculative == trace.speculative and again.events == trace.events and run_trace(again).ok


def test_ngram_lookup_takes_the_longest_latest_match() -> None:
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3))
    assert p.propose([[1, 2, 3, 4, 1, 2]], [3]) == [[3, 4, 1]]       # "1 2" matched at 0
    assert p.propose([[1, 2, 9, 5, 2, 7, 1, 2]], [3]) == [[9, 5, 2]]   # "1 2" beats the later "2"
    assert p.propose([[7, 1, 8, 1, 9, 1]], [2]) == [[9, 1]]            # the latest "1"
    assert p.propose([[1, 2, 3]], [3]) == [[]] and p.propose([[4, 4]], [0]) == [[]]
    assert p.propose([[5, 5, 5, 5]], [3]) == [[5]]                     # what follows ends at the context's end
    assert SpeculativeConfig(num_speculative_tokens=2).prompt_lookup_min == 5
    assert SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=3).prompt_lookup_min == 3
    with pytest.raises(ValueError, match="no stand-in"):  # a live trace's draft model: the simulator runs none
        make_proposer({"model": "/drafts", "num_speculative_tokens": 2}, 50)
    for bad, words in (({}, "num_speculative_tokens"), ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
                       ({"num_speculative_tokens": 2, "method": "eagle"}, "method"),
                       ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min")):
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig(**bad)


# ---- the checks catch the bugs drafts invite ------------------------------------------------

class _RollbackOneShort(LLMEngine):
    """Keeps the first rejected draft's K/V as if computed."""

    def _apply_drafts(self, seq, c, token, result):
        bm = self.scheduler.block_manager
        roll_back = bm.roll_back
        bm.roll_back = lambda s, n: roll_back(s, min(n + 1, s.num_computed_tokens))
        try:
            return super()._apply_drafts(seq, c, token, result)
        finally:
            bm.roll_back = roll_back


class _HashesRejected(LLMEngine):
    """Offers the blocks of every fed token to the prefix cache, rejected drafts included."""

    def _apply_drafts(self, seq, c, token, result):
        bm = self.scheduler.block_manager
        register = bm.register_computed_blocks
        bm.register_computed_blocks = lambda s, n: register(s, c.end)
        try:
            return super()._apply_drafts(seq, c, token, result)
        finally:
            bm.register_computed_blocks = register


class _AcceptedFromTheNextRow(LLMEngine):
    """Reads each drafted row's accepted count from the next drafted row's entry."""

    def _apply(self, out, result):
        counts = [result.num_accepted.get(c.seq.seq_id, 0) for c in out.scheduled if c.num_drafts]
        if len(counts) > 1:
            rows = [c for c in out.scheduled if c.num_drafts]
            counts = counts[1:] + counts[:1]
            shifted = {c.seq.seq_id: min(n, c.num_drafts) for c, n in zip(rows, counts)}
            result = dataclasses.replace(result, num_accepted={**result.num_accepted, **shifted})
        return super()._apply(out, result)


class _DraftsOfTheNextRow(LLMEngine):
    """Takes each row's drafts made on the device from the next such row's entry (cut or
    filled up to its own count)."""

    def _apply(self, out, result):
        rows = [c.seq.seq_id for c in out.scheduled if c.seq.seq_id in result.drafts]
        if len(rows) > 1:
            turned = rows[1:] + rows[:1]
            drafts = {sid: (result.drafts[nxt] + result.drafts[sid])[:len(result.drafts[sid])]
                      for sid, nxt in zip(rows, turned)}
            result = dataclasses.replace(result, drafts=drafts)
        return super()._apply(out, result)


class _StopsOnlyAtTheEnd(LLMEngine):
    """Judges a drafted row's finish on its last token only."""

    def _apply_drafts(self, seq, c, token, result):
        a = result.num_accepted.get(seq.seq_id, 0)
        run = seq.drafts[:a] + [token]
        seen = []
        finish = super()._finish_reason

        def last_only(s, t):
            seen.append(t)
            r = finish(s, t)
            return r if len(seen) == len(run) else (None, None)
        self._finish_reason = last_only
        try:
            return super()._apply_drafts(seq, c, token, result)
        finally:
            del self._finish_reason


class _MaskOnePositionLate(LLMEngine):
    """Gives a drafted row's position j the grammar's mask of position j - 1."""

    @staticmethod
    def _fill_drafted(matcher, drafts, bitmask, row):
        LLMEngine._fill_drafted(matcher, drafts, bitmask, row)
        bitmask[row + 1:row + 1 + len(drafts)] = bitmask[row:row + len(drafts)].copy()


@pytest.mark.parametrize("engine", [_RollbackOneShort, _HashesRejected, _AcceptedFromTheNextRow, _StopsOnlyAtTheEnd,
                                    _MaskOnePositionLate, _DraftsOfTheNextRow])
def test_checks_catch_a_broken_draft(engine: type[LLMEngine], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "LLMEngine", engine)
    found = [seed for seed in range(200) if not run_trace(_trace(seed)).ok]
    assert len(found) >= 10, found


class _Silent:
    """A proposer that never finds a draft, counting how often it is asked."""

    num_speculative_tokens = 4
    on_device = False

    def __init__(self) -> None:
        self.calls = 0

    def config(self) -> dict:
        return {"method": "ngram", "num_speculative_tokens": 4}

    def propose(self, contexts, max_drafts, names):
        self.calls += 1
        return [[] for _ in contexts]


def test_rounds_that_find_nothing_back_off_and_keep_a_step_in_flight() -> None:
    """Asked about every step while it finds nothing, a proposer would make every step wait
    for the one before: rounds without a draft double the wait (up to MAX_SPEC_BACKOFF steps),
    and the steps between keep one step in flight."""
    from minivllm.engine.llm_engine import MAX_SPEC_BACKOFF
    silent = _Silent()
    engine = LLMEngine(SchedulerConfig(max_model_len=256, async_scheduling=True),
                       CacheConfig(block_size=4, num_blocks=128), FakeExecutor(50, 4, 128), proposer=silent)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
    in_flight = 0
    while engine.has_unfinished_requests():
        engine.step()
        in_flight += engine._inflight is not None
    steps = engine.stats.num_steps
    assert silent.calls <= 6 + steps // MAX_SPEC_BACKOFF and in_flight > 0.9 * steps, (silent.calls, in_flight, steps)


def test_a_new_proposer_is_asked_at_once() -> None:
    """After misses have backed the engine off, setting a proposer (a new one, or the same
    again) asks it at the next step: the last one's misses say nothing about it."""
    silent = _Silent()
    engine = LLMEngine(SchedulerConfig(max_model_len=256), CacheConfig(block_size=4, num_blocks=128),
                       FakeExecutor(50, 4, 128), proposer=silent)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=60, ignore_eos=True))
    for _ in range(25):  # asked at steps 1, 3, 6, 11, 20 (waits 1, 2, 4, 8), next at 37
        engine.step()
    calls = silent.calls
    engine.step()
    assert silent.calls == calls == 5  # backing off
    fresh = _Silent()
    engine.proposer = fresh
    engine.step()
    assert fresh.calls == 1


@pytest.mark.parametrize("lo, hi", [(1, 3), (2, 4), (5, 5), (1, 1)])
def test_ngram_lookup_equals_a_brute_force_search(lo: int, hi: int) -> None:
    """Against every window compared in full, on small alphabets where matches abound."""
    def brute(tokens: np.ndarray, k: int) -> list[int]:
        size = len(tokens)
        for n in range(min(hi, size - 1), lo - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:size - 1], n)
            hits = np.flatnonzero((windows == tokens[size - n:]).all(axis=1))
            if hits.size:
                return tokens[int(hits[-1]) + n:int(hits[-1]) + n + k].tolist()
        return []
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=lo, prompt_lookup_max=hi))
    rng = np.random.default_rng(lo * 10 + hi)
    for _ in range(1500):
        tokens = rng.integers(0, rng.integers(2, 6), rng.integers(1, 40))
        assert p.lookup(tokens, 4) == brute(tokens, 4), tokens.tolist()


def test_ngram_lookup_keeps_each_context_and_extends_it() -> None:
    """With names, each context's copy grows by the new tokens only; the answers are those of
    a proposer that converts every context afresh (a shorter context under a known name, as a
    new sequence would bring, is converted afresh)."""
    cached = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3))
    fresh = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3))
    rng = np.random.default_rng(7)
    contexts = {f"s{i}": rng.integers(0, 4, 5).tolist() for i in range(6)}
    for step in range(40):
        for name, c in contexts.items():
            c.extend(rng.integers(0, 4, rng.integers(0, 3)).tolist())
        if step == 20:
            contexts["s0"] = [1, 2]
        names = [n for n in contexts if rng.random() < 0.8]
        got = cached.propose([contexts[n] for n in names], [3] * len(names), names)
        assert got == fresh.propose([contexts[n] for n in names], [3] * len(names))
        assert set(cached._arrays) == set(names)
