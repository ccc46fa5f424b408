"""``min_tokens`` and ``bad_words`` in the simulator: random traces with token rules through
the real engine in both scheduling modes, equal to the oracle's outputs and obeying the rules
themselves; and the bugs the rules invite, each of which the checks must catch."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.engine import llm_engine, token_rules
from minivllm.engine.grammar import ALL_ALLOWED, allowed_tokens, bitmask_width
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.trace import AddEvent
from minivllm.sampling import SamplingParams, eos_token_set, tokenize_bad_words
from sim import runner
from sim.fake_executor import FakeExecutor
from sim.oracle import FakeTextStream, fake_text
from sim.runner import run_trace
from sim.traces import generate_trace

# Traces per scheduling mode in test_random_traces_with_token_rules (x 2 modes); make sim runs
# 10,000 more, an eighth of whose requests get a rule.
NUM_TRACES = 150


def _ruled(trace) -> list[AddEvent]:
    return [e for e in trace.events if isinstance(e, AddEvent) and e.sampling.has_token_rules]


def _rule_traces(n: int, start: int = 0) -> list[int]:
    seeds = (s for s in itertools.count(start) if _ruled(generate_trace(s)))
    return list(itertools.islice(seeds, n))


def _contains(tokens: tuple[int, ...], word: tuple[int, ...]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_random_traces_with_token_rules(async_scheduling: bool) -> None:
    """Every output equals the oracle's, and the rules hold on their own terms: no completion
    without a grammar holds a bad word, or stops (eos, stop token, stop string) before
    ``min_tokens``. (That the rules bite, changing completions, is shown by
    ``test_checks_catch_a_broken_rule``'s "rules ignored".)"""
    checked = 0
    for seed in _rule_traces(NUM_TRACES):
        trace = generate_trace(seed, {"async_scheduling": async_scheduling})
        result = run_trace(trace)
        assert result.ok, f"seed {seed}: {result.violations[:3]}"
        eos = eos_token_set(trace.eos_token_id)
        for ev in _ruled(trace):
            p = ev.sampling
            out = result.outputs.get(ev.request_id)
            if out is None or p.structured_outputs is not None:
                continue
            tokens = tuple(out.token_ids)
            assert not any(_contains(tokens, w) for w in p.bad_words_token_ids), (seed, ev.request_id)
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else eos)
            assert not stops & set(tokens[:p.min_tokens]), (seed, ev.request_id)
            if out.finish_reason == "stop":
                assert len(tokens) > p.min_tokens, (seed, ev.request_id)
            checked += 1
    assert checked > 150, checked


def test_rules_ban_what_they_say() -> None:
    p = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[7], bad_words_token_ids=[[5], [1, 2, 3]])
    assert token_rules.banned_tokens(p, [], {9}) == {5, 7, 9}
    assert token_rules.banned_tokens(p, [4, 1], {9}) == {5}        # two tokens: min_tokens is met
    assert token_rules.banned_tokens(p, [1, 2], {9}) == {3, 5}     # the completion ends with 1 2
    assert token_rules.banned_tokens(p, [2], {9}) == {5, 7, 9}     # too short for the prefix
    ignoring = SamplingParams(max_tokens=8, min_tokens=1, ignore_eos=True)
    assert token_rules.banned_tokens(ignoring, [], {9}) == set()  # eos is no stop then
    assert token_rules.masks_position(p, 100) and not token_rules.masks_position(ignoring, 1)
    assert token_rules.masks_position(ignoring, 0)


def test_a_ban_never_empties_a_row() -> None:
    vocab = 70  # two words and 6 bits of a third
    mask = np.zeros((2, bitmask_width(vocab)), dtype=np.int32)
    mask[0, :] = ALL_ALLOWED
    token_rules.ban(mask, 0, [31, 64, 500], vocab)   # bit 31 of a word; 500: outside the vocabulary
    assert 31 not in allowed_tokens(mask[0], vocab) and 64 not in allowed_tokens(mask[0], vocab)
    assert len(allowed_tokens(mask[0], vocab)) == vocab - 2
    mask[1, 2] = 1 << 1  # only token 65 (a grammar that may only end, say), padding bits clear
    mask[1, 2] |= ~np.int32((1 << 6) - 1)  # and bits past the vocabulary set: still only 65
    token_rules.ban(mask, 1, [65], vocab)
    assert allowed_tokens(mask[1], vocab).tolist() == [65]


def test_bad_words_are_tokenized_with_and_without_a_leading_space() -> None:
    vocab = {"hi": [1], " hi": [2], "a b": [3, 4], " a b": [5, 4], "xy": [6, 7], " xy": [8]}
    encode = vocab.__getitem__
    assert tokenize_bad_words(["hi", " a b", "xy"], encode) == ((1,), (2,), (3, 4), (5, 4), (6, 7))
    with pytest.raises(ValueError, match="no token"):
        tokenize_bad_words(["zz"], lambda text: [])


