"""Drive the real ``LLMEngine`` with a ``FakeExecutor`` over a trace and judge it.

Per step the runner applies that step's input events, calls ``step()``, then
``check_invariants()``, and checks the step's decisions (budget, seats, every
scheduled sequence gets a token, outputs) and the streamed deltas (one output
per request per step, adding up to its tokens, a prefix of the oracle's). Per request it checks the output
against the unpaged oracle (aborted requests: a prefix of it, reason ``abort``),
that impossible requests were rejected with ``ValueError`` leaving nothing
queued, that the engine drains within a bounded number of steps, and that an
idle engine holds no block. Every failed check becomes a violation message.

Record mode captures ``engine.last_step`` of every step as expect events;
replay mode compares them with the trace's and stops at the first difference.
With ``timeline=True`` each step also leaves a ``TimelineStep`` (what the plots
of ``sim.plot`` show).

A trace of live traffic (``fake_model: recorded``, written by
``minivllm.engine.trace.TraceRecorder``) runs on the recorded tokens, judged by an
oracle on the same tokens. ``replay_inputs`` turns it into what the fake executor
and the oracle need:

- ``recorded_contexts``: each sequence's prompt + completion, which the fake
  executor returns token by token instead of its hash (see ``sim.fake_executor``
  for why that makes every decision the live one);
- stop strings: the live engine judged them on the real tokenizer's text, the
  replay has only the fake tokenizer's. The trace records each completion's tokens
  and finish reason; one that ended with ``stop`` on a token that is neither an eos
  nor a stop token was ended by a stop string. Such a completion gets, as its
  request's stop string, the fake text of its whole completion, which can first
  occur at its last token; the request's own stop strings are dropped (they never
  ended anything else). So the replay stops each request at the token where the
  live run stopped it.
"""

from __future__ import annotations

import dataclasses
import re
import traceback
from dataclasses import dataclass, field
from typing import Literal

from minivllm.config import cdiv
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import RequestOutput, sequence_name
from minivllm.sampling import RequestOutputKind, eos_token_set
from sim.fake_executor import REJECTED, FakeExecutor, recorded_next_token
from minivllm.engine.grammar import GrammarBackend
from sim.grammar import FakeGrammarBackend, grammar_pattern
from sim.fake_proposer import make_proposer
from sim.oracle import Expected, FakeTextStream, fake_text, is_stop_token, oracle_generate
from sim.traces import AbortEvent, AddEvent, ExpectEvent, Trace

Verdict = Literal["accept", "reject", "either"]

# A step where requests are unfinished yet nothing is scheduled and nothing is
# returned is a spin; this many in a row is a liveness violation.
MAX_IDLE_STEPS = 3
# After the last output, steps an engine may still need (the step in flight
# finishing, its blocks freed) before it reports itself idle.
MAX_DRAIN_STEPS = 2


@dataclass(frozen=True)
class TimelineStep:
    """One step of a run as the plots show it: ``engine.last_step`` and the pool after the step."""

    step: int
    prefill_tokens: int        # prefill chunks that reach their sequence's end (and sample)
    chunked_tokens: int        # prefill chunks that stop short of it (chunked prefill)
    decode_tokens: int
    cached_tokens: int         # prefix-cache hits of the sequences admitted in this step
    running: int               # sequences in the queues after the step
    waiting: int
    used_blocks: int           # blocks with ref count > 0
    cached_free_blocks: int    # free blocks that keep a hash: hittable until handed out again
    uncached_free_blocks: int  # free blocks without one
    preempted: int             # sequences preempted in this step
    aborted: int               # aborted sequences whose final output this step returned
    finished: int              # sequences that ended otherwise (stop, length)


@dataclass
class RunResult:
    """What one trace run produced and found."""

    seed: int
    steps: int = 0
    requests: int = 0
    rejected: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    preemptions: int = 0
    chunked_prefills: int = 0
    aborts: int = 0
    violations: list[str] = field(default_factory=list)
    expects: list[ExpectEvent] = field(default_factory=list)
    # Replay: the first step whose decisions differ from the trace, and how.
    mismatch_step: int | None = None
    mismatch: str | None = None
    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    violation_step: int | None = None  # the step of the first violation
    timeline: list[TimelineStep] | None = None  # one per step, when asked for

    @property
    def ok(self) -> bool:
        return not self.violations and self.mismatch is None


