"""Structured outputs in the simulator: the fake grammar backend, random traces with grammars
through the real engine in both scheduling modes, and the bugs one step in flight invites
(a mask one step late, on the wrong row, or missing), each of which the checks must catch."""

from __future__ import annotations

import itertools
import random
import re

import numpy as np
import pytest

from minivllm.engine.grammar import allowed_tokens, bitmask_width
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.trace import loads
from minivllm.sampling import SamplingParams, StructuredOutputs
from sim import runner
from sim.grammar import FakeGrammarBackend, FakeRegex
from sim.runner import run_trace
from sim.traces import _draw_grammar, generate_trace

# Traces per scheduling mode in test_random_traces_with_grammars (x 2 modes); make sim runs
# 10,000 more, a quarter of whose requests that can have a grammar get one.
NUM_TRACES = 500


def test_fake_regex_agrees_with_python_re() -> None:
    rng = random.Random(0)
    patterns = ["(ab|cd)*e", "a[b-d]?c+", ".a|b*", "((a|b)c)+", "abc", "(a)|(bc)|(bcd)"]
    patterns += [g["regex"] for g in (_draw_grammar(rng) for _ in range(400)) if g and "regex" in g][:30]
    for pattern in patterns:
        compiled = FakeRegex(pattern)
        for n in range(5):
            for chars in itertools.product("abcde", repeat=n):
                text = "".join(chars)
                assert compiled.fullmatch(text) == bool(re.fullmatch(pattern, text)), (pattern, text)


@pytest.mark.parametrize("pattern", ["a(b", "a)", "[k]", "A", "[c-a]", "a{2}"])
def test_fake_regex_refuses_what_it_does_not_support(pattern: str) -> None:
    with pytest.raises(ValueError, match="regex"):
        FakeRegex(pattern)


def test_fake_matcher_masks_and_ends_with_eos() -> None:
    vocab, eos = 40, 3  # eos reads as no letter
    backend = FakeGrammarBackend(vocab, eos)
    m = backend.matcher(StructuredOutputs(choice=("ab", "b")))
    mask = np.zeros((1, bitmask_width(vocab)), dtype=np.int32)
    m.fill_bitmask(mask, 0)
    assert allowed_tokens(mask[0], vocab).tolist() == [0, 1, 10, 11, 20, 21, 30, 31]  # a or b, no eos
    assert m.accept_token(11) and not m.accept_token(13)  # "b", then "d" is refused
    m.fill_bitmask(mask, 0)
    assert allowed_tokens(mask[0], vocab).tolist() == [eos]  # "b" is whole: only eos
    assert m.accept_token(eos) and m.is_terminated() and not m.accept_token(0)
    with pytest.raises(ValueError, match="regex and choice"):
        backend.matcher(StructuredOutputs(json_object=True))


def _has_grammar(trace) -> bool:
    return any(getattr(e, "sampling", None) is not None and e.sampling.structured_outputs is not None
               for e in trace.events)


def _grammar_traces(n: int, start: int = 0):
    seeds = (s for s in itertools.count(start) if _has_grammar(generate_trace(s)))
    return list(itertools.islice(seeds, n))


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_random_traces_with_grammars(async_scheduling: bool) -> None:
    """Every output equals the oracle's (which samples under the same grammar, unpaged), and
    every constrained completion that ended with eos is a sentence of its grammar."""
    ended_by_eos = ended_by_length = 0
    for seed in _grammar_traces(NUM_TRACES):
        trace = generate_trace(seed, {"async_scheduling": async_scheduling})
        result = run_trace(trace)
        assert result.ok, f"seed {seed}: {result.violations[:3]}"
        for ev in trace.events:
            if getattr(ev, "sampling", None) is None or ev.sampling.structured_outputs is None:
                continue
            out = result.outputs.get(f"{ev.request_id}")
            if out is not None and out.finish_reason == "stop" and out.token_ids[-1] == trace.eos_token_id:
                ended_by_eos += 1
            elif out is not None and out.finish_reason == "length":
                ended_by_length += 1
    assert ended_by_eos > 200 and ended_by_length > 200, (ended_by_eos, ended_by_length)


# ---- the checks catch the bugs a mask invites ------------------------------------------

class _MaskBeforeApply(LLMEngine):
    """Fills step N+1's masks right after submitting it, before applying step N: one step late."""

    def _send_bitmask(self, step) -> None:  # the engine calls this after applying N; ignore that call
        pass

    def step(self):
        submit = self.executor.submit

        def submit_and_mask(plan):
            handle = submit(plan)
            if plan.num_masked_rows:
                masked = [c.seq if c.seq.grammar is not None else None for c in self._last_out.scheduled if c.samples]
                bitmask = np.full((len(masked), bitmask_width(self.grammar_backend.vocab_size)), -1, np.int32)
                for row, seq in enumerate(masked):
                    if seq is not None:
                        seq.grammar.fill_bitmask(bitmask, row)
                handle.set_token_bitmask(bitmask)
            return handle
        self.executor.submit = submit_and_mask
        try:
            return super().step()
        finally:
            self.executor.submit = submit


