"""Traces of live traffic (``minivllm.engine.trace.TraceRecorder``, ``LLM(observer=TraceRecorder(...))``): what a
real engine records replays step for step through the simulator's engine on the recorded
tokens; and the engine's observer hook that the recorder plugs into."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pytest

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.observer import EngineObserver
from minivllm.engine.trace import AddEvent, ExpectEvent, Trace, TraceRecorder, load
from minivllm.sampling import SamplingParams
from sim.__main__ import main as sim_main
from sim.fake_executor import FakeExecutor, PagingError, fake_next_token, recorded_next_token
from sim.fake_proposer import make_proposer
from sim.grammar import FakeGrammarBackend
from sim.oracle import FakeTextStream, is_stop_token
from sim.runner import replay_inputs, run_trace
from sim.traces import generate_trace

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "tiny-qwen3"


def string_stops(trace: Trace) -> list[str]:
    """Sequences that a stop string ended (finish reason stop, last token not eos / a stop id)."""
    params = {e.request_id: e.sampling for e in trace.events if isinstance(e, AddEvent)}
    out = []
    for e in trace.expects:
        assert e.finish_reasons is not None
        for name, tokens in e.finished.items():
            p = params[name.partition("#")[0]]
            if e.finish_reasons[name] == "stop" and not is_stop_token(tokens[-1], p, trace.eos_token_id):
                out.append(name)
    return out


# ---- the recorder on the fake model (no torch) ---------------------------------------

def decisions(expects: Sequence[ExpectEvent]) -> list[ExpectEvent]:
    """The steps that did something, numbered 0 (the recorder leaves idle steps out)."""
    busy = [e for e in expects if e.scheduled or e.finished or e.preempted]
    return [dataclasses.replace(e, step=0) for e in busy]


def feed_inputs(engine: Any, trace: Trace, step: int) -> None:
    """Add and abort what ``trace`` does at ``step``; refused inputs are skipped (the runner
    checks refusals; a recording leaves them out)."""
    for ev in (e for e in trace.events if e.step == step):
        try:
            if isinstance(ev, AddEvent):
                engine.add_request(ev.request_id, list(ev.prompt_token_ids), ev.sampling)
            else:
                engine.abort_request(ev.request_id)
        except ValueError:
            pass


def recording_engine(trace: Trace, path: Path, proposer: Any = None, **kwargs: Any) -> LLMEngine:
    """An engine on the hash model of ``trace`` that records to ``path`` (a proposer drafting on
    the device is the fake executor's draft model too)."""
    drafter = proposer if proposer is not None and proposer.on_device else None
    executor = FakeExecutor(trace.vocab_size, trace.cache.block_size, trace.executor_num_blocks, drafter=drafter)
    return LLMEngine(trace.scheduler, trace.cache, executor, vocab_size=trace.vocab_size,
                     observer=TraceRecorder(path), proposer=proposer, **kwargs)


def drive(trace: Trace, path: Path) -> LLMEngine:
    """Feed ``trace``'s inputs to a recording engine on the hash model, as the runner does."""
    engine = recording_engine(trace, path, eos_token_id=trace.eos_token_id, text_streams=FakeTextStream,
                              grammar_backend=FakeGrammarBackend(trace.vocab_size, trace.eos_token_id),
                              proposer=make_proposer(trace.speculative, trace.vocab_size))
    step = 0
    while step <= trace.last_input_step or engine.has_unfinished_requests():
        feed_inputs(engine, trace, step)
        engine.step()
        step += 1
    engine.close()
    return engine


def test_recorded_fake_traffic_replays_and_matches_the_simulators_record(tmp_path: Path) -> None:
    """Generated traces (aborts, rejected adds, n > 1, stop strings, both modes) driven through
    a recording engine: each file replays on its recorded tokens, and its decisions are those
    ``python -m sim record`` records for the same inputs."""
    stopped = multi = aborted = 0
    for seed in range(40):
        trace = generate_trace(seed, {"hybrid": False})  # the recorded model has no recurrent state
        if trace.speculative is not None and any(
                e.sampling.structured_outputs is not None or e.sampling.has_token_rules
                for e in trace.events if isinstance(e, AddEvent)):
            # A replay drops grammars and token rules (the recorded tokens obey them), which
            # cut or steered the live run's drafts: it would draft otherwise.
            trace = dataclasses.replace(trace, speculative=None)
        path = tmp_path / f"live-{seed}.jsonl"
        drive(trace, path)
        live = load(path)
        assert live.fake_model == "recorded" and live.num_blocks == trace.num_blocks
        assert decisions(live.expects) == decisions(run_trace(trace, "record").expects), seed
        result = run_trace(live, "replay")
        assert result.ok, (seed, result.mismatch_step, result.mismatch, result.violations[:2])
        stopped += len(string_stops(live))
        multi += any(e.sampling.n > 1 for e in live.events if isinstance(e, AddEvent))
        aborted += any(r == "abort" for e in live.expects for r in (e.finish_reasons or {}).values())
    assert stopped and multi and aborted  # the seeds cover what the recorder must handle


def test_stop_strings_become_the_fake_text_of_the_completion(tmp_path: Path) -> None:
    seed = next(s for s in range(100) if string_stops(_recorded(s, tmp_path)))
    live = _recorded(seed, tmp_path)
    replayed = replay_inputs(live)
    name = string_stops(live)[0]
    ev = next(e for e in replayed.events if isinstance(e, AddEvent) and e.request_id == name.partition("#")[0])
    tokens = next(e.finished[name] for e in live.expects if name in e.finished)
    assert "abcdefghij"[tokens[-1] % 10] == ev.sampling.stop[0][-1]
    assert len(ev.sampling.stop[0]) == len(tokens)  # the whole completion's text


def _recorded(seed: int, tmp_path: Path) -> Trace:
    path = tmp_path / f"r-{seed}.jsonl"
    drive(generate_trace(seed), path)
    return load(path)


def test_recorded_next_token() -> None:
    live = (5, 6, 7, 8)
    assert recorded_next_token([5, 6], live, 50) == 7
    assert recorded_next_token(np.array([5, 6, 7]), live, 50) == 8
    assert recorded_next_token(live, live, 50) == fake_next_token(live, 50)  # past the record: dropped
    assert recorded_next_token([1, 2], None, 50) == fake_next_token([1, 2], 50)
    with pytest.raises(PagingError, match="position 1"):
        recorded_next_token([5, 9], live, 50)  # read back wrongly: a paging bug


def test_mode_switch_only_before_traffic(tmp_path: Path) -> None:
    trace = generate_trace(3)
    engine = recording_engine(trace, tmp_path / "t.jsonl")
    mode = not trace.scheduler.async_scheduling
    engine.set_async_scheduling(mode)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="mid-trace"):
        engine.set_async_scheduling(not mode)
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()
    assert load(tmp_path / "t.jsonl").scheduler.async_scheduling == mode


