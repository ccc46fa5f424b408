"""Trace format (JSONL round trip, strict keys) and the random generator's reach."""

from __future__ import annotations

import json

import pytest

from minivllm.engine.trace import AbortEvent, AddEvent, ExpectEvent, loads
from sim.runner import classify_add
from sim.traces import generate_trace

SEEDS = range(400)


@pytest.fixture(scope="module")
def traces():  # type: ignore[no-untyped-def]
    return [generate_trace(s) for s in SEEDS]


def test_same_seed_same_trace() -> None:
    assert generate_trace(123).dumps() == generate_trace(123).dumps()
    assert generate_trace(123).dumps() != generate_trace(124).dumps()


def test_jsonl_round_trip_with_expects(traces) -> None:  # type: ignore[no-untyped-def]
    for t in traces[:50]:
        assert loads(t.dumps()) == t
    t = traces[0].with_expects([ExpectEvent(0, {"r0": 3}, ("r1",), {"r2": (4, 5)}, 7)])
    back = loads(t.dumps())
    assert back == t and back.expects[0].finished == {"r2": (4, 5)}
    head = json.loads(t.dumps().splitlines()[0])
    assert head["version"] == 1 and set(head["config"]) >= {"cache", "scheduler"}


@pytest.mark.parametrize("edit, match", [
    (lambda h, e: h.update(extra=1), "unknown key"),
    (lambda h, e: h.update(version=2), "version"),
    (lambda h, e: h["config"]["cache"].update(blok_size=4), "unknown CacheConfig key"),
    (lambda h, e: h["config"]["scheduler"].update(policy="fifo"), "policy"),
    (lambda h, e: e.update(op="poke"), "unknown op"),
    (lambda h, e: e.update(colour="red"), "unknown key"),
])
def test_reader_is_strict(traces, edit, match) -> None:  # type: ignore[no-untyped-def]
    lines = [json.loads(x) for x in traces[1].dumps().splitlines()]
    edit(lines[0], lines[1])
    with pytest.raises(ValueError, match=match):
        loads("\n".join(json.dumps(x) for x in lines))


def test_overrides() -> None:
    t = generate_trace(5, {"policy": "mixed", "block_size": 4, "chunked_prefill": False})
    assert t.scheduler.policy == "mixed" and t.cache.block_size == 4
    assert t.scheduler.max_num_batched_tokens >= t.scheduler.max_model_len
    t = generate_trace(5, {"cache": {"enable_prefix_caching": False}, "max_num_batched_tokens": 3,
                           "chunked_prefill": False})
    assert t.scheduler.max_model_len <= 3 and not t.cache.enable_prefix_caching
    with pytest.raises(ValueError, match="unknown config key"):
        generate_trace(5, {"blocksize": 4})


def test_generator_reaches_the_corners(traces) -> None:  # type: ignore[no-untyped-def]
    seen: set[str] = set()
    for t in traces:
        seen |= {f"policy={t.scheduler.policy}", f"prefix={t.cache.enable_prefix_caching}",
                 f"chunked={t.scheduler.chunked_prefill}", f"bs={t.cache.block_size}"}
        if t.cache.num_blocks is None:
            seen.add("pool from executor")
        if t.eos_token_id is None:
            seen.add("no eos")
        adds = [e for e in t.events if isinstance(e, AddEvent)]
        aborts = [e for e in t.events if isinstance(e, AbortEvent)]
        if aborts:
            seen.add("abort")
        if len({e.step for e in adds}) > 3:
            seen.add("arrivals over time")
        for e in adds:
            verdict = classify_add(t, e)
            seen.add(f"add {verdict}")
            if e.sampling.ignore_eos:
                seen.add("ignore_eos")
            if e.sampling.stop_token_ids:
                seen.add("stop ids")
            if verdict == "accept" and len(e.prompt_token_ids) + e.sampling.max_tokens == t.scheduler.max_model_len:
                seen.add("max_model_len hit")
            if len(e.prompt_token_ids) > t.scheduler.max_num_batched_tokens and t.scheduler.chunked_prefill:
                seen.add("needs chunking")
        bs = t.cache.block_size
        firsts = [e.prompt_token_ids[:bs] for e in adds if len(e.prompt_token_ids) > bs]
        if len(firsts) != len(set(firsts)):
            seen.add("shared prefix")
        ids = [e.request_id for e in adds]
        if len(ids) != len(set(ids)):
            seen.add("duplicate id")
    want = {"policy=mixed", "policy=prefill_first", "prefix=True", "prefix=False", "chunked=True",
            "chunked=False", "pool from executor", "no eos", "abort", "arrivals over time", "add accept",
            "add reject", "ignore_eos", "stop ids", "max_model_len hit", "needs chunking", "shared prefix",
            "duplicate id"} | {f"bs={b}" for b in (1, 2, 4, 8, 16)}
    assert want <= seen, want - seen
    assert "add either" not in seen  # the generator stays clear of the ambiguous pool boundary
