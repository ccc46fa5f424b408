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
they fail rather than hang, and later requests are refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Union

from minivllm.detokenizer import IncrementalDetokenizer, Tokenizer
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import FinishReason, RequestOutput
from minivllm.sampling import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (an engine exception, or shutdown); no request can be served."""


@dataclass(frozen=True)
class Delta:
    """What one engine step added to one request of a group.

    Attributes:
        index: the request's position in its group (the OpenAI choice index).
        text: newly final text (may be "" while a character is incomplete).
        token_ids: completion tokens new since the previous delta.
        num_prompt_tokens: the request's prompt length.
        num_completion_tokens: completion tokens so far (the stop token included).
        finish_reason: None while the request runs.
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_completion_tokens: int
    finish_reason: FinishReason | None


@dataclass(frozen=True)
class EngineMetrics:
    """Counters published by the engine thread after each step (read by /metrics)."""

    requests_total: int = 0        # requests admitted
    requests_running: int = 0
    requests_waiting: int = 0      # queued in the scheduler or the inbox
    requests_aborted_total: int = 0
    generation_tokens_total: int = 0
    engine_steps_total: int = 0


QueueItem = Union[Delta, EngineDeadError]


class RequestGroup:
    """The requests of one HTTP call (one per prompt), whose deltas share one queue.

    Iterate it (``async for delta in group``) to receive every delta until each
    request has finished; an engine failure raises ``EngineDeadError`` there.
    """

    def __init__(self, request_ids: Sequence[str]) -> None:
        self.request_ids = tuple(request_ids)
        self.queue: asyncio.Queue[QueueItem] = asyncio.Queue()
        self._unfinished = len(self.request_ids)

    @property
    def finished(self) -> bool:
        return self._unfinished == 0

    async def __aiter__(self) -> AsyncIterator[Delta]:
        while self._unfinished:
            item = await self.queue.get()
            if isinstance(item, EngineDeadError):
                raise item
            if item.finish_reason is not None:
                self._unfinished -= 1
            yield item


@dataclass
class _Admit:
    """Add these requests, all or none (the engine thread settles ``admitted``)."""

    group: RequestGroup
    prompts: list[list[int]]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    admitted: asyncio.Future[None]


@dataclass(frozen=True)
class _Abort:
    request_ids: tuple[str, ...]


@dataclass
class _Tracked:
    """Engine-thread state of one admitted request."""

    group: RequestGroup
    index: int
    loop: asyncio.AbstractEventLoop
    detokenizer: IncrementalDetokenizer
    num_prompt_tokens: int
    num_tokens: int = 0   # completion tokens so far