def _engine(async_scheduling: bool = False, **kw) -> LLMEngine:
    return LLMEngine(SchedulerConfig(max_model_len=64, async_scheduling=async_scheduling),
                     CacheConfig(block_size=4, num_blocks=32), FakeExecutor(50, 4, 32), eos_token_id=3, **kw)


def _run(engine: LLMEngine) -> dict[str, tuple[int, ...]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = tuple(out.token_ids)
    return done


def test_the_engine_tokenizes_bad_words_and_checks_what_it_cannot_serve() -> None:
    engine = _engine(text_streams=FakeTextStream, vocab_size=50)
    free = _run_one(engine, "free", SamplingParams(max_tokens=6, ignore_eos=True))
    word = fake_text(free[2:4])  # two letters the free completion writes
    banned = _run_one(engine, "banned", SamplingParams(max_tokens=6, ignore_eos=True, bad_words=[word]))
    ids = tuple(FakeTextStream.encode(word))
    assert not _contains(banned, ids)
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        _engine(vocab_size=50).add_request("r", [1], SamplingParams(bad_words=["ab"]))
    with pytest.raises(ValueError, match="vocabulary size"):
        _engine().add_request("r", [1], SamplingParams(min_tokens=1))
    with pytest.raises(ValueError, match="bad_words_token_ids names token 50"):
        _engine(vocab_size=50).add_request("r", [1], SamplingParams(bad_words_token_ids=[[1, 50]]))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["ok", " "])


def _run_one(engine: LLMEngine, rid: str, params: SamplingParams) -> tuple[int, ...]:
    engine.add_request(rid, [11, 12, 13], params)
    return _run(engine)[rid]


# ---- the checks catch the bugs the rules invite -------------------------------------------

def _mask_one_short(params, num_output_before):
    return params.bad_words_token_ids != () or num_output_before < params.min_tokens - 1


def _one_more(params):
    return dataclasses.replace(params, min_tokens=params.min_tokens + 1,
                               max_tokens=max(params.max_tokens, params.min_tokens + 1))


def _ban_one_long(params, output, eos):
    return _BANNED(_one_more(params), output, eos) if params.min_tokens else _BANNED(params, output, eos)


def _prefix_ignored(params, output, eos):
    banned = set(params.stop_token_ids) | set(eos) if len(output) < params.min_tokens else set()
    return banned | {w[-1] for w in params.bad_words_token_ids}


def _stale_tail(params, output, eos):
    return _BANNED(params, output[:-1], eos)


_BANNED = token_rules.banned_tokens
_MASKS = token_rules.masks_position


class _StopStringsBeforeMinTokens(LLMEngine):
    @staticmethod
    def _stop_string_found(seq, token, search):
        return LLMEngine._stop_string_found(seq, token, True)


@pytest.mark.parametrize("bug", ["rules ignored", "min_tokens mask one short", "min_tokens ban one long", "bad word prefix ignored", "rules see a stale tail",
                                 "stop strings before min_tokens"])
def test_checks_catch_a_broken_rule(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if bug == "rules ignored":
        monkeypatch.setattr(llm_engine, "banned_tokens", lambda params, output, eos: set())
    elif bug == "min_tokens mask one short":
        monkeypatch.setattr(llm_engine, "masks_position", _mask_one_short)
    elif bug == "min_tokens ban one long":
        monkeypatch.setattr(llm_engine, "masks_position", lambda p, n: _MASKS(_one_more(p) if p.min_tokens else p, n))
        monkeypatch.setattr(llm_engine, "banned_tokens", _ban_one_long)
    elif bug == "bad word prefix ignored":
        monkeypatch.setattr(llm_engine, "banned_tokens", _prefix_ignored)
    elif bug == "rules see a stale tail":
        monkeypatch.setattr(llm_engine, "banned_tokens", _stale_tail)
    else:
        monkeypatch.setattr(runner, "LLMEngine", _StopStringsBeforeMinTokens)
    found = []
    for i, seed in enumerate(_rule_traces(200)):
        trace = generate_trace(seed, {"async_scheduling": i % 2 == 0})
        if not run_trace(trace).ok:
            found.append(seed)
            if len(found) == 10:  # caught: the other traces cannot change the verdict
                break
    assert len(found) >= 10, found


def test_a_trace_with_token_rules_round_trips() -> None:
    from minivllm.engine.trace import loads
    trace = generate_trace(_rule_traces(1)[0])
    again = loads(trace.dumps())
    assert again.events == trace.events and _ruled(again) and run_trace(again).ok
