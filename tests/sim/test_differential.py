"""Differential: the same requests give identical outputs whatever the cache does.

Prefix caching on vs off, and a roomy pool vs one barely large enough for the
largest request (forcing preemption and eviction), must not change a single
token. This holds independently of the oracle.
"""

from __future__ import annotations

import dataclasses

import pytest

from minivllm.config import cdiv
from minivllm.engine.trace import AddEvent, Trace
from sim.runner import RunResult, run_trace
from sim.traces import generate_trace

SEEDS = range(60)


def requests_only(seed: int) -> Trace:
    """A random trace with busy arrivals, without aborts (their outputs depend on timing)."""
    t = generate_trace(seed, {"max_num_seqs": 16, "num_blocks": 512})
    adds = [e for e in t.events if isinstance(e, AddEvent) and e.prompt_token_ids
            and len(e.prompt_token_ids) + e.sampling.max_tokens <= t.scheduler.max_model_len]
    seen: set[str] = set()
    unique = [e for e in adds if not (e.request_id in seen or seen.add(e.request_id))]
    return dataclasses.replace(t, events=tuple(unique))


def variant(t: Trace, num_blocks: int, prefix: bool) -> RunResult:
    cache = dataclasses.replace(t.cache, num_blocks=num_blocks, enable_prefix_caching=prefix)
    result = run_trace(dataclasses.replace(t, cache=cache, executor_num_blocks=num_blocks))
    assert result.ok, result.violations
    return result


def outputs(r: RunResult) -> dict[str, tuple[tuple[int, ...], str]]:
    return {rid: (tuple(o.token_ids), o.finish_reason) for rid, o in r.outputs.items()}


@pytest.mark.parametrize("chunk", range(3))
def test_prefix_caching_and_pool_size_do_not_change_outputs(chunk: int) -> None:
    preemptions = cached = 0
    for seed in SEEDS[chunk::3]:
        t = requests_only(seed)
        if not t.events:
            continue
        bs = t.cache.block_size
        tight = max(cdiv(len(e.prompt_token_ids) + e.sampling.max_tokens, bs)  # type: ignore[union-attr]
                    for e in t.events)
        runs = {(nb, prefix): variant(t, nb, prefix) for nb in (512, tight) for prefix in (True, False)}
        reference = outputs(runs[(512, False)])
        assert len(reference) == sum(e.sampling.n for e in t.events)  # type: ignore[union-attr]
        for key, r in runs.items():
            assert outputs(r) == reference, f"seed {seed}: outputs differ for (num_blocks, prefix)={key}"
        preemptions += runs[(tight, True)].preemptions + runs[(tight, False)].preemptions
        cached += runs[(512, True)].cached_tokens
        assert runs[(512, False)].cached_tokens == 0
    assert preemptions > 0, "the small pool never forced a preemption"
    assert cached > 0, "prefix caching never hit"