# ---- the observer hook -------------------------------------------------------------

class CallLog:
    """An ``EngineObserver`` that writes down what it is told (and can refuse a mode switch)."""

    def __init__(self, refuse_mode_switch: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.engines: list[LLMEngine] = []
        self.refuse_mode_switch = refuse_mode_switch

    def _saw(self, engine: LLMEngine, *call: Any) -> None:
        self.engines.append(engine)
        self.calls.append(call)

    def attach(self, engine: LLMEngine) -> None:
        self._saw(engine, "attach", engine.num_blocks)

    def on_add_request(self, engine: LLMEngine, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams) -> None:
        self._saw(engine, "add", request_id, tuple(prompt_token_ids), params.max_tokens)

    def on_abort_request(self, engine: LLMEngine, request_id: str) -> None:
        self._saw(engine, "abort", request_id)

    def on_step(self, engine: LLMEngine, record: Any) -> None:
        assert record is engine.last_step
        self._saw(engine, "step", dict(record.scheduled))

    def on_set_async_scheduling(self, engine: LLMEngine, on: bool) -> None:
        if self.refuse_mode_switch:
            raise RuntimeError("no switching")
        self._saw(engine, "mode", on)

    def close(self) -> None:
        self.calls.append(("close",))


def observed_engine(observer: Any) -> LLMEngine:
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    cc = CacheConfig(block_size=4, num_blocks=16)
    return LLMEngine(sc, cc, FakeExecutor(50, 4, 16), eos_token_id=None, vocab_size=50, observer=observer)


def test_the_observer_is_told_every_accepted_change_and_nothing_else() -> None:
    log = CallLog()
    engine = observed_engine(log)
    assert isinstance(log, EngineObserver) and log.calls == [("attach", 16)]
    engine.step()  # idle: changes nothing, not reported
    engine.set_async_scheduling(True)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError):
        engine.add_request("a", [4], SamplingParams(max_tokens=2))  # refused: not reported
    engine.add_request("b", [4, 5], SamplingParams(max_tokens=9))
    engine.step()
    assert engine.abort_request("b")
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.abort_request("a")  # already finished: not reported
    engine.step()
    engine.close()
    steps = [c for c in log.calls if c[0] == "step"]
    assert log.calls[:5] == [("attach", 16), ("mode", True), ("add", "a", (1, 2, 3), 2),
                             ("add", "b", (4, 5), 9), ("step", {"a": 3, "b": 2})]
    assert log.calls[5] == ("abort", "b") and log.calls[-1] == ("close",)
    assert len(steps) == engine.stats.num_steps - 2  # the two idle steps
    assert all(e is engine for e in log.engines)


def test_an_observer_may_refuse_a_mode_switch() -> None:
    engine = observed_engine(CallLog(refuse_mode_switch=True))
    with pytest.raises(RuntimeError, match="no switching"):
        engine.set_async_scheduling(True)
    assert not engine.async_scheduling
    engine.close()