def classify_add(trace: Trace, ev: AddEvent) -> Verdict:
    """Whether the engine must accept or reject this request (ignoring duplicates).

    A request of N total tokens computes at most N - 1 of them (the last sampled
    token is never fed), so it surely fits in a pool of ``cdiv(N, bs)`` blocks,
    surely not if ``cdiv(N - 1, bs)`` blocks exceed it; in between either
    answer is accepted.
    """
    n = len(ev.prompt_token_ids) + ev.sampling.max_tokens
    if not ev.prompt_token_ids or n > trace.scheduler.max_model_len:
        return "reject"
    if ev.sampling.structured_outputs is not None and not eos_token_set(trace.eos_token_id):
        return "reject"  # a grammar ends with eos
    bs, pool = trace.cache.block_size, trace.num_blocks
    if cdiv(n - 1, bs) > pool:
        return "reject"
    return "accept" if cdiv(n, bs) <= pool else "either"


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
    (the module docstring) and its grammars and token rules dropped (the recorded tokens
    obey them); a trace of the hash model is returned as is."""
    if trace.fake_model != "recorded":
        return trace
    finished: dict[str, tuple[int, ...]] = {}
    reasons: dict[str, str] = {}
    for e in trace.expects:
        finished.update(e.finished)
        reasons.update(e.finish_reasons or {})
    events = []
    for ev in trace.events:
        if isinstance(ev, AddEvent) and (ev.sampling.structured_outputs is not None or ev.sampling.has_token_rules):
            # The recorded tokens already obey the grammar and the token rules, and the engine's
            # decisions depend on them only through those tokens (a masked row would sample the
            # fake model's masked pick, not the recording); the fake backend could not compile
            # a real grammar.
            ev = dataclasses.replace(ev, sampling=dataclasses.replace(
                ev.sampling, structured_outputs=None, min_tokens=0, bad_words=(), bad_words_token_ids=()))
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


class _Run:
    """One trace run: engine, bookkeeping of every request, and the checks."""

    def __init__(self, trace: Trace, mode: Literal["check", "record", "replay"], max_steps: int | None,
                 timeline: bool = False, grammar_backend: GrammarBackend | None = None) -> None:
        trace = replay_inputs(trace)
        self.trace = trace
        self.mode = mode
        self.result = RunResult(seed=trace.seed, timeline=[] if timeline else None)
        # A live trace's tokens by sequence name (None: the hash model).
        self.live_tokens = recorded_contexts(trace) if trace.fake_model == "recorded" else None
        proposer = make_proposer(trace.speculative, trace.vocab_size, self.true_next)
        executor = FakeExecutor(trace.vocab_size, trace.cache.block_size, trace.executor_num_blocks,
                                self.live_tokens, self.sequence_name if self.live_tokens is not None else None,
                                drafter=proposer if proposer is not None and proposer.on_device else None,
                                state_slots=trace.executor_state_slots,
                                state_snapshots=trace.executor_state_snapshots)
        self.grammars = grammar_backend or FakeGrammarBackend(trace.vocab_size, trace.eos_token_id)
        self.engine = LLMEngine(trace.scheduler, trace.cache, executor, eos_token_id=trace.eos_token_id,
                                text_streams=FakeTextStream, grammar_backend=self.grammars, proposer=proposer)
        # Requests by id; their completions (n of them) by sequence name (``sequence_name``).
        self.accepted: dict[str, AddEvent] = {}
        self.owner: dict[str, str] = {}      # sequence name -> request id
        self.rejected: set[str] = set()      # ids never accepted (so abort must raise)
        self.aborted: set[str] = set()       # names aborted while unfinished
        self.unfinished: set[str] = set()    # names of accepted requests without a final output yet
        self.expected: dict[str, Expected] = {}    # by request id (recorded model: by name)
        self.streamed: dict[str, list[int]] = {}   # tokens streamed so far, by name
        self.by_step: dict[int, list[AddEvent | AbortEvent]] = {}
        for e in trace.events:
            self.by_step.setdefault(e.step, []).append(e)
        self.recorded = {e.step: e for e in trace.expects}
        work = sum(len(e.prompt_token_ids) + e.sampling.max_tokens for e in trace.events if isinstance(e, AddEvent))
        self.max_steps = max_steps if max_steps is not None else trace.last_input_step + 200 + 10 * work

    def violation(self, step: int, msg: str) -> None:
        self.result.violations.append(f"step {step}: {msg}")
        if self.result.violation_step is None:
            self.result.violation_step = step

    def sequence_name(self, seq_id: int) -> str:
        """The name of a live sequence (recorded mode: the fake executor's key)."""
        return next(s.name for s in self.engine.requests.values() if s.seq_id == seq_id)

    # ---- inputs -------------------------------------------------------------

    def apply_add(self, step: int, ev: AddEvent) -> None:
        rid = ev.request_id
        verdict = classify_add(self.trace, ev)
        if rid in self.accepted:
            done = all(n in self.result.outputs for n in self.names(rid))
            verdict = "reject" if not done else "either"
        free, busy = self.engine.num_free_blocks, self.engine.has_unfinished_requests()
        try:
            self.engine.add_request(rid, list(ev.prompt_token_ids), ev.sampling)
        except ValueError as exc:
            if verdict == "accept":
                self.violation(step, f"add {rid!r} rejected but it fits: {exc}")
            if (self.engine.num_free_blocks, self.engine.has_unfinished_requests()) != (free, busy):
                self.violation(step, f"rejected add {rid!r} changed the engine's state")
            if rid not in self.accepted:
                self.rejected.add(rid)
            return
        if verdict == "reject":
            self.violation(step, f"add {rid!r} accepted but must be rejected "
                                 f"(prompt {len(ev.prompt_token_ids)}, max_tokens {ev.sampling.max_tokens})")
        self.accepted[rid] = ev
        for name in self.names(rid):
            self.owner[name] = rid
            self.unfinished.add(name)
        self.rejected.discard(rid)
        self.result.requests += 1

    def apply_abort(self, step: int, ev: AbortEvent) -> None:
        rid = ev.request_id
        try:
            aborted = self.engine.abort_request(rid)
        except ValueError as exc:
            if rid in self.accepted:
                self.violation(step, f"abort {rid!r} raised but it was added: {exc}")
            return
        if rid not in self.accepted:
            self.violation(step, f"abort of never-added {rid!r} returned {aborted} instead of raising ValueError")
            return
        live = [n for n in self.names(rid) if n not in self.result.outputs and n not in self.aborted]
        if aborted != bool(live):
            self.violation(step, f"abort {rid!r} returned {aborted} but the request is "
                                 f"{'unfinished' if live else 'finished'}")
        if aborted:
            self.aborted.update(live)

    def names(self, rid: str) -> list[str]:
        return [sequence_name(rid, i) for i in range(self.accepted[rid].sampling.n)]

    # ---- outputs ------------------------------------------------------------

    def true_next(self, name: str, context: list[int]) -> int | None:
        """The oracle's token after ``context`` for completion ``name`` (the fake proposer's
        truth), by position; None past its end or for a name it does not know."""
        rid = self.owner.get(name)
        if rid is None:
            return None
        i = len(context) - len(self.accepted[rid].prompt_token_ids)
        tokens = self.oracle(name).token_ids
        return tokens[i] if 0 <= i < len(tokens) else None

    def oracle(self, name: str) -> Expected:
        """The oracle's answer for a completion (the hash model ignores seeds: all n are equal;
        the recorded model has each completion's own tokens)."""
        rid = self.owner[name]
        key = rid if self.live_tokens is None else name
        if key not in self.expected:
            ev, t = self.accepted[rid], self.trace
            next_token = None
            if self.live_tokens is not None:
                live = self.live_tokens.get(name)
                next_token = lambda context: recorded_next_token(context, live, t.vocab_size)  # noqa: E731
            self.expected[key] = oracle_generate(ev.prompt_token_ids, ev.sampling, t.eos_token_id,
                                                 t.scheduler.max_model_len, t.vocab_size, next_token,
                                                 self.grammars, hybrid=t.executor_state_slots > 0)
        return self.expected[key]

    def check_stream(self, step: int, out: RequestOutput, seen: set[str]) -> None:
        """Streaming: one output per request per step (only the final one for output_kind
        FINAL_ONLY), deltas that add up, tokens that are a prefix of the oracle's, and nothing
        after the final output."""
        rid = out.name
        if rid in seen:
            self.violation(step, f"{rid!r}: two outputs in one step")
        seen.add(rid)
        if rid not in self.owner or rid in self.result.outputs:
            return  # check_output reports it (unknown, or finished twice)
        sofar = self.streamed.setdefault(rid, [])
        sofar.extend(out.new_token_ids)
        final_only = self.accepted[self.owner[rid]].sampling.output_kind is RequestOutputKind.FINAL_ONLY
        if final_only and not out.finished:
            self.violation(step, f"{rid!r}: an unfinished output for an output_kind=final_only request")
        elif (out.first_token_time is None) != (not out.token_ids):
            self.violation(step, f"{rid!r}: first_token_time {out.first_token_time} with {len(out.token_ids)} tokens")
        elif tuple(sofar) != tuple(out.token_ids):
            self.violation(step, f"{rid!r}: streamed deltas {sofar} do not add up to token_ids {list(out.token_ids)}")
        elif not out.finished and not out.new_token_ids:
            self.violation(step, f"{rid!r}: an unfinished output with no new token")
        elif tuple(sofar) != self.oracle(rid).token_ids[:len(sofar)]:
            self.violation(step, f"{rid!r}: streamed {sofar}, not a prefix of the oracle's "
                                 f"{list(self.oracle(rid).token_ids)}")
        else:
            self.check_logprobs(step, out)

    def check_logprobs(self, step: int, out: RequestOutput) -> None:
        """Logprobs of the tokens so far and the prompt's (complete once a token is out) are the oracle's."""
        want, n = self.oracle(out.name), len(out.token_ids)
        got_lp = out.logprobs if out.logprobs is None else tuple(out.logprobs)
        if got_lp != (want.logprobs if want.logprobs is None else want.logprobs[:n]):
            self.violation(step, f"{out.name!r}: logprobs {got_lp} differ from the oracle's "
                                 f"{want.logprobs if want.logprobs is None else want.logprobs[:n]}")
        if n and out.prompt_logprobs != want.prompt_logprobs:
            self.violation(step, f"{out.name!r}: prompt_logprobs {out.prompt_logprobs} differ from the "
                                 f"oracle's {want.prompt_logprobs}")

    def check_output(self, step: int, out: RequestOutput) -> None:
        rid = out.name
        if rid not in self.owner:
            self.violation(step, f"output for unknown or rejected request {rid!r}")
            return
        if rid in self.result.outputs:
            self.violation(step, f"request {rid!r} finished twice")
            return
        self.result.outputs[rid] = out
        self.unfinished.discard(rid)
        self.result.completion_tokens += len(out.token_ids)
        ev = self.accepted[self.owner[rid]]
        if tuple(out.prompt_token_ids) != ev.prompt_token_ids:
            self.violation(step, f"{rid!r}: output prompt differs from the prompt added")
        want = self.oracle(rid)
        got = tuple(out.token_ids)
        if rid in self.aborted:
            if out.finish_reason != "abort" or got != want.token_ids[: len(got)]:
                self.violation(step, f"aborted {rid!r}: got {out.finish_reason} {list(got)}, "
                                     f"want abort with a prefix of {list(want.token_ids)}")
        elif (got, out.finish_reason, out.text) != (want.token_ids, want.finish_reason, want.text):
            self.violation(step, f"{rid!r}: got {out.finish_reason} {list(got)} text {out.text!r}, "
                                 f"oracle {want.finish_reason} {list(want.token_ids)} text {want.text!r}")
        else:
            self.check_grammar(step, rid, ev, got)

    def check_grammar(self, step: int, rid: str, ev: AddEvent, got: tuple[int, ...]) -> None:
        """A constrained completion that ended with eos is a whole sentence of its grammar."""
        spec = ev.sampling.structured_outputs
        if spec is None or not got or got[-1] not in eos_token_set(self.trace.eos_token_id):
            return
        text, pattern = fake_text(got[:-1]), grammar_pattern(spec)
        if not re.fullmatch(pattern, text):  # Python's own regex engine: independent of the backends
            self.violation(step, f"{rid!r}: ended with eos but {text!r} is not in its grammar {pattern!r}")

    # ---- the step -----------------------------------------------------------

    def check_step(self, step: int, outs: list[RequestOutput], busy_before: bool) -> bool:
        """Per-step checks; returns whether the step made progress."""
        rec, cfg = self.engine.last_step, self.trace.scheduler
        scheduled = dict(rec.scheduled) if rec is not None else {}
        if sum(scheduled.values()) > cfg.max_num_batched_tokens:
            self.violation(step, f"scheduled {sum(scheduled.values())} tokens > budget {cfg.max_num_batched_tokens}")
        if len(scheduled) > cfg.max_num_seqs:
            self.violation(step, f"scheduled {len(scheduled)} sequences > max_num_seqs {cfg.max_num_seqs}")
        bad = {r: n for r, n in scheduled.items() if n < 1 or r not in self.unfinished or r in self.aborted}
        if bad:
            self.violation(step, f"scheduled with no tokens or not live: {bad}")
        seen: set[str] = set()
        for out in outs:
            self.check_stream(step, out, seen)
            if out.finished:
                self.check_output(step, out)
        self.check_cached_blocks(step)
        late = sorted(self.aborted & self.unfinished)
        if late:
            self.violation(step, f"aborted {late} not returned by the next step()")
        if not self.engine.has_unfinished_requests() and self.engine.num_free_blocks != self.trace.num_blocks:
            self.violation(step, f"idle engine has {self.engine.num_free_blocks} of {self.trace.num_blocks} "
                                 "blocks free")
        expect = self.check_record(step, outs)
        if self.mode == "record":
            self.result.expects.append(expect)
        elif self.mode == "replay":
            self.compare(step, expect)
        return bool(scheduled) or bool(outs) or not busy_before

    def check_cached_blocks(self, step: int) -> None:
        """No block in the prefix cache holds a rejected draft's token (``REJECTED``)."""
        bm = self.engine.scheduler.block_manager
        if not bm.hash_to_block:
            return
        kv = self.engine.executor.kv
        hashed = list(bm.hash_to_block.values())
        if (kv[hashed] == REJECTED).any():
            bad = [b for b in hashed if (kv[b] == REJECTED).any()]
            self.violation(step, f"prefix-cached block(s) {bad[:8]} hold a rejected draft")

    def check_record(self, step: int, outs: list[RequestOutput]) -> ExpectEvent:
        """Check ``engine.last_step`` against what the step returned; return it as an expect event."""
        rec = self.engine.last_step
        if rec is None:
            return ExpectEvent(step, {}, (), {}, self.engine.num_free_blocks)
        returned = {o.name: tuple(o.token_ids) for o in outs if o.finished}
        wrong = {r: t for r, t in rec.finished.items() if returned.get(r) != tuple(t)}
        if wrong:
            self.violation(step, f"last_step.finished {wrong} does not match the outputs returned")
        if rec.num_free_blocks != self.engine.num_free_blocks:
            self.violation(step, f"last_step.num_free_blocks {rec.num_free_blocks} != {self.engine.num_free_blocks}")
        self.result.preemptions += len(rec.preempted)
        return ExpectEvent.from_record(step, rec)

    def compare(self, step: int, got: ExpectEvent) -> None:
        if self.result.mismatch is not None:
            return
        want = self.recorded.get(step)
        if want is None:
            self.result.mismatch_step, self.result.mismatch = step, "the trace has no expectation for this step"
            return
        names = ["scheduled", "preempted", "finished", "free_blocks"]
        if want.prefill_tokens is not None:  # older traces carry no counters
            names += ["prefill_tokens", "decode_tokens"]
        if want.finish_reasons is not None:  # nor finish reasons
            names.append("finish_reasons")
        for name in names:
            if getattr(want, name) != getattr(got, name):
                self.result.mismatch_step = step
                self.result.mismatch = f"{name}: expected {getattr(want, name)}, got {getattr(got, name)}"
                return

    def run(self) -> RunResult:
        step, idle = 0, 0
        engine = self.engine
        drained_at: int | None = None  # the step when the last output arrived
        while step <= self.trace.last_input_step or self.unfinished or engine.has_unfinished_requests():
            if not self.unfinished and step > self.trace.last_input_step:
                drained_at = step if drained_at is None else drained_at
                if step - drained_at >= MAX_DRAIN_STEPS:
                    self.violation(step, f"has_unfinished_requests() still True {MAX_DRAIN_STEPS} "
                                         "steps after the last output")
                    break
            if step >= self.max_steps:
                pending = sorted(self.unfinished)
                self.violation(step, f"engine did not drain within {self.max_steps} steps; unfinished {pending}")
                break
            for ev in self.by_step.get(step, ()):
                (self.apply_add if isinstance(ev, AddEvent) else self.apply_abort)(step, ev)  # type: ignore[operator]
            busy = engine.has_unfinished_requests()
            try:
                outs = engine.step()
                engine.check_invariants()
            except Exception as exc:  # the engine's failure is the finding; keep its message
                self.violation(step, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}")
                break
            idle = 0 if self.check_step(step, outs, busy) else idle + 1
            if self.result.timeline is not None:
                self.result.timeline.append(self.timeline_step(step))
            step += 1
            if self.result.violations:
                break  # later steps would only repeat the first finding
            if idle >= MAX_IDLE_STEPS:
                self.violation(step, f"{idle} steps in a row scheduled nothing with requests unfinished")
                break
        self.result.steps = step
        if not self.result.violations:
            self.finish_checks(step)
        return self.result

    def timeline_step(self, step: int) -> TimelineStep:
        """This step's ``TimelineStep``, from ``engine.last_step`` and the block manager."""
        rec, bm = self.engine.last_step, self.engine.scheduler.block_manager
        assert rec is not None, "step() always records its decisions"
        cached_free = sum(bm.block_hash[b] is not None for b in bm.free_blocks)
        aborted = sum(r == "abort" for r in rec.finish_reasons.values())
        return TimelineStep(
            step=step, prefill_tokens=rec.num_prefill_tokens - rec.num_chunked_tokens,
            chunked_tokens=rec.num_chunked_tokens, decode_tokens=rec.num_decode_tokens,
            cached_tokens=rec.num_cached_tokens, running=rec.num_running, waiting=rec.num_waiting,
            used_blocks=bm.num_blocks - rec.num_free_blocks, cached_free_blocks=cached_free,
            uncached_free_blocks=rec.num_free_blocks - cached_free, preempted=len(rec.preempted),
            aborted=aborted, finished=len(rec.finished) - aborted)

    def finish_checks(self, step: int) -> None:
        engine, r = self.engine, self.result
        if engine.has_unfinished_requests():
            self.violation(step, "all requests finished but has_unfinished_requests() is True")
        if engine.num_free_blocks != self.trace.num_blocks:
            self.violation(step, f"idle engine has {engine.num_free_blocks} of {self.trace.num_blocks} blocks free")
        for rid in sorted(self.rejected):
            try:
                engine.abort_request(rid)
                self.violation(step, f"rejected request {rid!r} is known to the engine")
            except ValueError:
                pass
        s = engine.stats
        aborted = {self.owner[n] for n in self.aborted}
        if s.num_aborts != len(aborted):
            self.violation(step, f"stats.num_aborts {s.num_aborts} != {len(aborted)} aborted")
        if s.num_preemptions != r.preemptions:
            self.violation(step, f"stats.num_preemptions {s.num_preemptions} != {r.preemptions} recorded")
        if self.mode == "replay" and r.mismatch is None and self.trace.expects:
            extra = [e.step for e in self.trace.expects if e.step >= step]
            if extra:
                r.mismatch_step = step
                r.mismatch = f"the run ended after {step} steps; the trace expects step {extra[0]}"
        r.rejected = len(self.rejected)
        r.prefill_tokens, r.decode_tokens = s.num_prefill_tokens, s.num_decode_tokens
        r.cached_tokens, r.chunked_prefills, r.aborts = s.num_cached_tokens, s.num_chunked_prefills, s.num_aborts


def run_trace(trace: Trace, mode: Literal["check", "record", "replay"] = "check",
              max_steps: int | None = None, timeline: bool = False,
              grammar_backend: GrammarBackend | None = None) -> RunResult:
    """Run ``trace`` through a fresh engine and return what was found.

    Args:
        trace: the inputs (and, for ``replay``, the expected decisions).
        mode: ``check`` only judges; ``record`` also fills ``result.expects``;
            ``replay`` compares each step with the trace's expect events.
        max_steps: give up (a liveness violation) after this many steps; the
            default is generous: the last input step + 200 + 10 x all tokens.
        timeline: also fill ``result.timeline`` (one ``TimelineStep`` per step).
        grammar_backend: the grammars of engine and oracle over the fake vocabulary; default
            ``sim.grammar.FakeGrammarBackend`` (tests pass xgrammar's).
    """
    try:
        run = _Run(trace, mode, max_steps, timeline, grammar_backend)
    except Exception as exc:  # a valid trace must build an engine; the failure is the finding
        return RunResult(seed=trace.seed, violations=[f"engine construction: {type(exc).__name__}: {exc}"])
    return run.run()


def record_trace(trace: Trace) -> tuple[Trace, RunResult]:
    """Run ``trace`` and return it with one expect event per step."""
    result = run_trace(trace, "record")
    return trace.with_expects(result.expects), result