class _MaskOnWrongRows(LLMEngine):
    """Gives the masks of the sampling rows in reverse order."""

    def _send_bitmask(self, step) -> None:
        handle = step.handle
        give = handle.set_token_bitmask
        handle.set_token_bitmask = lambda bitmask: give(bitmask[::-1].copy())
        super()._send_bitmask(step)


class _NoMask(LLMEngine):
    """Never gives a mask."""

    def _send_bitmask(self, step) -> None:
        step.masked = None


@pytest.mark.parametrize("engine", [_MaskBeforeApply, _MaskOnWrongRows, _NoMask])
def test_checks_catch_a_misplaced_mask(engine: type[LLMEngine], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "LLMEngine", engine)
    found = []
    for seed in _grammar_traces(200):
        trace = generate_trace(seed, {"async_scheduling": True})
        if not run_trace(trace).ok:
            found.append(seed)
            if len(found) == 10:  # caught: the other traces cannot change the verdict
                break
    assert len(found) >= 10, found


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_token_outside_the_grammar_stops_the_engine_naming_the_request(async_scheduling: bool) -> None:
    """An executor that samples as if unmasked (a model or sampler bug) must not let a
    constrained request run on off its grammar: the engine raises, naming the request,
    at the first such token, whichever scheduling mode carries the mask."""
    from sim.fake_executor import FakeExecutor
    from minivllm.config import CacheConfig, SchedulerConfig

    class IgnoresMask(FakeExecutor):
        def _compute(self, plan, inputs, bitmask):
            return super()._compute(plan, inputs, None)

    engine = LLMEngine(SchedulerConfig(max_model_len=64, async_scheduling=async_scheduling),
                       CacheConfig(block_size=4, num_blocks=32), IgnoresMask(50, 4, 32), eos_token_id=3,
                       grammar_backend=FakeGrammarBackend(50, 3))
    engine.add_request("free", [5, 6, 7], SamplingParams(max_tokens=8))
    engine.add_request("bound", [1, 2], SamplingParams(max_tokens=40, structured_outputs={"regex": "a"}))
    with pytest.raises(RuntimeError, match=r"'bound'.*sampled token \d+, which its grammar does not allow"):
        for _ in range(40):
            engine.step()


def test_trace_with_a_grammar_round_trips() -> None:
    seed = _grammar_traces(1)[0]
    trace = generate_trace(seed)
    again = loads(trace.dumps())
    assert again.events == trace.events and run_trace(again).ok


def test_engine_refuses_grammars_it_cannot_run() -> None:
    from sim.fake_executor import FakeExecutor
    from minivllm.config import CacheConfig, SchedulerConfig
    params = SamplingParams(max_tokens=4, structured_outputs={"regex": "ab"})
    cfg, cache = SchedulerConfig(max_model_len=32), CacheConfig(block_size=4, num_blocks=16)

    def engine(backend, eos):
        return LLMEngine(cfg, cache, FakeExecutor(50, 4, 16), eos_token_id=eos, grammar_backend=backend)
    with pytest.raises(ValueError, match="grammar backend"):
        engine(None, 3).add_request("r", [1, 2], params)
    with pytest.raises(ValueError, match="eos"):
        engine(FakeGrammarBackend(50, None), None).add_request("r", [1, 2], params)
    with pytest.raises(ValueError, match="'r'.*regex"):
        engine(FakeGrammarBackend(50, 3), 3).add_request("r", [1, 2], SamplingParams(
            structured_outputs={"regex": "a("}))
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a"})


def test_random_traces_under_xgrammar() -> None:
    """The same traces with xgrammar as engine's and oracle's grammar backend, over the fake
    vocabulary (token t reads as one letter, eos as none): the product's grammar engine in the
    simulator, both scheduling modes."""
    from minivllm.structured import XGrammarBackend
    from sim.oracle import fake_text

    backends = {}

    def xgrammar_for(trace):
        key = (trace.vocab_size, trace.eos_token_id)
        if key not in backends:
            vocab = ["" if t == trace.eos_token_id else fake_text([t]) for t in range(trace.vocab_size)]
            backends[key] = XGrammarBackend.for_vocab(vocab, [trace.eos_token_id])
        return backends[key]
    seeds = _grammar_traces(60)
    for i, seed in enumerate(seeds):
        trace = generate_trace(seed, {"async_scheduling": i % 2 == 0})
        result = run_trace(trace, grammar_backend=xgrammar_for(trace))
        assert result.ok, f"seed {seed}: {result.violations[:3]}"
