"""LLMEngine behaviour that the random traces do not pin down on their own:
every rejected input, aborts in every state, finishing rules, the known
failure cases of the original design, and loud failure instead of a spin."""

from __future__ import annotations

import dataclasses

import pytest

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.sequence import Sequence
from minivllm.sampling import SamplingParams
from sim.fake_executor import FakeExecutor, fake_next_token

VOCAB = 1000


def make_engine(num_blocks: int = 32, block_size: int = 4, policy: str = "mixed",
                budget: int = 64, max_num_seqs: int = 8, caching: bool = True,
                chunked: bool = True, max_model_len: int = 64, eos: int | None = None) -> LLMEngine:
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                         max_model_len=max_model_len, policy=policy, chunked_prefill=chunked)
    cc = CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching)
    return LLMEngine(sc, cc, FakeExecutor(VOCAB, block_size, num_blocks), eos_token_id=eos)


def drain(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, object]:
    outs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outs
        for o in engine.step():
            outs[o.request_id] = o
        engine.check_invariants()
    raise AssertionError("engine did not drain")


def greedy_tokens(prompt: list[int], n: int) -> list[int]:
    ctx, out = list(prompt), []
    for _ in range(n):
        t = fake_next_token(ctx, VOCAB)
        ctx.append(t)
        out.append(t)
    return out


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "empty"),
    ([1, 2, 3], SamplingParams(max_tokens=62), "max_model_len"),
    ([1, -2], SamplingParams(), "ints >= 0"),
    ([[1, 2]], SamplingParams(), "ints >= 0"),
    ([1.5, 2.0], SamplingParams(), "ints >= 0"),
])
def test_add_request_rejects_bad_input(prompt, params, match) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests()
    engine.check_invariants()


def test_add_request_rejects_a_request_larger_than_the_pool() -> None:
    engine = make_engine(num_blocks=3, block_size=4)
    with pytest.raises(ValueError, match="whole pool has 3"):
        engine.add_request("big", list(range(10)), SamplingParams(max_tokens=4))  # 13 tokens -> 4 blocks
    engine.add_request("fits", list(range(10)), SamplingParams(max_tokens=3))      # 12 tokens -> 3 blocks
    assert drain(engine)["fits"].finish_reason == "length"


def test_duplicate_and_wrong_types() -> None:
    engine = make_engine()
    engine.add_request("a", [1, 2])
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("a", [3])
    with pytest.raises(TypeError, match="request_id"):
        engine.add_request(7, [3])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request("b", [3], {"max_tokens": 2})  # type: ignore[arg-type]
    drain(engine)
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("a", [3])  # finished ids stay taken


def test_bad_input_does_not_disturb_other_requests() -> None:
    engine = make_engine()
    engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=5))
    engine.step()
    with pytest.raises(ValueError):
        engine.add_request("bad", [], SamplingParams())
    out = drain(engine)
    assert list(out["ok"].token_ids) == greedy_tokens([5, 6, 7], 5)


def test_pool_larger_than_executor_is_rejected() -> None:
    sc = SchedulerConfig(max_model_len=64, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="executor holds only 4"):
        LLMEngine(sc, CacheConfig(block_size=4, num_blocks=8), FakeExecutor(VOCAB, 4, 4))


@pytest.mark.parametrize("when", ["waiting", "running", "finished", "unknown"])
def test_abort_in_every_state(when: str) -> None:
    engine = make_engine()
    engine.add_request("keep", [1, 2, 3], SamplingParams(max_tokens=6))
    engine.add_request("x", [4, 5, 6], SamplingParams(max_tokens=3))
    if when == "running":
        engine.step()
    if when == "finished":
        drain(engine)
        assert engine.abort_request("x") is False
        return
    if when == "unknown":
        with pytest.raises(ValueError, match="unknown request"):
            engine.abort_request("nope")
        return
    assert engine.abort_request("x") is True
    engine.check_invariants()
    out = drain(engine)
    assert out["x"].finish_reason == "abort"
    assert list(out["keep"].token_ids) == greedy_tokens([1, 2, 3], 6)
    assert engine.stats.num_aborts == 1


