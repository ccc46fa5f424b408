"""The unpaged oracle follows the finishing rules of ``docs/design.md`` ("Scheduler")."""

from __future__ import annotations

import pytest

from minivllm.sampling import SamplingParams
from sim.fake_executor import fake_next_token
from sim.oracle import fake_text, oracle_generate

V = 1000
PROMPT = (11, 22, 33)


def free_run(n: int) -> list[int]:
    """The first n tokens the fake model produces after PROMPT, with nothing stopping it."""
    ctx, out = list(PROMPT), []
    for _ in range(n):
        out.append(fake_next_token(ctx, V))
        ctx.append(out[-1])
    return out


def first_new(run: list[int], i: int) -> int:
    """A position >= i whose token does not occur earlier in run."""
    while run[i] in run[:i]:
        i += 1
    return i


def gen(eos: int | None = None, max_model_len: int = 100, **kw: object):  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0.0, **kw)  # type: ignore[arg-type]
    return oracle_generate(PROMPT, params, eos, max_model_len, V)


def test_max_tokens_gives_length() -> None:
    run = free_run(20)
    r = gen(max_tokens=7)
    assert r.token_ids == tuple(run[:7]) and r.finish_reason == "length"


def test_eos_is_included_and_gives_stop_unless_ignored() -> None:
    run = free_run(20)
    i = first_new(run, 3)
    r = gen(eos=run[i], max_tokens=20)
    assert r.token_ids == tuple(run[: i + 1]) and r.finish_reason == "stop"
    r = gen(eos=run[i], max_tokens=20, ignore_eos=True)
    assert r.token_ids == tuple(run) and r.finish_reason == "length"


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    run = free_run(20)
    i = first_new(run, 5)
    r = gen(max_tokens=20, ignore_eos=True, stop_token_ids=(V + 5, run[i]))
    assert r.token_ids == tuple(run[: i + 1]) and r.finish_reason == "stop"


def test_last_allowed_token_that_is_also_eos_gives_stop() -> None:
    run = free_run(20)
    i = first_new(run, 4)
    assert gen(eos=run[i], max_tokens=i + 1).finish_reason == "stop"
    assert gen(max_tokens=i + 1, max_model_len=len(PROMPT) + i + 1, stop_token_ids=(run[i],)).finish_reason == "stop"


def test_max_model_len_counts_prompt_and_completion() -> None:
    run = free_run(20)
    r = gen(max_tokens=50, max_model_len=len(PROMPT) + 4)
    assert r.token_ids == tuple(run[:4]) and r.finish_reason == "length"


def test_no_room_is_an_error() -> None:
    with pytest.raises(ValueError):
        oracle_generate((), SamplingParams(), None, 10, V)
    with pytest.raises(ValueError):
        gen(max_model_len=len(PROMPT))


def test_stop_strings_in_the_fake_text() -> None:
    """The fake tokenizer reads token t as 'abcdefghij'[t % 10]; a stop string ends the request
    at the token that completes it and cuts the text before it (or after, when kept)."""
    free = oracle_generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), None, 64, V)
    text = fake_text(free.token_ids)
    stop = text[3:5]
    assert stop not in text[:4], "pick a prompt whose first occurrence is at 3"
    got = oracle_generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]),
                          None, 64, V)
    assert (got.token_ids, got.finish_reason, got.text) == (free.token_ids[:5], "stop", text[:3])
    kept = oracle_generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop],
                                                  include_stop_str_in_output=True), None, 64, V)
    assert kept.text == text[:5]
    assert free.text is None  # no stop strings: the oracle keeps no text
