"""One step in flight (asynchronous scheduling): the cases that only it has.

Each test drives the real engine over the deferred fake executor, checks the
invariants after every step and the outputs against the synchronous engine
and the unpaged oracle, and asserts that the situation it is about really
happened (a token dropped, a block held back, a drain before a preemption).
"""

from __future__ import annotations

import pytest

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.plan import StepPlan
from minivllm.outputs import RequestOutput
from minivllm.sampling import SamplingParams
from sim.fake_executor import FakeExecutor, PagingError
from sim.oracle import oracle_generate

VOCAB = 1000


class RecordingExecutor(FakeExecutor):
    """The fake executor, keeping every plan it was given."""

    def __init__(self, *args: int) -> None:
        super().__init__(*args)
        self.plans: list[StepPlan] = []

    def submit(self, plan: StepPlan):  # type: ignore[no-untyped-def]
        self.plans.append(plan)
        return super().submit(plan)


def make_engine(async_scheduling: bool = True, num_blocks: int = 32, block_size: int = 4,
                budget: int = 64, max_num_seqs: int = 8, max_model_len: int = 64,
                policy: str = "mixed", eos: int | None = None) -> LLMEngine:
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                         max_model_len=max_model_len, policy=policy, async_scheduling=async_scheduling)
    cc = CacheConfig(block_size=block_size, num_blocks=num_blocks)
    return LLMEngine(sc, cc, RecordingExecutor(VOCAB, block_size, num_blocks), eos_token_id=eos)


def drain(engine: LLMEngine, max_steps: int = 1000) -> dict[str, RequestOutput]:
    outs: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outs
        for o in engine.step():
            if o.finished:
                assert o.request_id not in outs, f"{o.request_id} finished twice"
                outs[o.request_id] = o
        engine.check_invariants()
    raise AssertionError("engine did not drain")


def oracle(prompt: list[int], params: SamplingParams, eos: int | None, max_model_len: int = 64) -> tuple:
    e = oracle_generate(prompt, params, eos, max_model_len, VOCAB)
    return e.token_ids, e.finish_reason


def fed_positions(engine: LLMEngine, seq_id: int) -> list[int]:
    """Positions of every token fed for ``seq_id``, over all plans."""
    out = []
    for p in engine.executor.plans:  # type: ignore[attr-defined]
        for sid, start, n in zip(p.seq_ids, p.start_positions.tolist(), p.query_lens.tolist()):
            if sid == seq_id:
                out.extend(range(start, start + n))
    return out


def test_pending_token_is_fed_by_reference() -> None:
    engine = make_engine()
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    outs = drain(engine)
    want = oracle([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True), None)
    assert (outs["a"].token_ids, outs["a"].finish_reason) == want
    plans = engine.executor.plans  # type: ignore[attr-defined]
    # Prefill, then four decodes each feeding the previous step's sample by reference.
    assert [p.feeds_prev_sample.tolist() for p in plans] == [[False]] + [[True]] * 4
    assert all(p.token_ids[-1] == -1 for p in plans[1:])
    # The last sample is never fed: positions 0..6 only.
    assert fed_positions(engine, 0) == list(range(7))


def test_eos_in_flight_drops_the_next_token() -> None:
    prompt, params = [5, 6, 7, 8], SamplingParams(max_tokens=20)
    free_run, _ = oracle(prompt, SamplingParams(max_tokens=20, ignore_eos=True), None)
    eos = free_run[3]
    assert eos not in free_run[:3]
    engine = make_engine(eos=eos)
    engine.add_request("a", prompt, params)
    engine.add_request("b", [9, 9], SamplingParams(max_tokens=12, ignore_eos=True))
    outs = drain(engine)
    assert (outs["a"].token_ids, outs["a"].finish_reason) == (free_run[:4], "stop")
    # The step after the eos was already in flight: 'a' was fed its eos token, whose sample was dropped.
    assert fed_positions(engine, 0)[-1] == len(prompt) + 3
    assert outs["b"].token_ids == oracle([9, 9], SamplingParams(max_tokens=12, ignore_eos=True), eos)[0]


