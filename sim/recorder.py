"""Traces of live traffic: record a real engine's run, replay it on the fake model.

``RecordingEngine`` (``LLM(..., record_trace=PATH)``, ``python -m minivllm serve
--record-trace PATH``) is an ``LLMEngine`` that writes, as it runs, a trace in
the simulator's format (``sim.traces``): the config with the pool it really got,
every add and abort with the step it came before, and one expect line per
``step()`` (``engine.last_step``: scheduled, preempted, finished with the tokens
and finish reasons, free blocks, token counters).

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

from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import RequestOutput, sequence_name
from minivllm.sampling import SamplingParams
from sim.oracle import fake_text, is_stop_token
from sim.traces import AbortEvent, AddEvent, ExpectEvent, Trace


class RecordingEngine(LLMEngine):
    """An ``LLMEngine`` that writes its traffic to a JSONL trace as it runs.

    Args:
        *args, **kwargs: those of ``LLMEngine``.
        trace_path: the JSONL file (overwritten).
        vocab_size: the model's vocabulary (the fake model's, on replay).
        seed: written in the header (the live sampler's seed; informative only).

    The header is written with the first recorded event, so the scheduling mode
    may still be switched (``set_async_scheduling``) before any traffic. Lines
    are flushed whenever the engine is idle and by ``close()``.
    """

    def __init__(self, *args: Any, trace_path: str | os.PathLike[str], vocab_size: int, seed: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trace_path = os.fspath(trace_path)
        self._vocab_size = vocab_size
        self._seed = seed
        self._file: IO[str] = open(self.trace_path, "w", encoding="utf-8")
        self._started = False
        self._num_steps = 0   # step() calls so far: the step of the next input event

    def _write(self, line: dict[str, Any]) -> None:
        if not self._started:
            self._started = True
            self._write_line(self._header())
        self._write_line(line)

    def _write_line(self, line: dict[str, Any]) -> None:
        self._file.write(json.dumps(line) + "\n")

    def _header(self) -> dict[str, Any]:
        cache = dataclasses.replace(self.cache_config, num_blocks=self.num_blocks)
        return Trace(seed=self._seed, cache=cache, scheduler=self.scheduler_config,
                     executor_num_blocks=self.num_blocks, vocab_size=self._vocab_size,
                     eos_token_id=self.eos_token_id, events=(), fake_model="recorded").header()

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams | None = None) -> None:
        """``LLMEngine.add_request``; an accepted request is recorded."""
        super().add_request(request_id, prompt_token_ids, sampling_params)
        params = SamplingParams() if sampling_params is None else sampling_params
        self._write(AddEvent(self._num_steps, request_id, tuple(int(t) for t in prompt_token_ids),
                             params).to_json())

    def abort_request(self, request_id: str) -> bool:
        """``LLMEngine.abort_request``; recorded when it aborted something."""
        aborted = super().abort_request(request_id)
        if aborted:
            self._write(AbortEvent(self._num_steps, request_id).to_json())
        return aborted

    def step(self) -> list[RequestOutput]:
        """``LLMEngine.step``, recorded as an expect line unless the engine was idle."""
        if not self.has_unfinished_requests():
            return super().step()
        outputs = super().step()
        assert self.last_step is not None, "step() always records its decisions"
        self._write(ExpectEvent.from_record(self._num_steps, self.last_step).to_json())
        self._num_steps += 1
        if not self.has_unfinished_requests():
            self._file.flush()
        return outputs

    def set_async_scheduling(self, on: bool) -> None:
        """``LLMEngine.set_async_scheduling``, before any traffic only: a trace has one config.

        Raises:
            RuntimeError: the trace already holds events in the other mode.
        """
        if self._started and on != self.async_scheduling:
            raise RuntimeError(f"set_async_scheduling: the trace {self.trace_path} is recorded with "
                               f"async_scheduling={self.async_scheduling}; it cannot change mid-trace")
        super().set_async_scheduling(on)

    def close(self) -> None:
        """Flush and close the trace file (idempotent)."""
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
    (module docstring); a trace of the hash model is returned as is."""
    if trace.fake_model != "recorded":
        return trace
    finished: dict[str, tuple[int, ...]] = {}
    reasons: dict[str, str] = {}
    for e in trace.expects:
        finished.update(e.finished)
        reasons.update(e.finish_reasons or {})
    events = []
    for ev in trace.events:
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
