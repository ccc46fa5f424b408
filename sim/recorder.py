"""Traces of live traffic: record a real engine's run, replay it on the fake model.

``TraceRecorder`` (``LLM(..., observer=TraceRecorder(PATH))``, ``python -m minivllm
serve --record-trace PATH``) is the engine's observer (``minivllm.engine.observer``)
that writes, as the engine runs, a trace in the simulator's format (``sim.traces``):
the config with the pool it really got, every add and abort with the step it came
before, and one expect line per ``step()`` (``engine.last_step``: scheduled,
preempted, finished with the tokens and finish reasons, free blocks, token counters).

Only what changes the engine is recorded: an add that was refused, an abort of a
finished request and a ``step()`` of an idle engine change nothing and are left
out (steps are counted without the idle ones). So every recorded input is
followed by recorded steps until the engine drains, which is where the replay
stops too; a server idling between requests leaves no gaps to replay.

Replaying it (``python -m sim replay FILE``) needs no model. The header says
``"fake_model": "recorded"``, and ``replay_inputs`` turns the trace into what
the fake executor and the oracle need:

- ``recorded_contexts``: each sequence's prompt + completion, which the fake
  executor returns token by token instead of its hash (see ``sim.fake_executor``
  for why that makes every decision the live one);
- stop strings: the live engine judged them on the real tokenizer's text, the
  replay has only the fake tokenizer's. A completion that a stop string ended
  gets, as its request's stop string, the fake text of its whole completion,
  which can first occur at its last token; the request's own stop strings are
  dropped (they never ended anything else). So the replay stops each request at
  the token where the live run stopped it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import IO, Any, Sequence

from minivllm.engine.llm_engine import LLMEngine, StepRecord
from minivllm.outputs import sequence_name
from minivllm.sampling import SamplingParams
from sim.oracle import fake_text, is_stop_token
from sim.traces import AbortEvent, AddEvent, ExpectEvent, Trace


class TraceRecorder:
    """An ``EngineObserver`` that writes an engine's traffic to a JSONL trace as it runs.

    Pass it to ``LLMEngine(observer=...)`` or ``LLM(observer=...)``; the engine needs a
    ``vocab_size`` (``LLM`` gives the model's). It opens the file when attached, so it
    can be built, and pickled, before the engine exists (the server builds its engine
    in another process).

    Args:
        trace_path: the JSONL file (overwritten).
        seed: written in the header (the live sampler's seed; informative only).

    The header is written with the first recorded event, so the scheduling mode
    may still be switched (``set_async_scheduling``) before any traffic. Lines
    are flushed whenever the engine is idle and by ``close()``.
    """

    def __init__(self, trace_path: str | os.PathLike[str], seed: int = 0) -> None:
        self.trace_path = os.fspath(trace_path)
        self._seed = seed
        self._file: IO[str] | None = None
        self._started = False
        self._num_steps = 0   # recorded steps so far: the step of the next input event

    def attach(self, engine: LLMEngine) -> None:
        """Open the trace file for ``engine``.

        Raises:
            ValueError: the engine has no ``vocab_size``. RuntimeError: already attached.
        """
        if self._file is not None:
            raise RuntimeError(f"TraceRecorder({self.trace_path!r}) already records an engine")
        if engine.vocab_size is None:
            raise ValueError("TraceRecorder: the engine has no vocab_size, and a trace needs it")
        self._file = open(self.trace_path, "w", encoding="utf-8")

    def _write(self, engine: LLMEngine, line: dict[str, Any]) -> None:
        assert self._file is not None, "attach() opens the file before any event"
        if not self._started:
            self._started = True
            self._file.write(json.dumps(self._header(engine)) + "\n")
        self._file.write(json.dumps(line) + "\n")

    def _header(self, engine: LLMEngine) -> dict[str, Any]:
        assert engine.vocab_size is not None
        cache = dataclasses.replace(engine.cache_config, num_blocks=engine.num_blocks)
        return Trace(seed=self._seed, cache=cache, scheduler=engine.scheduler_config,
                     executor_num_blocks=engine.num_blocks, vocab_size=engine.vocab_size,
                     eos_token_id=engine.eos_token_id, events=(), fake_model="recorded").header()

    def on_add_request(self, engine: LLMEngine, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams) -> None:
        """An accepted request, at the step it came before."""
        self._write(engine, AddEvent(self._num_steps, request_id, tuple(int(t) for t in prompt_token_ids),
                                     params).to_json())

    def on_abort_request(self, engine: LLMEngine, request_id: str) -> None:
        """An abort that aborted something."""
        self._write(engine, AbortEvent(self._num_steps, request_id).to_json())

    def on_step(self, engine: LLMEngine, record: StepRecord) -> None:
        """A step of a busy engine, as an expect line."""
        self._write(engine, ExpectEvent.from_record(self._num_steps, record).to_json())
        self._num_steps += 1
        if not engine.has_unfinished_requests():
            assert self._file is not None
            self._file.flush()

    def on_set_async_scheduling(self, engine: LLMEngine, on: bool) -> None:
        """Allowed before any traffic only: a trace has one config.

        Raises:
            RuntimeError: the trace already holds events in the other mode.
        """
        if self._started and on != engine.async_scheduling:
            raise RuntimeError(f"set_async_scheduling: the trace {self.trace_path} is recorded with "
                               f"async_scheduling={engine.async_scheduling}; it cannot change mid-trace")

    def close(self) -> None:
        """Flush and close the trace file (idempotent)."""
        if self._file is not None:
            self._file.close()


def recorded_contexts(trace: Trace) -> dict[str, tuple[int, ...]]:
    """Each finished sequence's prompt + completion in a recorded trace, by name."""
    prompts = {sequence_name(e.request_id, i): e.prompt_token_ids
               for e in trace.events if isinstance(e, AddEvent) for i in range(e.sampling.n)}
    out = {}
    for e in trace.expects:
        for name, tokens in e.finished.items():
            if name not in prompts:
                raise ValueError(f"step {e.step}: sequence {name!r} finished but no request added it")
            out[name] = prompts[name] + tuple(tokens)
    return out


def replay_inputs(trace: Trace) -> Trace:
    """A recorded trace with its stop strings made replayable on the fake tokenizer
    (module docstring) and its grammars dropped (the recorded tokens obey them); a trace
    of the hash model is returned as is."""
    if trace.fake_model != "recorded":
        return trace
    finished: dict[str, tuple[int, ...]] = {}
    reasons: dict[str, str] = {}
    for e in trace.expects:
        finished.update(e.finished)
        reasons.update(e.finish_reasons or {})
    events = []
    for ev in trace.events:
        if isinstance(ev, AddEvent) and ev.sampling.structured_outputs is not None:
            # The recorded tokens already obey the grammar, and the engine's decisions depend
            # on it only through them; the fake backend could not compile a real one.
            ev = dataclasses.replace(ev, sampling=dataclasses.replace(ev.sampling, structured_outputs=None))
        if isinstance(ev, AddEvent) and ev.sampling.stop:
            p = ev.sampling
            stops = []
            for i in range(p.n):
                name = sequence_name(ev.request_id, i)
                tokens = finished.get(name, ())
                if (tokens and reasons.get(name) == "stop"
                        and not is_stop_token(tokens[-1], p, trace.eos_token_id)):
                    stops.append(fake_text(tokens))
            ev = dataclasses.replace(ev, sampling=dataclasses.replace(p, stop=tuple(dict.fromkeys(stops))))
        events.append(ev)
    return dataclasses.replace(trace, events=tuple(events))