def test_abort_in_flight_frees_blocks_after_the_step() -> None:
    engine = make_engine(num_blocks=4, block_size=4)
    engine.add_request("a", [1] * 6, SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(3):
        engine.step()
        engine.check_invariants()
    held = engine.num_free_blocks
    assert engine.abort_request("a") is True
    # 'a' is in the step in flight: its blocks stay held until that step completes.
    assert engine.num_free_blocks == held
    engine.check_invariants()
    # 'b' needs the whole pool: it can only run on 'a's blocks once they are free.
    engine.add_request("b", [2] * 9, SamplingParams(max_tokens=7, ignore_eos=True))
    outs = drain(engine)
    assert outs["a"].finish_reason == "abort"
    full = oracle([1] * 6, SamplingParams(max_tokens=8, ignore_eos=True), None)[0]
    assert outs["a"].token_ids == full[:len(outs["a"].token_ids)]
    want = oracle([2] * 9, SamplingParams(max_tokens=7, ignore_eos=True), None)
    assert (outs["b"].token_ids, outs["b"].finish_reason) == want
    assert engine.num_free_blocks == 4


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_of_the_last_request_is_delivered(async_scheduling: bool) -> None:
    engine = make_engine(async_scheduling)
    engine.add_request("only", [1, 2, 3], SamplingParams(max_tokens=10))
    engine.step()
    engine.step()
    engine.abort_request("only")
    outs = drain(engine)
    assert outs["only"].finish_reason == "abort"
    assert not engine.has_unfinished_requests() and engine.num_free_blocks == 32


def test_preemption_waits_for_the_step_in_flight() -> None:
    # Two sequences grow into a 6-block pool: someone must be preempted.
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    engine = make_engine(num_blocks=6, block_size=4)
    engine.add_request("a", [1] * 7, params)
    engine.add_request("b", [2] * 7, params)
    outs = drain(engine)
    assert engine.stats.num_preemptions > 0
    for rid, prompt in (("a", [1] * 7), ("b", [2] * 7)):
        assert (outs[rid].token_ids, outs[rid].finish_reason) == oracle(prompt, params, None)
    assert engine.num_free_blocks == 6


def test_chunked_prefill_finishing_in_flight() -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine = make_engine(budget=5)
    engine.add_request("long", list(range(1, 18)), params)
    outs = drain(engine)
    assert (outs["long"].token_ids, outs["long"].finish_reason) == oracle(list(range(1, 18)), params, None)
    plans = engine.executor.plans  # type: ignore[attr-defined]
    # Four chunks (5, 5, 5, 2 tokens; the last samples), then references.
    assert [int(p.query_lens[0]) for p in plans[:5]] == [5, 5, 5, 2, 1]
    assert [bool(p.feeds_prev_sample[0]) for p in plans[:5]] == [False] * 4 + [True]


def test_block_freed_in_flight_is_not_reallocated_early() -> None:
    # 'a' stops at eos while its next step is in flight; 'b' waits for 'a's blocks.
    prompt = [3, 1, 4, 1]
    free_run, _ = oracle(prompt, SamplingParams(max_tokens=9, ignore_eos=True), None)
    eos = free_run[2]
    assert eos not in free_run[:2]
    engine = make_engine(num_blocks=3, block_size=4, eos=eos)
    engine.add_request("a", prompt, SamplingParams(max_tokens=9))
    engine.add_request("b", [7] * 9, SamplingParams(max_tokens=3, ignore_eos=True))
    outs = drain(engine)
    assert outs["a"].token_ids == free_run[:3]
    want = oracle([7] * 9, SamplingParams(max_tokens=3, ignore_eos=True), eos)
    assert (outs["b"].token_ids, outs["b"].finish_reason) == want


def test_fake_executor_refuses_a_block_handover_in_flight() -> None:
    ex = FakeExecutor(VOCAB, 4, 2)
    first = StepPlan.build([0], [[1, 2]], [0], [(0,)], [True], [SamplingParams()], 4)
    ex.submit(first)
    stolen = StepPlan.build([1], [[3]], [0], [(0,)], [True], [SamplingParams()], 4)
    with pytest.raises(PagingError, match="in flight"):
        ex.submit(stolen)


def test_fake_executor_refuses_a_dangling_reference() -> None:
    ex = FakeExecutor(VOCAB, 4, 2)
    ex.submit(StepPlan.build([0], [[1, 2]], [0], [(0,)], [False], [SamplingParams()], 4))
    ref = StepPlan.build([0], [[-1]], [2], [(0,)], [True], [SamplingParams()], 4, feeds_prev_sample=[True])
    with pytest.raises(PagingError, match="did not sample"):
        ex.submit(ref)


@pytest.mark.parametrize("policy", ["mixed", "prefill_first"])
def test_async_and_sync_give_the_same_outputs(policy: str) -> None:
    prompts = [[i % 7 + 1] * (3 + 5 * i % 11) for i in range(12)]
    params = [SamplingParams(max_tokens=1 + (7 * i) % 13, ignore_eos=i % 3 == 0) for i in range(12)]
    results = []
    for mode in (False, True):
        engine = make_engine(mode, num_blocks=12, block_size=4, budget=16, policy=policy, eos=17)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", p, sp)
        results.append({k: (o.token_ids, o.finish_reason) for k, o in drain(engine).items()})
    assert results[0] == results[1]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_step_streams_each_new_token_once(async_scheduling: bool) -> None:
    engine = make_engine(async_scheduling)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    engine.add_request("b", [4, 5], params)
    streamed: dict[str, list[int]] = {"a": [], "b": []}
    finals = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        assert len({o.request_id for o in outs}) == len(outs), "two outputs for one request in a step"
        for o in outs:
            assert len(o.new_token_ids) == 1  # one token per step per decoding request
            streamed[o.request_id] += o.new_token_ids
            assert tuple(streamed[o.request_id]) == o.token_ids
            if o.finished:
                finals[o.request_id] = o
    for rid, prompt in (("a", [1, 2, 3]), ("b", [4, 5])):
        assert (finals[rid].token_ids, finals[rid].finish_reason) == oracle(prompt, params, None)
