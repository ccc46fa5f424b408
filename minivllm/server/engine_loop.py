"""The engine loop of the server: one thread steps the engine; asyncio handlers talk to it.

::

    event loop (HTTP handlers)             engine thread (owns the LLMEngine)
    ---------------------------            ----------------------------------
    add_requests() --_Admit--> inbox --->  validate all, add all, settle future
    abort()        --_Abort--> inbox --->  engine.abort_request
                                           step(); per output: detokenize
    group.queue  <---- call_soon_threadsafe(Delta) ------------/

Only the engine thread touches the ``LLMEngine``: handlers post commands to an
inbox (a list under a lock) and set ``_wakeup``; the thread sleeps on that event
whenever the inbox is empty and the engine has nothing unfinished, so an idle
server burns no CPU. Admission is checked on the engine thread too (by the
engine's own ``validate_request``), so it never reads engine state that a step
is changing; the handler awaits the verdict. An exception out of the engine
ends the thread and is handed to every waiting request (``EngineDeadError``):
they fail rather than hang, later requests are refused, and the ``on_failure``
callbacks run (``app.serve`` shuts the server down).

A request with ``n`` completions is one engine request whose outputs carry their
``index``; each completion is a *choice* here (OpenAI's ``choices[i]``: prompt i's
completion j is choice ``i * n + j``), with its own detokenizer and text. A choice
whose request has stop strings holds back its last ``longest stop - 1`` characters
until more text shows they do not start a stop string, so no streamed delta is
ever taken back; the engine's final text (cut before the stop string) ends it.
If the engine goes idle while a choice is unfinished (it lost an output: a bug),
the choice fails with ``RequestLostError`` instead of waiting forever.

After every loop the thread records the step in ``ServerMetrics`` (``/metrics``), and
each completion's events as they happen: admission, first scheduling (``ScheduleWatch``
names the sequences a step scheduled first), tokens, and its end. A client's abort stops
its deltas at once, but its choices stay tracked until the engine's abort output comes:
that output carries the tokens generated but not yet delivered (all of them, for a
non-streamed request), which count as generated.

Everything that touches the engine goes through five hooks (``_admit``, ``_abort``,
``_has_work``, ``_step``, ``_counts``); ``engine_process.ProcessAsyncEngine``
replaces them to run the engine in another process, keeping the rest.

Importing this module imports no ``prometheus_client`` (the ``serve`` extra):
``engine_process`` is imported for its thread sizing by commands that serve nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Union

from minivllm.detokenizer import IncrementalDetokenizer, Tokenizer
from minivllm.engine.llm_engine import LLMEngine, StepRecord
from minivllm.outputs import FinishReason, RequestOutput, StopReason, sequence_name, text_token_ids
from minivllm.sampling import SamplingParams

if TYPE_CHECKING:
    from minivllm.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (an engine exception, or shutdown); no request can be served."""