def test_an_engine_and_its_recorder_are_freed_without_a_collection(tmp_path: Path) -> None:
    """The observer is handed the engine on each call and keeps no reference to it."""
    import gc
    import weakref

    trace = generate_trace(5)
    gc.disable()
    try:
        engine = drive(trace, tmp_path / "t.jsonl")
        refs = [weakref.ref(engine), weakref.ref(engine.observer), weakref.ref(engine.executor)]
        del engine
        assert [r() for r in refs] == [None, None, None]
    finally:
        gc.enable()


def test_trace_recorder_checks_its_engine(tmp_path: Path) -> None:
    recorder = TraceRecorder(tmp_path / "t.jsonl", seed=7)
    copy = pickle.loads(pickle.dumps(recorder))  # built here, attached in an engine process
    assert copy.trace_path == recorder.trace_path
    sc, cc = SchedulerConfig(max_model_len=64), CacheConfig(block_size=4, num_blocks=16)
    with pytest.raises(ValueError, match="vocab_size"):
        LLMEngine(sc, cc, FakeExecutor(50, 4, 16), observer=recorder)
    engine = LLMEngine(sc, cc, FakeExecutor(50, 4, 16), vocab_size=50, observer=recorder)
    with pytest.raises(RuntimeError, match="already records"):
        LLMEngine(sc, cc, FakeExecutor(50, 4, 16), vocab_size=50, observer=recorder)
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()
    engine.close()  # idempotent
    trace = load(tmp_path / "t.jsonl")
    assert trace.seed == 7 and trace.vocab_size == 50 and len(trace.expects) == engine.stats.num_steps
    assert run_trace(trace, "replay").ok


# ---- a real LLM -------------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_real_llm_trace_replays_on_the_cpu(async_scheduling: bool, tmp_path: Path) -> None:
    """The tiny Qwen3 under preemption, chunking, prefix hits, n = 2, stop strings and an
    abort records a trace; the simulator's engine replays it without the model, decision for
    decision, and the hash model in its place would not."""
    pytest.importorskip("torch")
    from minivllm import LLM

    path = tmp_path / "live.jsonl"
    with LLM(str(FIXTURE), device="cpu", block_size=4, num_blocks=12, max_num_seqs=6,
             max_num_batched_tokens=12, async_scheduling=async_scheduling,
             observer=TraceRecorder(path)) as llm:
        prompts = [f"{a}+{b}=" for a, b in [(12, 34), (5, 5), (99, 1), (23, 45), (60, 7), (8, 81), (12, 34)]]
        params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=1 + (i % 3 == 0), seed=i)
                  for i in range(len(prompts))]
        params[2] = SamplingParams(temperature=0, max_tokens=10, stop=["0"])  # "99+1=" -> "1", stop at "0"
        outs = llm.generate(prompts, params, use_tqdm=False)
        engine = llm.engine  # the server's way: requests and aborts between steps
        for i, p in enumerate(prompts[:3]):
            engine.add_request(f"live-{i}", llm.prompt_token_ids(i, p),
                               SamplingParams(temperature=0.5, max_tokens=10, ignore_eos=True, seed=3))
        for _ in range(3):
            engine.step()
        assert engine.abort_request("live-1")
        while engine.has_unfinished_requests():
            engine.step()
        steps = engine.stats.num_steps
    live = {o.name: o.token_ids for o in outs}
    trace = load(path)
    assert trace.fake_model == "recorded" and len(trace.expects) == steps
    assert sum(len(e.preempted) for e in trace.expects) > 0 and string_stops(trace) == ["req-2"]
    assert live["req-0"] != live["req-0#1"]  # two samples of one prompt, different tokens

    result = run_trace(trace, "replay", timeline=True)
    assert result.ok, (result.mismatch_step, result.mismatch, result.violations[:2])
    assert result.steps == steps and result.preemptions > 0 and result.cached_tokens > 0
    assert result.chunked_prefills > 0 and result.aborts == 1
    assert {n: o.token_ids for n, o in result.outputs.items() if n in live} == live
    hashed = run_trace(dataclasses.replace(trace, fake_model="hash"), "replay")
    assert hashed.mismatch is not None  # the replay rests on the recorded tokens

    picture = tmp_path / "live.png"
    assert sim_main(["replay", str(path), "--plot", str(picture)]) == 0
    assert picture.stat().st_size > 0
    header = json.loads(path.read_text().splitlines()[0])
    assert header["config"]["cache"]["num_blocks"] == 12 and header["fake_model"] == "recorded"


def test_the_cli_records_a_trace_that_replays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m minivllm generate --record-trace`` builds the recorder and hands it to LLM."""
    pytest.importorskip("torch")
    from minivllm.__main__ import main as cli_main

    path = tmp_path / "cli.jsonl"
    assert cli_main(["generate", "--model", str(FIXTURE), "--device", "cpu", "--kernels", "torch",
                     "--max-tokens", "5", "--record-trace", str(path), "12+34=", "5+5="]) == 0
    trace = load(path)
    assert trace.fake_model == "recorded" and sum(len(e.finished) for e in trace.expects) == 2
    assert sim_main(["replay", str(path)]) == 0