def test_eos_and_stop_tokens_end_requests_and_are_included() -> None:
    prompt = [3, 1, 4]
    first = greedy_tokens(prompt, 3)
    engine = make_engine(eos=first[1])
    engine.add_request("eos", prompt, SamplingParams(max_tokens=10))
    engine.add_request("ignore", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("stop", prompt, SamplingParams(max_tokens=10, stop_token_ids=(first[0],)))
    engine.add_request("last", prompt, SamplingParams(max_tokens=2))  # last allowed token is eos
    out = drain(engine)
    assert (list(out["eos"].token_ids), out["eos"].finish_reason) == (first[:2], "stop")
    assert (list(out["ignore"].token_ids), out["ignore"].finish_reason) == (first, "length")
    assert (list(out["stop"].token_ids), out["stop"].finish_reason) == (first[:1], "stop")
    assert out["last"].finish_reason == "stop"


def test_prefix_shared_by_three_sequences() -> None:
    """Original design case: 8-token prefix, block size 4 -> blocks shared with ref 3."""
    engine = make_engine(block_size=4)
    prefix = [10, 20, 30, 40, 50, 60, 70, 80]
    engine.add_request("A", prefix + [1], SamplingParams(max_tokens=4))
    engine.step()
    engine.add_request("B", prefix + [2], SamplingParams(max_tokens=4))
    engine.add_request("C", prefix + [3], SamplingParams(max_tokens=4))
    engine.step()
    assert engine.last_step.scheduled == {"A": 1, "B": 1, "C": 1}
    seqs = {s.request_id: s for s in engine.scheduler.running}
    assert seqs["B"].num_cached_tokens == seqs["C"].num_cached_tokens == 8
    shared = seqs["A"].block_table[:2]
    assert seqs["B"].block_table[:2] == seqs["C"].block_table[:2] == shared
    assert [engine.scheduler.block_manager.ref_counts[b] for b in shared] == [3, 3]
    out = drain(engine)
    for rid, last in zip("ABC", (1, 2, 3)):
        assert list(out[rid].token_ids) == greedy_tokens(prefix + [last], 4)


def test_prefix_cache_hits_across_requests_after_the_first_finished() -> None:
    engine = make_engine(block_size=4)
    prompt = list(range(100, 113))
    engine.add_request("first", prompt, SamplingParams(max_tokens=2))
    drain(engine)
    engine.add_request("second", prompt + [7], SamplingParams(max_tokens=2))
    engine.step()
    assert engine.last_step.scheduled == {"second": 14 - 12}
    assert engine.stats.num_cached_tokens == 12
    second = drain(engine)["second"]
    assert list(second.token_ids) == greedy_tokens(prompt + [7], 2)
    assert second.num_cached_tokens == 12  # vLLM's name: the hit at its first scheduling


def test_each_output_reports_the_prefix_cache_hit_of_its_first_scheduling() -> None:
    """``RequestOutput.num_cached_tokens``: 0 on a miss, whole blocks on a hit, kept after
    a preemption re-admits the sequence; not part of ``==``."""
    engine = make_engine(block_size=4)
    prompt = list(range(100, 110))
    engine.add_request("miss", prompt, SamplingParams(max_tokens=3))
    outs = [o for _ in range(3) for o in engine.step()]
    assert outs and all(o.num_cached_tokens == 0 for o in outs)
    drain(engine)
    engine.add_request("hit", prompt + [1, 2], SamplingParams(max_tokens=6))
    outs = [o for _ in range(2) for o in engine.step()]
    assert outs and all(o.num_cached_tokens == 8 for o in outs)
    (seq,) = engine.requests.values()  # still running
    seq.num_cached_tokens = 0  # as a re-admission after a preemption would set it
    assert engine._output(seq).num_cached_tokens == 8
    assert dataclasses.replace(outs[0], num_cached_tokens=0) == outs[0]
    assert drain(engine)["hit"].num_cached_tokens == 8


def test_tail_preemption_picks_the_most_recently_admitted() -> None:
    # Two blocks of 4: each sequence holds one; both need a second at the same step.
    engine = make_engine(num_blocks=2, block_size=4, max_model_len=8, budget=8)
    engine.add_request("old", [1, 2, 3], SamplingParams(max_tokens=5))
    engine.add_request("new", [4, 5, 6], SamplingParams(max_tokens=5))
    engine.step()                                 # both prefilled: 3 tokens, 1 block each
    engine.step()                                 # token 4 of each fills the block
    engine.step()                                 # token 5 needs a new block: tail is preempted
    assert engine.last_step.preempted == ("new",)
    assert engine.last_step.scheduled == {"old": 1}
    out = drain(engine)
    assert list(out["new"].token_ids) == greedy_tokens([4, 5, 6], 5)
    assert engine.stats.num_preemptions >= 1


def test_no_progress_raises_naming_the_counts() -> None:
    engine = make_engine(num_blocks=2, block_size=4)
    # Bypass admission (which would reject it) to provoke the spin the check guards against.
    seq = Sequence(99, "huge", list(range(20)), SamplingParams())
    engine.requests["huge"] = seq
    engine.scheduler.add(seq)
    with pytest.raises(RuntimeError, match=r"no progress: 1 waiting, 0 running, 2 of 2 blocks free"):
        engine.step()


def test_every_step_computes_at_least_one_token_of_a_fully_cached_prompt() -> None:
    engine = make_engine(block_size=4)
    prompt = list(range(8))
    engine.add_request("a", prompt, SamplingParams(max_tokens=1))
    drain(engine)
    engine.add_request("b", prompt, SamplingParams(max_tokens=1))
    engine.step()
    assert engine.last_step.scheduled == {"b": 4}  # block 1 holds the last token: recomputed
    assert engine.last_step.finished["b"] == tuple(greedy_tokens(prompt, 1))


def test_chunked_prefill_respects_the_budget() -> None:
    engine = make_engine(budget=5, max_model_len=64)
    engine.add_request("long", list(range(1, 18)), SamplingParams(max_tokens=2))
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
        steps.append(engine.last_step.scheduled.get("long", 0))
    assert steps[:4] == [5, 5, 5, 2] and engine.stats.num_chunked_prefills == 3


def test_prefill_first_pauses_decodes() -> None:
    engine = make_engine(policy="prefill_first")
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    engine.step()
    engine.add_request("b", [4, 5, 6, 7], SamplingParams(max_tokens=4))
    engine.step()
    assert engine.last_step.scheduled == {"b": 4}
    engine.step()
    assert engine.last_step.scheduled == {"a": 1, "b": 1}


def test_mixed_puts_decodes_and_prefill_in_one_step() -> None:
    engine = make_engine(policy="mixed")
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    engine.step()
    engine.add_request("b", [4, 5, 6, 7], SamplingParams(max_tokens=4))
    engine.step()
    assert engine.last_step.scheduled == {"a": 1, "b": 4}


def test_every_eos_id_of_a_list_ends_a_request() -> None:
    """Llama-3.x lists several eos ids: each one ends a request (finish reason ``stop``,
    the token kept), unless ``ignore_eos``; a single id behaves as before."""
    prompt = [5, 6, 7]
    seq = greedy_tokens(prompt, 8)
    later = next(i for i in range(2, 8) if seq[i] not in seq[:i])  # first new token at index >= 2
    params = SamplingParams(temperature=0, max_tokens=8)
    for eos in ([VOCAB - 1, seq[later]], (seq[later],), seq[later]):
        engine = make_engine(eos=eos)  # type: ignore[arg-type]
        engine.add_request("r", prompt, params)
        out = drain(engine)["r"]
        assert (list(out.token_ids), out.finish_reason) == (seq[:later + 1], "stop"), eos
    engine = make_engine(eos=[VOCAB - 1, seq[later]])  # type: ignore[arg-type]
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    out = drain(engine)["r"]
    assert (list(out.token_ids), out.finish_reason) == (seq, "length")
    with pytest.raises(TypeError, match="eos_token_id"):
        make_engine(eos=[1, "2"])  # type: ignore[list-item]


def test_equal_sampling_params_share_one_object_in_plans() -> None:
    """Plans are pickled once per step for tensor-parallel workers: equal params (frozen)
    are interned at admission so a plan carries each distinct one once."""
    engine = make_engine()
    plans = []
    submit = engine.executor.submit
    engine.executor.submit = lambda plan: (plans.append(plan), submit(plan))[1]  # type: ignore[method-assign]
    for i in range(3):
        engine.add_request(f"r{i}", [5, 6, i], SamplingParams(temperature=0, max_tokens=3))
    engine.add_request("other", [7, 8], SamplingParams(temperature=0, max_tokens=2))
    drain(engine)
    first = plans[0]
    assert len({id(p) for p in first.sampling_params}) == 2
    assert len(first.sampling_params) == 4


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_final_only_requests_are_reported_once_with_every_token(async_scheduling: bool) -> None:
    engine = make_engine()
    engine.set_async_scheduling(async_scheduling)
    engine.add_request("stream", [1, 2, 3], SamplingParams(max_tokens=4))
    engine.add_request("final", [1, 2, 3], SamplingParams(max_tokens=4, output_kind="final_only"))
    engine.add_request("aborted", [7, 8], SamplingParams(max_tokens=50, output_kind="final_only"))
    seen: dict[str, list] = {"stream": [], "final": [], "aborted": []}
    for i in range(100):
        if i == 3:
            engine.abort_request("aborted")
        for o in engine.step():
            seen[o.request_id].append(o)
        if not engine.has_unfinished_requests():
            break
    assert len(seen["stream"]) == 4  # one per token
    for rid, reason in (("final", "length"), ("aborted", "abort")):
        (out,) = seen[rid]
        assert out.finish_reason == reason and out.new_token_ids == out.token_ids
    assert seen["final"][0].token_ids == seen["stream"][-1].token_ids == tuple(greedy_tokens([1, 2, 3], 4))
    assert len(seen["aborted"][0].token_ids) >= 1