@dataclass(frozen=True)
class Delta:
    """What one engine step added to one choice (one completion of one prompt) of a group.

    Attributes:
        index: the OpenAI choice index: prompt i's completion j is ``i * n + j``.
        text: newly final text (may be "" while a character is incomplete, or while
            the text could still turn into a stop string).
        token_ids: completion tokens new since the previous delta.
        logprobs: with ``SamplingParams.logprobs``, per token of ``token_ids``,
            {token id: log-probability} of the top N and of the token itself; else None.
        num_prompt_tokens: the prompt's length.
        num_completion_tokens: completion tokens so far (the stop token included).
        finish_reason: None while the choice runs.
        stop_reason: as in ``RequestOutput`` (set in the last delta only).
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, in the choice's first delta
            (as ``RequestOutput.prompt_logprobs``: None for the first prompt token); else None.
        num_cached_tokens: prompt tokens the prefix cache served (``RequestOutput``'s).
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[dict[int, float], ...] | None
    num_prompt_tokens: int
    num_completion_tokens: int
    finish_reason: FinishReason | None
    stop_reason: StopReason = None
    prompt_logprobs: tuple[dict[int, float] | None, ...] | None = None
    num_cached_tokens: int = 0


def merge_deltas(ds: Sequence[Delta]) -> Delta:
    """Consecutive deltas of one choice as one: texts, tokens and logprobs joined, the
    counts, finish and stop reason of the last."""
    last = ds[-1]
    logprobs = None if last.logprobs is None else tuple(x for d in ds for x in d.logprobs or ())
    return Delta(last.index, "".join(d.text for d in ds), tuple(t for d in ds for t in d.token_ids),
                 logprobs, last.num_prompt_tokens, last.num_completion_tokens, last.finish_reason,
                 last.stop_reason, ds[0].prompt_logprobs, last.num_cached_tokens)


class StepOutput(NamedTuple):
    """One request's part of an engine step, as the engine thread needs it: the new tokens,
    not the whole completion (what crosses the pipe from an engine process, see
    ``minivllm.server.engine_process``).

    Attributes:
        request_id, index, finish_reason, stop_reason: as in ``RequestOutput``.
        new_token_ids: completion tokens new in this step.
        num_tokens: completion tokens so far.
        text: the engine's final text (requests with stop strings, once finished), else None.
        new_logprobs: logprobs of ``new_token_ids`` (``SamplingParams.logprobs``), else None.
        first_token_time: as in ``RequestOutput`` (the engine's clock: ``time.monotonic``,
            which an engine process shares with the server on one host).
        prompt_logprobs: as in ``RequestOutput``, in a choice's first output with tokens only.
        num_cached_tokens: as in ``RequestOutput``.
    """

    request_id: str
    index: int
    new_token_ids: tuple[int, ...]
    num_tokens: int
    finish_reason: FinishReason | None
    text: str | None
    new_logprobs: tuple[dict[int, float], ...] | None
    first_token_time: float | None
    stop_reason: StopReason = None
    prompt_logprobs: tuple[dict[int, float] | None, ...] | None = None
    num_cached_tokens: int = 0


def step_output(out: RequestOutput) -> StepOutput:
    new = out.new_token_ids
    logprobs = out.logprobs[len(out.token_ids) - len(new):] if out.logprobs is not None else None
    first = len(new) == len(out.token_ids) > 0  # the choice's first tokens: its prompt's logprobs go along
    return StepOutput(out.request_id, out.index, tuple(new), len(out.token_ids), out.finish_reason,
                      out.text, logprobs, out.first_token_time, out.stop_reason,
                      out.prompt_logprobs if first else None, out.num_cached_tokens)


def admit_into(engine: LLMEngine, request_ids: Sequence[str], prompts: Sequence[Sequence[int]],
               params: SamplingParams) -> BaseException | None:
    """Validate every request, then add them all; the validation error, or None when added."""
    try:
        for rid, prompt in zip(request_ids, prompts):
            engine.validate_request(rid, prompt, params)
    except (ValueError, TypeError) as e:
        return e
    for rid, prompt in zip(request_ids, prompts):
        engine.add_request(rid, prompt, params)
    return None


@dataclass(frozen=True)
class StepCounts:
    """What the engine reported after a step (``ServerMetrics.step``).

    Attributes:
        running / waiting: sequences in the scheduler's queues (+ requests not admitted yet).
        blocks_used / blocks_total: KV blocks held by sequences / in the pool.
        batch_size: sequences scheduled in the step (0: the step only delivered outputs).
        steps, cached_tokens, computed_prefill_tokens, preemptions: the engine's
            running totals (``EngineStats``) after the step.
        drafts, draft_tokens, accepted_tokens, accepted_per_position: speculative
            decoding's running totals (``EngineStats``).
        first_scheduled: names (``sequence_name``) of the sequences the step scheduled
            for the first time (``ScheduleWatch``).
        step_start: ``time.monotonic()`` when the step began: their queue time ends there.
    """

    running: int
    waiting: int
    blocks_used: int
    blocks_total: int
    batch_size: int
    steps: int
    cached_tokens: int
    computed_prefill_tokens: int
    preemptions: int
    first_scheduled: tuple[str, ...] = ()
    step_start: float = 0.0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()


NO_COUNTS = StepCounts(0, 0, 0, 0, 0, 0, 0, 0, 0)


class ScheduleWatch:
    """Names the sequences each step scheduled for the first time.

    The engine's record of a step names every sequence it scheduled; this remembers the
    names seen (until their sequence finishes), so that only new ones are passed on: a
    few names a step, not the whole batch, cross the pipe from an engine process.
    """

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def first_scheduled(self, record: StepRecord) -> tuple[str, ...]:
        """The names in ``record`` (the engine's ``last_step``, once per step) not seen before."""
        new = tuple(name for name in record.scheduled if name not in self._seen)
        self._seen.update(new)
        self._seen.difference_update(record.finished)  # aborted ones included: they end in a step
        return new


def engine_counts(engine: LLMEngine, watch: ScheduleWatch | None = None,
                  step_start: float = 0.0) -> StepCounts:
    """The engine's queues, pool and running totals (``ServerMetrics.step``): after a step
    (``watch`` names the sequences it scheduled first; ``step_start``: when it began), or,
    without ``watch``, between steps (batch size 0)."""
    sched, last, stats = engine.scheduler, engine.last_step, engine.stats
    batch_size, first = (0, ()) if watch is None or last is None else (len(last.scheduled),
                                                                       watch.first_scheduled(last))
    return StepCounts(
        running=len(sched.running), waiting=len(sched.waiting),
        blocks_used=engine.num_blocks - engine.num_free_blocks, blocks_total=engine.num_blocks,
        batch_size=batch_size, steps=stats.num_steps, cached_tokens=stats.num_cached_tokens,
        computed_prefill_tokens=stats.num_prefill_tokens, preemptions=stats.num_preemptions,
        first_scheduled=first, step_start=step_start, drafts=stats.num_drafts, draft_tokens=stats.num_draft_tokens,
        accepted_tokens=stats.num_accepted_tokens, accepted_per_position=tuple(stats.accepted_per_position))


class RequestLostError(RuntimeError):
    """The engine went idle without finishing a choice (an engine bug; answered with 500)."""


QueueItem = Union[Delta, EngineDeadError, RequestLostError]


class RequestGroup:
    """The requests of one HTTP call (one per prompt, each with ``n`` choices), whose deltas
    share one queue.

    Iterate it (``async for delta in group``) to receive every delta until each
    choice has finished; an engine failure raises ``EngineDeadError`` there.
    """

    def __init__(self, request_ids: Sequence[str], n: int = 1) -> None:
        self.request_ids = tuple(request_ids)
        self.n = n
        self.num_choices = len(self.request_ids) * n
        self.queue: asyncio.Queue[QueueItem] = asyncio.Queue()
        self._unfinished = self.num_choices

    @property
    def finished(self) -> bool:
        return self._unfinished == 0

    async def __aiter__(self) -> AsyncIterator[Delta]:
        """Each choice's deltas in order. What waits in the queue when the consumer comes
        back for more is taken at once and merged per choice (``merge_deltas``): a stream
        whose HTTP side falls behind the engine (hundreds of streams on one event loop)
        then sends fewer, larger chunks instead of a growing backlog, as vLLM's output
        collector merges deltas its consumer has not taken yet."""
        while self._unfinished:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            waiting: dict[int, list[Delta]] = {}
            error: EngineDeadError | RequestLostError | None = None
            for item in items:
                if isinstance(item, (EngineDeadError, RequestLostError)):
                    error = item
                    break
                waiting.setdefault(item.index, []).append(item)
            for ds in waiting.values():
                d = ds[0] if len(ds) == 1 else merge_deltas(ds)
                if d.finish_reason is not None:
                    self._unfinished -= 1
                yield d
            if error is not None:
                raise error


@dataclass
class _Admit:
    """Add these requests, all or none (the engine thread settles ``admitted``)."""

    group: RequestGroup
    prompts: list[list[int]]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    admitted: asyncio.Future[None]
    arrival: float   # time.monotonic() when the handler posted it


@dataclass(frozen=True)
class _Abort:
    request_ids: tuple[str, ...]


@dataclass
class _Choice:
    """Engine-thread state of one admitted choice.

    Its text goes out in three parts: ``num_sent_chars`` already sent, ``held`` final
    text held back because a stop string may still begin there (the last
    ``holdback`` = longest stop string - 1 characters), and the detokenizer's tokens
    still mid-character. When a stop string ends the choice, the engine's text (cut
    before it) replaces what was held.
    """

    group: RequestGroup
    index: int
    loop: asyncio.AbstractEventLoop
    detokenizer: IncrementalDetokenizer
    num_prompt_tokens: int
    holdback: int
    arrival: float
    held: str = ""
    num_sent_chars: int = 0
    num_tokens: int = 0              # completion tokens so far
    first_token_time: float | None = None
    last_delivery: float | None = None  # time.monotonic() when tokens of it were last delivered
    aborted: bool = False            # by its client: no more deltas; it ends with the engine's output

    def count_gaps(self, num_new: int, now: float, gaps: dict[tuple[float, int], int]) -> None:
        """Add this delivery's ``num_new`` tokens to ``gaps`` ((time of the token before, gaps)
        -> completions): each token after the first is a gap from the one before; the gaps of
        several tokens delivered at once are taken as equal."""
        before: float | None = self.last_delivery
        n = num_new
        if before is None:  # the first token delivered follows no other
            before, n = self.first_token_time, num_new - 1
        self.last_delivery = now
        if n > 0 and before is not None:
            gaps[before, n] = gaps.get((before, n), 0) + 1

    def next_text(self, released: str, out: StepOutput) -> str:
        """The text to send now, given the detokenizer's newly ``released`` text."""
        if out.finish_reason is None:
            avail = self.held + released
            cut = max(0, len(avail) - self.holdback)
            text, self.held = avail[:cut], avail[cut:]
        elif out.text is not None:   # the engine watched the text (stop strings): its cut wins
            text, self.held = out.text[self.num_sent_chars:], ""
        else:
            text, self.held = self.held + released + self.detokenizer.flush(), ""
        self.num_sent_chars += len(text)
        return text


def _notify(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` on ``loop``'s thread; a closed loop has nobody left to tell."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # "Event loop is closed"
        pass


def _put_all(items: list[tuple[asyncio.Queue[QueueItem], QueueItem]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # the handler was cancelled meanwhile
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class AsyncEngine:
    """Runs an ``LLMEngine`` in one background thread for asyncio request handlers.

    Args:
        engine: the engine; from now on only this object's thread may use it.
        tokenizer: decodes completion tokens into text deltas.
        metrics: where the engine thread records steps and requests (default: new ones).
    """

    def __init__(self, engine: LLMEngine, tokenizer: Tokenizer,
                 metrics: ServerMetrics | None = None) -> None:
        if metrics is None:
            from minivllm.server.metrics import ServerMetrics  # here: see the module docstring

            metrics = ServerMetrics()
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._lock = threading.Lock()      # guards _inbox, _error, _closed
        self._inbox: list[_Admit | _Abort] = []
        self._applying: list[_Admit | _Abort] = []  # taken from the inbox, being applied
        self._error: EngineDeadError | None = None
        self._closed = False
        self._wakeup = threading.Event()   # set: the inbox has commands
        self._idle = threading.Event()     # set: inbox empty and nothing unfinished
        # Engine thread only: per unfinished request id, its choices (None once finished);
        # per sequence name of a choice never scheduled yet, its arrival.
        self._tracked: dict[str, list[_Choice | None]] = {}
        self._queued: dict[str, float] = {}
        self._watch = ScheduleWatch()
        self._failure_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)

    @classmethod
    def from_llm(cls, llm: Any, metrics: ServerMetrics | None = None) -> "AsyncEngine":
        """An ``AsyncEngine`` over an ``LLM``'s engine and tokenizer.

        Raises:
            ValueError: the LLM has no tokenizer (``skip_tokenizer_init``).
        """
        if llm.tokenizer is None:
            raise ValueError("serving needs a tokenizer; this LLM was built with skip_tokenizer_init")
        return cls(llm.engine, llm.tokenizer, metrics)

    # ---- lifecycle (event-loop side) -----------------------------------------

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if not self._thread.is_alive() and self._thread.ident is None:
            self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine thread after its current step; waiting requests get ``EngineDeadError``."""
        with self._lock:
            self._closed = True
            self._wakeup.set()
        if self._thread.ident is not None:
            self._thread.join(timeout)

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + completion) the engine accepts."""
        return self.engine.scheduler_config.max_model_len

    @property
    def error(self) -> EngineDeadError | None:
        """Why the engine thread stopped, or None while it serves."""
        return self._error

    def on_failure(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Have ``callback(error)`` called, on the engine thread, if the engine fails (not
        when it is closed), after every waiting request has been handed the error."""
        self._failure_callbacks.append(callback)

    def wait_idle(self, timeout: float) -> bool:
        """Block until no request is queued or unfinished; False on timeout (for tests)."""
        return self._idle.wait(timeout)

    # ---- requests (event-loop side) ------------------------------------------

    async def add_requests(self, request_ids: Sequence[str], prompts: Sequence[Sequence[int]],
                           params: SamplingParams) -> RequestGroup:
        """Queue one request per prompt (each with ``params.n`` choices), all or none; returns
        the group to iterate.

        Raises:
            ValueError, TypeError: the engine refuses one of them (nothing queued).
            EngineDeadError: the engine thread has stopped.
        """
        loop = asyncio.get_running_loop()
        group = RequestGroup(request_ids, params.n)
        admitted: asyncio.Future[None] = loop.create_future()
        self._post(_Admit(group, [list(p) for p in prompts], params, loop, admitted, time.monotonic()))
        try:
            await admitted
        except asyncio.CancelledError:
            self.abort(group.request_ids)  # admitted or not: aborting an unknown id is a no-op
            raise
        return group

    async def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                          params: SamplingParams) -> RequestGroup:
        """``add_requests`` for one prompt."""
        return await self.add_requests([request_id], [prompt_token_ids], params)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort these requests (finished or unknown ones are skipped); thread-safe, never blocks
        on a step. Called when a client disconnects."""
        try:
            self._post(_Abort(tuple(request_ids)))
        except EngineDeadError:
            pass  # nothing runs any more

    def _post(self, command: _Admit | _Abort) -> None:
        with self._lock:
            if self._error is not None:
                raise self._error
            self._inbox.append(command)
            self._idle.clear()
            self._wakeup.set()

    # ---- the engine thread ---------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed:
                        break
                    commands, self._inbox = self._inbox, []
                    self._applying = commands  # settled by _fail if applying them raises
                    idle = not commands and not self._has_work()
                    if idle:
                        self._wakeup.clear()
                        self._idle.set()
                if idle:
                    self._wakeup.wait()
                    continue
                self._apply_all(commands)
                counts = None
                if self._has_work():
                    outputs, counts = self._step()
                    self._scheduled(counts)
                    self._deliver(outputs)
                if self._tracked and not self._has_work():
                    self._fail_lost()
                self._record_step(counts if counts is not None else self._counts())
        except Exception as e:  # surfaced to every waiting request, never swallowed
            logger.exception("engine thread failed")
            error = EngineDeadError(f"engine failed: {type(e).__name__}: {e}")
            self._fail(error)
            for callback in self._failure_callbacks:
                callback(error)
        else:
            self._fail(EngineDeadError("engine shut down"))

    def _apply_all(self, commands: list[_Admit | _Abort]) -> None:
        """Apply the commands in order: aborts at once, admissions in runs (one verdict
        each, all the run's requests or none of one command's)."""
        for is_admit, run in itertools.groupby(commands, key=lambda c: isinstance(c, _Admit)):
            if is_admit:
                admits = list(run)
                batch = [(a.group.request_ids, a.prompts, a.params) for a in admits]  # type: ignore[union-attr]
                for admit, error in zip(admits, self._admit(batch)):
                    self._admitted(admit, error)  # type: ignore[arg-type]
                continue
            for command in run:
                self._abort_tracked(command.request_ids)

    def _abort_tracked(self, request_ids: Sequence[str]) -> None:
        """Stop the deltas of these requests' unfinished choices and have the engine abort
        them; each choice ends when the engine's abort output comes (``_deliver``)."""
        aborted = []
        for rid in request_ids:
            live = [c for c in self._tracked.get(rid, ()) if c is not None and not c.aborted]
            for c in live:
                c.aborted = True
            if live:
                aborted.append(rid)
        if aborted:
            self._abort(aborted)
            self.metrics.aborted.inc(len(aborted))

    # ---- what touches the engine (``ProcessAsyncEngine`` replaces these) -------

    def _admit(self, batch: list[tuple[tuple[str, ...], list[list[int]], SamplingParams]]
               ) -> list[BaseException | None]:
        """Validate and add each (request ids, prompts, params): all of one or none of it."""
        return [admit_into(self.engine, rids, prompts, params) for rids, prompts, params in batch]

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort_request(rid)

    def _has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def _step(self) -> tuple[list[StepOutput], StepCounts]:
        """One engine step: its outputs, and the counts after it."""
        start = time.monotonic()
        outputs = [step_output(o) for o in self.engine.step()]
        return outputs, engine_counts(self.engine, self._watch, start)

    def _counts(self) -> StepCounts:
        """The counts when no step ran."""
        return engine_counts(self.engine)

    # ---- the engine thread's bookkeeping --------------------------------------

    def _admitted(self, command: _Admit, error: BaseException | None) -> None:
        if error is not None:
            _notify(command.loop, _settle, command.admitted, error)
            return
        group, params = command.group, command.params
        holdback = max((len(s) for s in params.stop), default=1) - 1
        for i, (rid, prompt) in enumerate(zip(group.request_ids, command.prompts)):
            self._tracked[rid] = [
                _Choice(group, i * group.n + j, command.loop,
                        IncrementalDetokenizer(self.tokenizer, prompt, skip_special_tokens=params.skip_special_tokens),
                        len(prompt), holdback, command.arrival)
                for j in range(group.n)]
            for j in range(group.n):
                self._queued[sequence_name(rid, j)] = command.arrival
        self.metrics.admitted([len(p) for p in command.prompts])
        _notify(command.loop, _settle, command.admitted, None)

    def _scheduled(self, counts: StepCounts) -> None:
        """Observe the queue time of the sequences the step scheduled first."""
        for name in counts.first_scheduled:
            arrival = self._queued.pop(name, None)
            if arrival is not None:
                self.metrics.queued(counts.step_start - arrival)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        """Turn the engine's streamed outputs (``new_token_ids`` per step) into deltas, handed to
        each event loop in ONE call per step (a thread-safe call writes to the loop's wake-up
        socket: once per output it cost more than the detokenizing)."""
        now = time.monotonic()
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[QueueItem], Delta]]] = {}
        # One metrics update a step, not one per output: prometheus_client takes a lock per call.
        generated = 0
        gaps: dict[tuple[float, int], int] = {}
        for out in outputs:
            new = out.new_token_ids
            generated += len(new)  # an aborted choice's too: the engine generated them
            choices = self._tracked.get(out.request_id)
            c = choices[out.index] if choices is not None and out.index < len(choices) else None
            if c is None:
                continue  # failed meanwhile (RequestLostError)
            c.num_tokens = out.num_tokens
            done = out.finish_reason is not None
            if not new and not done:
                continue
            if c.first_token_time is None and out.first_token_time is not None:
                # The engine's time, not this delivery's: a non-streamed request (final_only)
                # is delivered once, at its end.
                c.first_token_time = out.first_token_time
                self.metrics.first_token(c.first_token_time - c.arrival)
            if new:
                c.count_gaps(len(new), now, gaps)
            if done:
                self._finished(out, c, now)
            if c.aborted:
                continue  # nobody reads its deltas any more
            shown = text_token_ids(new, out.finish_reason)
            text = c.next_text(c.detokenizer.add(shown), out)
            delta = Delta(c.index, text, tuple(new), out.new_logprobs, c.num_prompt_tokens, c.num_tokens,
                          out.finish_reason, out.stop_reason, out.prompt_logprobs, out.num_cached_tokens)
            batches.setdefault(c.loop, []).append((c.group.queue, delta))
        if generated:
            self.metrics.generated(generated)
        for (before, n), count in gaps.items():
            self.metrics.inter_token((now - before) / n, n * count)
        for loop, items in batches.items():
            _notify(loop, _put_all, items)

    def _finished(self, out: StepOutput, c: _Choice, now: float) -> None:
        choices = self._tracked[out.request_id]
        choices[out.index] = None
        if not any(choices):
            del self._tracked[out.request_id]
        self._queued.pop(sequence_name(out.request_id, out.index), None)  # aborted while waiting
        assert out.finish_reason is not None
        tpot = None
        if c.first_token_time is not None and c.num_tokens > 1:
            tpot = (now - c.first_token_time) / (c.num_tokens - 1)
        self.metrics.finished_completion(out.finish_reason, now - c.arrival, c.num_prompt_tokens,
                                         c.num_tokens, tpot)

    def _fail_lost(self) -> None:
        """The engine is idle, so choices still tracked will never finish: fail them."""
        for rid, choices in self._tracked.items():
            for c in choices:
                if c is not None:
                    error = RequestLostError(f"request {rid!r}: the engine went idle without finishing "
                                             f"choice {c.index}")
                    _notify(c.loop, c.group.queue.put_nowait, error)
        self._tracked.clear()
        self._queued.clear()

    def _record_step(self, counts: StepCounts) -> None:
        with self._lock:
            inbox = sum(len(c.prompts) for c in self._inbox if isinstance(c, _Admit))
        self.metrics.step(dataclasses.replace(counts, waiting=counts.waiting + inbox))

    def _fail(self, error: EngineDeadError) -> None:
        with self._lock:
            self._error = error
            commands, self._inbox = self._applying + self._inbox, []
            self._idle.set()
        for command in commands:  # a settled one (admitted before the failure) is left alone
            if isinstance(command, _Admit):
                _notify(command.loop, _settle, command.admitted, error)
        for choices in self._tracked.values():
            for c in choices:
                if c is not None:
                    _notify(c.loop, c.group.queue.put_nowait, error)
        self._tracked.clear()
        self._queued.clear()