def _notify(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` on ``loop``'s thread; a closed loop has nobody left to tell."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # "Event loop is closed"
        pass


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
    """

    def __init__(self, engine: LLMEngine, tokenizer: Tokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = EngineMetrics()
        self._lock = threading.Lock()      # guards _inbox, _error, _closed
        self._inbox: list[_Admit | _Abort] = []
        self._error: EngineDeadError | None = None
        self._closed = False
        self._wakeup = threading.Event()   # set: the inbox has commands
        self._idle = threading.Event()     # set: inbox empty and nothing unfinished
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)

    @classmethod
    def from_llm(cls, llm: Any) -> "AsyncEngine":
        """An ``AsyncEngine`` over an ``LLM``'s engine and tokenizer.

        Raises:
            ValueError: the LLM has no tokenizer (``skip_tokenizer_init``).
        """
        if llm.tokenizer is None:
            raise ValueError("serving needs a tokenizer; this LLM was built with skip_tokenizer_init")
        return cls(llm.engine, llm.tokenizer)

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
    def error(self) -> EngineDeadError | None:
        """Why the engine thread stopped, or None while it serves."""
        return self._error

    def wait_idle(self, timeout: float) -> bool:
        """Block until no request is queued or unfinished; False on timeout (for tests)."""
        return self._idle.wait(timeout)

    # ---- requests (event-loop side) ------------------------------------------

    async def add_requests(self, request_ids: Sequence[str], prompts: Sequence[Sequence[int]],
                           params: SamplingParams) -> RequestGroup:
        """Queue one request per prompt, all or none; returns the group to iterate.

        Raises:
            ValueError, TypeError: the engine refuses one of them (nothing queued).
            EngineDeadError: the engine thread has stopped.
        """
        loop = asyncio.get_running_loop()
        group = RequestGroup(request_ids)
        admitted: asyncio.Future[None] = loop.create_future()
        self._post(_Admit(group, [list(p) for p in prompts], params, loop, admitted))
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
                    idle = not commands and not self.engine.has_unfinished_requests()
                    if idle:
                        self._wakeup.clear()
                        self._idle.set()
                if idle:
                    self._wakeup.wait()
                    continue
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                self._publish_metrics()
        except Exception as e:  # surfaced to every waiting request, never swallowed
            logger.exception("engine thread failed")
            self._fail(EngineDeadError(f"engine failed: {type(e).__name__}: {e}"))
        else:
            self._fail(EngineDeadError("engine shut down"))

    def _apply(self, command: _Admit | _Abort) -> None:
        if isinstance(command, _Abort):
            for rid in command.request_ids:
                if self._tracked.pop(rid, None) is not None:
                    self.engine.abort_request(rid)
                    self._count(requests_aborted_total=1)
            return
        try:
            for rid, prompt in zip(command.group.request_ids, command.prompts):
                self.engine.validate_request(rid, prompt, command.params)
        except (ValueError, TypeError) as e:
            _notify(command.loop, _settle, command.admitted, e)
            return
        for i, (rid, prompt) in enumerate(zip(command.group.request_ids, command.prompts)):
            self.engine.add_request(rid, prompt, command.params)
            self._tracked[rid] = _Tracked(command.group, i, command.loop,
                                          IncrementalDetokenizer(self.tokenizer, prompt), len(prompt))
        self._count(requests_total=len(command.prompts))
        _notify(command.loop, _settle, command.admitted, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Turn the engine's streamed outputs (``new_token_ids`` per step) into deltas."""
        new_tokens = 0
        for out in outputs:
            t = self._tracked.get(out.request_id)
            if t is None:
                continue  # aborted by its client
            new = out.new_token_ids
            t.num_tokens = len(out.token_ids)
            new_tokens += len(new)
            done = out.finish_reason is not None
            if not new and not done:
                continue
            # The eos/stop token that ends a request is not part of its text.
            shown = new[:-1] if out.finish_reason == "stop" and new else new
            text = t.detokenizer.add(shown)
            if done:
                text += t.detokenizer.flush()
                del self._tracked[out.request_id]
            delta = Delta(t.index, text, tuple(new), t.num_prompt_tokens, t.num_tokens,
                          out.finish_reason)
            _notify(t.loop, t.group.queue.put_nowait, delta)
        self._count(generation_tokens_total=new_tokens)

    def _count(self, **increments: int) -> None:
        m = self.metrics
        self.metrics = dataclasses.replace(
            m, **{k: getattr(m, k) + v for k, v in increments.items()})

    def _publish_metrics(self) -> None:
        sched = self.engine.scheduler
        with self._lock:
            inbox = sum(len(c.prompts) for c in self._inbox if isinstance(c, _Admit))
        # One reference assignment: readers on other threads see a whole snapshot.
        self.metrics = dataclasses.replace(
            self.metrics, requests_running=len(sched.running),
            requests_waiting=len(sched.waiting) + inbox,
            engine_steps_total=self.engine.stats.num_steps)

    def _fail(self, error: EngineDeadError) -> None:
        with self._lock:
            self._error = error
            commands, self._inbox = self._inbox, []
            self._idle.set()
        for command in commands:
            if isinstance(command, _Admit):
                _notify(command.loop, _settle, command.admitted, error)
        for t in self._tracked.values():
            _notify(t.loop, t.group.queue.put_nowait, error)
        self._tracked.clear()
