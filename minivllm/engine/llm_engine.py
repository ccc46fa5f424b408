"""The engine loop: requests in, a plan per step to the executor, outputs back.

Pure Python + numpy; the executor behind ``Executor`` does the model work.

Synchronous mode runs each step to completion: schedule, execute, apply.
Asynchronous mode (``SchedulerConfig.async_scheduling``) keeps one step in
flight, so the host's scheduling overlaps the device's work::

    step() call k:   schedule N+1 | submit N+1 | wait for N | apply N
    device:          ... runs N ........|... runs N+1 ......

Step N+1 is planned as if every sequence sampling in N already had its token
(a *pending* token, fed by reference). Applying N then appends the real
tokens; a request that ended in N (eos, stop id, abort) has its step-N+1 token
dropped and keeps its blocks until N+1 completes (``_InFlight.retired``), so
no block goes to another sequence while a step that writes it may still run.

A request with ``n > 1`` completions starts as one sequence (index 0). Once a
completed step has computed its prompt and registered the prompt's blocks in
the prefix cache, the other n - 1 sequences are created at the front of the
waiting queue: their prompts hit those blocks, so the prompt is computed once.
Every sequence has a ``name`` (``sequence_name``) in the engine's records.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Protocol
from typing import Sequence as Seq

import numpy as np

from minivllm.config import CacheConfig, SchedulerConfig, cdiv
from minivllm.engine.block_manager import InvariantError
from minivllm.engine.grammar import ALL_ALLOWED, GrammarBackend, GrammarMatcher, bitmask_width
from minivllm.engine.observer import EngineObserver
from minivllm.engine.plan import StepPlan, StepResult
from minivllm.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.engine.state_cache import STATE_CONTINUE, StateCache
from minivllm.engine.token_rules import ban, banned_tokens, masks_position
from minivllm.executor.base import Executor, StepHandle
from minivllm.outputs import FinishReason, RequestOutput, StopReason
from minivllm.sampling import RequestOutputKind, SamplingParams, eos_token_set, tokenize_bad_words
from minivllm.spec.base import DRAFT_ON_DEVICE, Proposer
from minivllm.step_types import TokenHistory

__all__ = ["LLMEngine", "EngineStats", "StepRecord", "InvariantError"]

# Most steps an engine waits before asking its proposer again after rounds that found no
# draft or kept none (``LLMEngine._spec_outcome``): those steps keep one step in flight
# (docs/tuning.md, "Speculative decoding": 32 keeps drafts that are always wrong within
# 1.10x of no drafts at batch 1, and copy-heavy chats gain as much as with 16).
MAX_SPEC_BACKOFF = 32

# Finished request ids remembered (to tell "already finished" from "unknown"
# on abort, and to refuse a reused id); older ones are forgotten.
MAX_FINISHED_IDS = 100_000
MAX_INTERNED_PARAMS = 4096  # distinct SamplingParams kept for sharing; then the table restarts
FINAL_ONLY = RequestOutputKind.FINAL_ONLY
# ``_finish_reason``'s answers without a stop reason, built once (it runs for every sampled token).
_RUNNING: tuple[FinishReason | None, StopReason] = (None, None)
_STOPPED_BY_EOS: tuple[FinishReason | None, StopReason] = ("stop", None)
_LENGTH: tuple[FinishReason | None, StopReason] = ("length", None)


class TextStream(Protocol):
    """A request's completion text, grown token by token (``minivllm.detokenizer``)."""

    def add(self, token_ids: Seq[int]) -> str:
        """Append tokens; return the text they complete (may be empty)."""
        ...


class TextStreamFactory(Protocol):
    """The engine's window on the tokenizer (``minivllm.llm.DetokenizingTextStreams``)."""

    def __call__(self, prompt_token_ids: list[int], params: SamplingParams) -> TextStream:
        """The text stream of a request from its prompt token ids."""
        ...

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids, without special tokens (for ``SamplingParams.bad_words``)."""
        ...


@dataclass
class EngineStats:
    """Running counters over the engine's life (the sums of the ``StepRecord`` counters)."""

    num_steps: int = 0
    num_prefill_tokens: int = 0   # tokens of chunks that are not decodes
    num_decode_tokens: int = 0    # one per decode chunk (``is_decode_chunk``)
    num_cached_tokens: int = 0    # prompt tokens served by the prefix cache
    num_preemptions: int = 0
    num_chunked_prefills: int = 0  # scheduled sequences that got a partial chunk
    num_aborts: int = 0
    num_masked_steps: int = 0      # steps with grammar-masked rows
    grammar_mask_s: float = 0.0    # host seconds filling their token bitmasks
    # Speculative decoding (vLLM's names): rows scored with drafts, the drafts scored,
    # those accepted, and accepted drafts by position (index i: the (i+1)-th draft).
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StepRecord:
    """What the last ``step()`` decided (for traces, replay, invariants and plots)."""

    scheduled: dict[str, int]                 # sequence name -> tokens computed
    preempted: tuple[str, ...]
    finished: dict[str, tuple[int, ...]] = field(default_factory=dict)
    num_free_blocks: int = 0
    num_prefill_tokens: int = 0               # this step's share of EngineStats
    num_decode_tokens: int = 0
    # The part of num_prefill_tokens in chunks that stop short of their sequence's end
    # (chunked prefill: the step samples nothing for them).
    num_chunked_tokens: int = 0
    num_cached_tokens: int = 0                # prefix-cache hits of the sequences this step admitted
    num_running: int = 0                      # the queues after the step
    num_waiting: int = 0
    finish_reasons: dict[str, FinishReason] = field(default_factory=dict)  # of the names in ``finished``


@dataclass
class _InFlight:
    """A submitted step whose result has not been applied yet."""

    out: SchedulerOutput
    handle: StepHandle
    seq_ids: frozenset[int]
    # Sequences that finished (or were aborted) while this step may still write
    # their blocks: freed when it completes.
    retired: list[Sequence] = field(default_factory=list)
    # Whether some row has drafts: the next step is planned only once this one is applied.
    drafted: bool = False
    # Per sampling row, the sequence whose grammar or token rules mask it (None: unmasked)
    # and its drafts (it is scored at 1 + d positions, each with its bitmask row); None
    # when no row is masked, or once the bitmask was given.
    masked: list[tuple[Sequence | None, int]] | None = None


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Args:
        scheduler_config: batching limits, policy and synchronous/asynchronous steps.
        cache_config: block size, pool size (None: ask the executor), prefix caching.
        executor: computes the planned tokens (fake numpy model or real model).
        eos_token_id: ends a request (unless its params say ``ignore_eos``); a list of
            ids (Llama-3.x lists several) ends it at any of them.
        text_streams: makes a request's text stream from its prompt; requests
            with ``stop`` strings need it (the engine watches their text).
        vocab_size: the model's vocabulary, where known; the engine only hands it on
            (a trace records it).
        observer: told of every accepted change (``EngineObserver``), e.g. a trace
            recorder; ``close()`` closes it.
        grammar_backend: compiles the grammars of requests with ``structured_outputs``
            (``engine/grammar.py``); without one such requests are refused.
        proposer: speculative decoding's draft tokens (``spec/base.py``); with one, every
            step is planned with all tokens known (the step in flight is applied first),
            since drafts follow the latest token.

    Raises:
        ValueError: the configured pool is larger than the executor holds, or the
            observer refuses the engine.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 executor: Executor, eos_token_id: int | Seq[int] | None = None,
                 text_streams: TextStreamFactory | None = None, vocab_size: int | None = None,
                 observer: EngineObserver | None = None, grammar_backend: GrammarBackend | None = None,
                 proposer: Proposer | None = None) -> None:
        available = executor.num_kv_blocks()
        num_blocks = cache_config.num_blocks if cache_config.num_blocks is not None else available
        if num_blocks > available:
            raise ValueError(f"num_blocks={num_blocks} but the executor holds only {available} blocks")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.executor = executor
        self.eos_token_id = eos_token_id  # as given (traces record it)
        self._eos = eos_token_set(eos_token_id)
        self.text_streams = text_streams
        self.num_blocks = num_blocks
        num_slots, num_snapshots = executor.state_pool()
        state = (StateCache(num_slots, num_snapshots, cache_config.state_snapshot_interval)
                 if num_slots else None)
        self.scheduler = Scheduler(scheduler_config, cache_config, num_blocks, state)
        self.requests: dict[str, Sequence] = {}   # unfinished sequences by name
        self._members: dict[str, list[str]] = {}  # unfinished request id -> its sequences' names
        self._unspawned: dict[str, Sequence] = {}  # n > 1, the others not created yet: id -> first
        self._finished_ids: dict[str, None] = {}  # insertion-ordered, at most MAX_FINISHED_IDS
        self._pending_outputs: list[RequestOutput] = []  # aborts, returned by the next step()
        self._next_seq_id = 0
        self._params: dict[SamplingParams, SamplingParams] = {}  # interned (see _new_sequence)
        self._inflight: _InFlight | None = None
        self._drain_first = False   # the last schedule was blocked: complete the in-flight step first
        self.stats = EngineStats()
        self.last_step: StepRecord | None = None
        self._last_out: SchedulerOutput | None = None
        self.vocab_size = vocab_size
        self.grammar_backend = grammar_backend
        # Proposal rounds that found nothing, or kept nothing, back off (1, 2, 4 .. max_spec_backoff
        # steps without asking), so that those steps keep one step in flight: ``_spec_outcome``.
        # A benchmark that wants every step drafted sets it to 0.
        self.max_spec_backoff = MAX_SPEC_BACKOFF
        self.proposer = proposer
        self.observer = observer
        if observer is not None:
            observer.attach(self)

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.block_manager.num_free_blocks

    @property
    def proposer(self) -> Proposer | None:
        """Who drafts tokens (speculative decoding), or None."""
        return self._proposer

    @proposer.setter
    def proposer(self, proposer: Proposer | None) -> None:
        """A new proposer (or none) starts without backing off: the last one's misses say
        nothing about it."""
        self._proposer = proposer
        self._spec_backoff = self._spec_wait = 0

    @property
    def async_scheduling(self) -> bool:
        return self.scheduler_config.async_scheduling

    # ---- requests -----------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Seq[int],
                    sampling_params: SamplingParams | None = None) -> None:
        """Queue a request; raises ``ValueError``/``TypeError`` (nothing queued) if it can never run."""
        params = SamplingParams() if sampling_params is None else sampling_params
        self.validate_request(request_id, prompt_token_ids, params)
        if params.bad_words and not params.bad_words_token_ids:
            assert self.text_streams is not None  # validate_request checked
            params = dataclasses.replace(params, bad_words_token_ids=tokenize_bad_words(
                params.bad_words, self.text_streams.encode))
        seq = self._new_sequence(request_id, [int(t) for t in prompt_token_ids], params, 0)
        self._members[request_id] = [seq.name]
        if params.n > 1:
            self._unspawned[request_id] = seq
        self.scheduler.add(seq)
        if self.observer is not None:
            self.observer.on_add_request(self, request_id, seq.prompt_token_ids, params)

    def _new_sequence(self, request_id: str, prompt: Seq[int], params: SamplingParams, index: int) -> Sequence:
        # Equal params share one object (they are frozen): a plan pickled for tensor-parallel
        # workers then carries each distinct one once (batch 256 of equal params: 34 KB, not 74).
        params = self._params.setdefault(params, params)
        if len(self._params) > MAX_INTERNED_PARAMS:
            self._params.clear()
        seq = Sequence(self._next_seq_id, request_id, prompt, params, index)
        if params.structured_outputs is not None:
            assert self.grammar_backend is not None  # validate_request checked
            seq.grammar = self.grammar_backend.matcher(params.structured_outputs)
        if params.stop and self.text_streams is not None:
            seq.text_stream = self.text_streams(list(prompt), params)
        self._next_seq_id += 1
        self.requests[seq.name] = seq
        return seq

    def _spawn(self, first: Sequence) -> None:
        """Create completions 1 .. n-1 of ``first``'s request (its prompt is computed and
        cached now), ahead of every waiting sequence; sample i is seeded ``seed + i``."""
        del self._unspawned[first.request_id]
        prompt, params = first.prompt_token_ids, first.sampling_params
        children = []
        for i in range(1, params.n):
            p = params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            child = self._new_sequence(first.request_id, prompt, p, i)
            child.prompt_logprobs = first.prompt_logprobs
            self._members[first.request_id].append(child.name)
            children.append(child)
        self.scheduler.add_front(children)

    def validate_request(self, request_id: str, prompt: Seq[int], params: SamplingParams) -> None:
        """Raise ``ValueError``/``TypeError`` if ``add_request`` would refuse this request.

        The one admission check: front ends call it for every prompt of a batch
        before queuing any.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self._members or request_id in self._finished_ids:
            raise ValueError(f"request {request_id!r}: duplicate request id")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"request {request_id!r}: sampling_params must be SamplingParams")
        if params.stop and self.text_streams is None:
            raise ValueError(f"request {request_id!r}: stop strings need a tokenizer, and this engine "
                             "has none (text_streams)")
        if params.bad_words and not params.bad_words_token_ids and self.text_streams is None:
            raise ValueError(f"request {request_id!r}: bad_words need a tokenizer, and this engine has "
                             "none (text_streams); give bad_words_token_ids instead")
        if params.has_token_rules and self._mask_vocab_size is None:
            raise ValueError(f"request {request_id!r}: min_tokens and bad_words need an engine that knows "
                             "its vocabulary size")
        if params.structured_outputs is not None:
            self._validate_grammar(request_id, params)
        for name, last in (("logit_bias", params.logit_bias[-1][0] if params.logit_bias else None),
                            ("allowed_token_ids", params.allowed_token_ids[-1] if params.allowed_token_ids else None),
                            ("bad_words_token_ids", max(map(max, params.bad_words_token_ids), default=None))):
            if last is not None and self.vocab_size is not None and last >= self.vocab_size:
                raise ValueError(f"request {request_id!r}: {name} names token {last}, "
                                 f"outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) == 0:
            raise ValueError(f"request {request_id!r}: prompt is empty")
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.min() < 0:
            raise ValueError(f"request {request_id!r}: prompt token ids must be a flat list of ints >= 0")
        max_len = self.scheduler_config.max_model_len
        if len(prompt) + params.max_tokens > max_len:
            raise ValueError(f"request {request_id!r}: prompt ({len(prompt)} tokens) + max_tokens "
                             f"({params.max_tokens}) exceeds max_model_len ({max_len})")
        # The last sampled token is never fed back, so at most this many are computed.
        need = cdiv(len(prompt) + params.max_tokens - 1, self.cache_config.block_size)
        if need > self.num_blocks:
            raise ValueError(f"request {request_id!r}: needs up to {need} KV blocks but the "
                             f"whole pool has {self.num_blocks}")

    def _validate_grammar(self, request_id: str, params: SamplingParams) -> None:
        if self.grammar_backend is None:
            raise ValueError(f"request {request_id!r}: structured_outputs need an engine with a grammar "
                             "backend, and this one has none")
        if not self._eos:
            raise ValueError(f"request {request_id!r}: structured_outputs need an eos token to end the "
                             "grammar, and this engine has none")
        assert params.structured_outputs is not None
        try:
            self.grammar_backend.matcher(params.structured_outputs)  # compiled once, then cached
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None

    def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request; its output (``abort``) comes with the next ``step()``.

        Returns:
            True if aborted, False if the request had already finished.
        Raises:
            ValueError: no request with this id was ever added.
        """
        names = self._members.get(request_id)
        if names is None:
            if request_id in self._finished_ids:
                return False
            raise ValueError(f"abort_request: unknown request id {request_id!r}")
        first = self._unspawned.pop(request_id, None)
        for name in list(names):
            seq = self.requests.pop(name)
            seq.finish_reason = "abort"
            self._retire(seq)
            self._pending_outputs.append(self._output(seq))
        if first is not None:  # completions never created end too, empty
            self._pending_outputs.extend(
                RequestOutput(request_id, first.prompt_token_ids, (), "abort", index=i,
                              logprobs=() if first.logprobs is not None else None)
                for i in range(1, first.sampling_params.n))
        self.stats.num_aborts += 1
        if self.observer is not None:
            self.observer.on_abort_request(self, request_id)
        return True

    def set_async_scheduling(self, on: bool) -> None:
        """Switch between one step in flight and synchronous steps (only while idle).

        Raises:
            RuntimeError: requests are unfinished or a step is in flight, or the
                observer refuses the switch.
        """
        if self.observer is not None:
            self.observer.on_set_async_scheduling(self, on)
        if self.has_unfinished_requests():
            raise RuntimeError("set_async_scheduling: the engine is not idle")
        self.scheduler_config = dataclasses.replace(self.scheduler_config, async_scheduling=on)
        self.scheduler.config = self.scheduler_config

    def close(self) -> None:
        """Close the observer, if any (idempotent). The executor was passed in: its owner
        closes it."""
        if self.observer is not None:
            self.observer.close()

    def has_unfinished_requests(self) -> bool:
        """Whether ``step()`` has more to do: requests, undelivered outputs or a step in flight."""
        return bool(self.requests) or bool(self._pending_outputs) or self._inflight is not None

    def _retire(self, seq: Sequence) -> None:
        """Take a finished or aborted ``seq`` out of the engine; free its blocks when no step in
        flight writes them, else when that step completes."""
        inflight = self._inflight
        if inflight is not None and seq.seq_id in inflight.seq_ids:
            self.scheduler.finish(seq, free_blocks=False)
            inflight.retired.append(seq)
        else:
            self.scheduler.finish(seq)
        seq.grammar = None  # a row of it still in flight samples unmasked; its token is dropped
        rid = seq.request_id
        names = self._members.get(rid, [])
        if seq.name in names:
            names.remove(seq.name)
        if names or rid in self._unspawned:
            return
        self._members.pop(rid, None)
        self._finished_ids[rid] = None
        if len(self._finished_ids) > MAX_FINISHED_IDS:
            del self._finished_ids[next(iter(self._finished_ids))]

    # ---- the step -----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and submit one step and apply the previous one.

        Returns one ``RequestOutput`` per request that produced tokens in the step
        applied (its new tokens; not for ``output_kind`` FINAL_ONLY), and a final one
        for each request that ended since the last call (finish reason set; aborts
        included).

        Synchronously, the step submitted is also the one applied. With one
        step in flight, the step submitted now is applied by the next call.

        Raises:
            RuntimeError: nothing could be scheduled or preempted although requests
                are unfinished (a bug: admission checks should make this impossible),
                or the executor's result does not match the plan.
        """
        busy = self.has_unfinished_requests()
        outputs, self._pending_outputs = self._pending_outputs, []
        inflight = self._inflight
        # Drafts follow the latest token, and a drafted step's rollback is known only once it
        # is applied: either way, the step in flight is applied first.
        if inflight is not None and (self._drain_first or inflight.drafted
                                     or self.proposer is not None and self._spec_wait == 0):
            outputs.extend(self._complete(self._take_inflight()))
        proposed = self._propose_drafts() if self.proposer is not None else []
        out = self.scheduler.schedule(can_preempt=self._inflight is None)
        if proposed:
            taken = {c.seq.seq_id for c in out.scheduled if c.num_drafts}
            for seq in proposed:
                if seq.seq_id not in taken:
                    seq.drafts = []  # not scheduled with them: drafts live only until their step
        self._drain_first = out.blocked
        self._last_out = out
        if not out.scheduled and self._inflight is None:
            self._check_progress(out)
        previous = self._take_inflight()
        if out.scheduled:
            plan = self._build_plan(out)
            self._inflight = _InFlight(out, self.executor.submit(plan), frozenset(plan.seq_ids),
                                       drafted=bool(len(plan.num_drafts)))
            if plan.num_masked_rows:
                self._inflight.masked = [(c.seq if m else None, c.num_drafts)
                                         for c, m in zip(out.scheduled, plan.masked) if c.samples]
        if previous is not None:
            outputs.extend(self._complete(previous))
        if self._inflight is not None and self._inflight.masked is not None:
            self._send_bitmask(self._inflight)  # every token before it is applied now
        if not self.async_scheduling and self._inflight is not None:
            outputs.extend(self._complete(self._take_inflight()))
        self._record(out, outputs)
        if busy and self.observer is not None:
            assert self.last_step is not None
            self.observer.on_step(self, self.last_step)
        return outputs

    def _propose_drafts(self) -> list[Sequence]:
        """Ask the proposer, unless backing off (then count the wait down); a round that asked
        about some sequences and found no draft is a miss (``_spec_outcome``). Returns the
        sequences asked about."""
        if self._spec_wait > 0:
            self._spec_wait -= 1
            return []
        assert self._inflight is None, "drafts follow the latest token: the step in flight is applied first"
        asked = self._propose()
        if asked and not any(seq.drafts for seq in asked):
            self._spec_outcome(False)
        return asked

    def _spec_outcome(self, useful: bool) -> None:
        """After a miss (no draft found, or a drafted step that kept none), wait twice as long
        as last time (1, 2, 4 .. ``max_spec_backoff`` steps) before asking again; after a step that
        kept a draft, ask at once."""
        if useful:
            self._spec_backoff = self._spec_wait = 0
        else:
            self._spec_backoff = min(max(1, 2 * self._spec_backoff), self.max_spec_backoff)
            self._spec_wait = self._spec_backoff

    def _propose(self) -> list[Sequence]:
        """Ask the proposer for drafts for every running sequence about to decode (all its
        tokens known); each gets at most k, and fewer than the tokens it may still produce
        (the step adds one of its own). Returns the sequences asked for."""
        assert self.proposer is not None
        asked, room = [], []
        k, max_len = self.proposer.num_speculative_tokens, self.scheduler_config.max_model_len
        for seq in self.scheduler.running:
            if not seq.is_decoding or not self._can_draft(seq):
                continue
            left = min(seq.sampling_params.max_tokens - seq.num_output_tokens, max_len - seq.num_tokens)
            if left >= 2:
                asked.append(seq)
                room.append(min(k, left - 1))
        if asked and self.proposer.on_device:  # the executor makes them in the step: only how many
            for seq, r in zip(asked, room):
                seq.drafts = [DRAFT_ON_DEVICE] * r
        elif asked:
            drafts = self.proposer.propose([seq.token_ids for seq in asked], room, [seq.name for seq in asked])
            for seq, d, r in zip(asked, drafts, room):
                seq.drafts = [int(t) for t in d[:r]]
                if seq.grammar is not None and seq.drafts:
                    seq.drafts = self._grammatical(seq.grammar, seq.drafts)
        return asked

    @staticmethod
    def _grammatical(matcher: GrammarMatcher, drafts: list[int]) -> list[int]:
        """The drafts up to the first the grammar refuses or that ends it (a grammar's eos comes
        as a step's own token: no mask follows it); the matcher ends where it began."""
        n = 0
        while n < len(drafts) and matcher.accept_token(drafts[n]):
            n += 1
            if matcher.is_terminated():
                matcher.rollback(1)
                n -= 1
                break
        matcher.rollback(n)
        return drafts[:n]

    def _can_draft(self, seq: Sequence) -> bool:
        """Rows scored without a token history per position, which the executor can verify
        (``Executor.verifies_drafts``); for drafts made on the device, rows without masks
        (a mask per position needs the drafts before the step)."""
        assert self.proposer is not None
        if self.proposer.on_device and (seq.grammar is not None or seq.has_token_rules):
            return False
        return not seq.has_penalties and self.executor.verifies_drafts(seq.sampling_params)

    @property
    def _mask_vocab_size(self) -> int | None:
        """The token ids a bitmask row covers: the grammar backend's, else the model's."""
        return self.grammar_backend.vocab_size if self.grammar_backend is not None else self.vocab_size

    def _send_bitmask(self, step: _InFlight) -> None:
        """Fill the step's masks (grammars from their matchers, then token rules:
        ``engine/token_rules.py``) and hand them over: one row per scored position, a drafted
        row's 1 + d in order, each as if the drafts before it were accepted."""
        assert step.masked is not None
        vocab_size = self._mask_vocab_size
        assert vocab_size is not None  # validate_request checked
        t0 = time.perf_counter()
        starts = np.cumsum([0] + [1 + d for _, d in step.masked])
        bitmask = np.full((int(starts[-1]), bitmask_width(vocab_size)), ALL_ALLOWED, dtype=np.int32)
        # A sequence retired since the plan samples unmasked; its token is dropped.
        live = [(int(starts[i]), seq, d) for i, (seq, d) in enumerate(step.masked)
                if seq is not None and seq.status is not SequenceStatus.FINISHED]
        grammars = [(row, seq.grammar) for row, seq, d in live if seq.grammar is not None and not d]
        if grammars:  # the common case, one position each: in one call
            assert self.grammar_backend is not None
            self.grammar_backend.fill_bitmasks([m for _, m in grammars], bitmask, [r for r, _ in grammars])
        for row, seq, d in live:
            if d and seq.grammar is not None:
                self._fill_drafted(seq.grammar, seq.drafts[:d], bitmask, row)
            if seq.has_token_rules:
                output = seq.output_token_ids  # the kept tuple: no copy on a row without drafts
                for j in range(d + 1):
                    ban(bitmask, row + j, banned_tokens(seq.sampling_params, output + tuple(seq.drafts[:j]), self._eos)
                        if j else banned_tokens(seq.sampling_params, output, self._eos), vocab_size)
        step.masked = None
        self.stats.num_masked_steps += 1
        self.stats.grammar_mask_s += time.perf_counter() - t0
        step.handle.set_token_bitmask(bitmask)

    @staticmethod
    def _fill_drafted(matcher: GrammarMatcher, drafts: list[int], bitmask: np.ndarray, row: int) -> None:
        """Rows ``row .. row + d`` of ``bitmask``: the matcher's masks after 0 .. d of ``drafts``
        (which it accepts: they were cut to what it accepts when proposed); it ends where it began."""
        for j, token in enumerate(drafts):
            matcher.fill_bitmask(bitmask, row + j)
            if not matcher.accept_token(token):
                raise RuntimeError(f"the grammar refuses draft {j} ({token}), which it accepted when proposed")
        matcher.fill_bitmask(bitmask, row + len(drafts))
        matcher.rollback(len(drafts))

    def _take_inflight(self) -> _InFlight | None:
        step, self._inflight = self._inflight, None
        return step

    def _check_progress(self, out: SchedulerOutput) -> None:
        if self.scheduler.has_unfinished() and not out.preempted:
            bm = self.scheduler.block_manager
            raise RuntimeError(
                f"scheduler made no progress: {len(self.scheduler.waiting)} waiting, "
                f"{len(self.scheduler.running)} running, {bm.num_free_blocks} of "
                f"{bm.num_blocks} blocks free")

    def _complete(self, step: _InFlight) -> list[RequestOutput]:
        """Wait for ``step``, free what it retired, apply its samples."""
        result = step.handle.result()
        for seq in step.retired:
            self.scheduler.block_manager.free(seq)
        return self._apply(step.out, result)

    def _build_plan(self, out: SchedulerOutput) -> StepPlan:
        # One pass over the batch (it runs every step for every sequence).
        seq_ids, chunks, starts, tables, sample, params, refs = [], [], [], [], [], [], []
        masked: list[bool] | None = None
        histories: list[TokenHistory | None] | None = None
        targets: list[np.ndarray | None] | None = None
        drafts: list[int] | None = None
        state = self.scheduler.block_manager.state
        slots: list[int] | None = [] if state is not None else None
        inits: list[int] | None = [] if state is not None else None
        saves: list[tuple[tuple[int, int], ...]] | None = [] if state is not None else None
        for i, c in enumerate(out.scheduled):
            seq, start, end = c.seq, c.start, c.end
            known = seq.token_ids
            if c.num_drafts:  # its last token, then the drafts (every token is known)
                end = start + 1
                drafts = drafts or [0] * len(out.scheduled)
                drafts[i] = c.num_drafts
            # A chunk past the known tokens ends with the pending token of the step in flight.
            ref = end > len(known)
            if ref:
                chunks.append(known[start:end] + [-1])
            else:
                chunks.append(known[start:end] + seq.drafts if c.num_drafts else known[start:end])
            refs.append(ref)
            seq_ids.append(seq.seq_id)
            starts.append(start)
            tables.append(tuple(seq.block_table))
            sample.append(c.samples)
            params.append(seq.sampling_params)
            # num_output_tokens counts this step's own sample (pending) too.
            if c.samples and (seq.grammar is not None or seq.has_token_rules and masks_position(
                    seq.sampling_params, seq.num_output_tokens - 1)):
                masked = masked or [False] * len(out.scheduled)
                masked[i] = True
            if c.samples and seq.has_penalties:
                histories = histories or [None] * len(out.scheduled)
                histories[i] = TokenHistory(np.array(known, dtype=np.int64), seq.num_prompt_tokens)
            if seq.computes_prompt_logprobs and start < seq.num_prompt_tokens - 1:
                # Position j predicts token j + 1: the targets are the prompt tokens after the chunk's positions.
                targets = targets or [None] * len(out.scheduled)
                targets[i] = np.array(known[start + 1:min(end + 1, seq.num_prompt_tokens)], dtype=np.int64)
            if state is not None:
                assert slots is not None and inits is not None and saves is not None and seq.state_slot is not None
                slots.append(seq.state_slot)
                inits.append(seq.state_init)
                seq.state_init = STATE_CONTINUE
                saves.append(self._snapshot_saves(state, seq, start, end))
        return StepPlan.build(
            seq_ids=seq_ids,
            token_chunks=chunks,
            start_positions=starts,
            block_tables=tables,
            sample=sample,
            sampling_params=params,
            block_size=self.cache_config.block_size,
            feeds_prev_sample=refs,
            histories=histories,
            prompt_logprob_targets=targets,
            masked=masked,
            num_drafts=drafts,
            drafts_on_device=self.proposer is not None and self.proposer.on_device,
            state_slots=slots,
            state_init=inits,
            state_saves=saves,
        )

    def _snapshot_saves(self, state: StateCache, seq: Sequence, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """The (offset, snapshot id) pairs of a hybrid row's chunk over positions [start, end):
        the block boundaries in it that the rule keeps (``StateCache.boundaries``), while
        snapshots are free; none without prefix caching. A drafted row's chunk ends after its
        last known token here (``end``): a boundary among its drafts may hold a rejected one."""
        if not self.cache_config.enable_prefix_caching:
            return ()
        bs = self.cache_config.block_size
        saves = []
        bm = self.scheduler.block_manager
        for blocks in state.boundaries(seq, start, end, bs):
            snap = bm.reserve_snapshot(seq, blocks)
            if snap is not None:
                saves.append((blocks * bs - start, snap))
        return tuple(saves)

    @staticmethod
    def _check_result(out: SchedulerOutput, result: StepResult) -> None:
        expected = {c.seq.seq_id for c in out.scheduled if c.samples}
        if set(result.sampled) != expected:
            raise RuntimeError(f"executor sampled for sequences {sorted(result.sampled)}, "
                               f"the plan asked for {sorted(expected)}")
        want = {c.seq.seq_id for c in out.scheduled if c.samples and c.seq.logprobs is not None}
        if not want <= result.logprobs.keys():
            raise RuntimeError(f"executor returned no logprobs for sequences {sorted(want - result.logprobs.keys())}")

    def _apply(self, out: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """Cache the step's full blocks, resolve pending tokens, finish requests; one output
        per request that got a token."""
        self._check_result(out, result)
        if result.num_accepted:
            self._spec_outcome(any(result.num_accepted.values()))
        bm = self.scheduler.block_manager
        outputs = []
        now = time.monotonic()
        for c in out.scheduled:
            seq = c.seq
            if seq.status is SequenceStatus.FINISHED:
                continue  # aborted while the step ran: its sample is dropped
            if not c.num_drafts:  # a row with drafts registers once it knows which it kept
                bm.register_computed_blocks(seq, c.end)
            if seq.seq_id in result.prompt_logprobs:
                self._add_prompt_logprobs(seq, c.start, result)
            if not c.samples:
                continue
            if self._unspawned and seq.index == 0 and seq.request_id in self._unspawned:
                self._spawn(seq)  # the prompt is computed and its blocks cached now
            token = result.sampled[seq.seq_id]
            seq.num_pending_tokens -= 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            if c.num_drafts:
                reason, stop_reason = self._apply_drafts(seq, c, token, result)
            else:
                if seq.grammar is not None:
                    self._advance_grammar(seq, token)
                seq.token_ids.append(token)
                if seq.logprobs is not None:
                    seq.logprobs.extend(result.logprobs[seq.seq_id].as_dicts([token]))
                reason, stop_reason = self._finish_reason(seq, token)
            if reason is not None:
                seq.finish_reason = reason
                del self.requests[seq.name]
                self._retire(seq)  # a pending token of the step in flight is dropped
            elif seq.sampling_params.output_kind is FINAL_ONLY:
                continue
            outputs.append(self._output(seq, stop_reason))
        return outputs

    def _apply_drafts(self, seq: Sequence, c: ScheduledChunk, token: int,
                      result: StepResult) -> tuple[FinishReason | None, StopReason]:
        """Append a drafted row's accepted drafts and its own token, one at a time, as if each
        came from its own step (a stop among them ends it there); then roll the computed
        length back past the rejected drafts, give back blocks only they used, and offer the
        blocks of accepted tokens to the prefix cache."""
        d, a = c.num_drafts, result.num_accepted.get(seq.seq_id, 0)
        if not 0 <= a <= d:
            raise RuntimeError(f"{seq}: the executor accepted {a} of {d} drafts")
        self._count_drafts(d, a)
        seq.num_draft_tokens += d
        seq.num_accepted_tokens += a
        drafts = result.drafts.get(seq.seq_id, []) if self.proposer.on_device else seq.drafts  # type: ignore[union-attr]
        if len(drafts) != d:
            raise RuntimeError(f"{seq}: the step scored {len(drafts)} drafts, the plan gave it {d}")
        run = drafts[:a] + [token]
        seq.drafts = []
        logprobs = result.logprobs[seq.seq_id].as_dicts(run) if seq.logprobs is not None else None
        reason: FinishReason | None = None
        stop_reason: StopReason = None
        for i, t in enumerate(run):
            if seq.grammar is not None:
                self._advance_grammar(seq, t)
            seq.token_ids.append(t)
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
            reason, stop_reason = self._finish_reason(seq, t)
            if reason is not None:
                break
        kept = c.end - (d - a)  # the fed tokens whose K/V stand: its last token and the accepted drafts
        bm = self.scheduler.block_manager
        bm.register_computed_blocks(seq, min(kept, len(seq.token_ids)))
        if reason is None:
            bm.roll_back(seq, kept)
        return reason, stop_reason

    def _count_drafts(self, d: int, a: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += d
        s.num_accepted_tokens += a
        if len(s.accepted_per_position) < d:
            s.accepted_per_position.extend([0] * (d - len(s.accepted_per_position)))
        for i in range(a):
            s.accepted_per_position[i] += 1

    @staticmethod
    def _advance_grammar(seq: Sequence, token: int) -> None:
        if not seq.grammar.accept_token(token):
            raise RuntimeError(f"{seq}: the executor sampled token {token}, which its grammar does not "
                               "allow (its bitmask was not applied, or applied to another row)")
        seq.num_grammar_tokens += 1

    @staticmethod
    def _add_prompt_logprobs(seq: Sequence, start: int, result: StepResult) -> None:
        """Position j's logprobs are those of prompt token j + 1."""
        lp = result.prompt_logprobs[seq.seq_id]
        first = start + 1
        targets = seq.token_ids[first:first + len(lp.token_logprobs)]
        if seq.prompt_logprobs is not None:
            seq.prompt_logprobs[first:first + len(targets)] = lp.as_dicts(targets)

    def _finish_reason(self, seq: Sequence, token: int) -> tuple[FinishReason | None, StopReason]:
        """The finish reason (None: still running) and the stop reason, judged on the known
        tokens only (a pending one is not there yet), in vLLM's order: eos, stop token (both
        kept out of the text), stop string, length."""
        p = seq.sampling_params
        if token in self._eos and not p.ignore_eos:
            return _STOPPED_BY_EOS
        if token in p.stop_token_ids:
            return "stop", token
        known = len(seq.token_ids)
        if seq.text_stream is not None and (stop := self._stop_string_found(
                seq, token, known - seq.num_prompt_tokens > p.min_tokens)) is not None:
            return "stop", stop
        if known - seq.num_prompt_tokens >= p.max_tokens or known >= self.scheduler_config.max_model_len:
            return _LENGTH
        return _RUNNING

    @staticmethod
    def _stop_string_found(seq: Sequence, token: int, search: bool) -> str | None:
        """Grow ``seq.text`` by ``token``; the stop string it now contains (and the cut set), if
        any, when ``search`` (not before ``min_tokens``).

        Only occurrences that end in the new text are new; the earliest one wins.
        """
        assert seq.text_stream is not None
        delta = seq.text_stream.add([token])
        seq.text += delta
        if not delta or not search:
            return None
        p, n = seq.sampling_params, len(seq.text)
        found = [(i, s) for s in p.stop
                 if (i := seq.text.find(s, max(0, n - len(delta) - len(s) + 1))) >= 0]
        if not found:
            return None
        i, s = min(found)
        seq.text_end = i + len(s) if p.include_stop_str_in_output else i
        return s

    @staticmethod
    def _output(seq: Sequence, stop_reason: StopReason = None) -> RequestOutput:
        """The request's progress; its new tokens are those not reported before. A request the
        engine watches the text of (stop strings) ends with that text, cut at its stop string."""
        tokens = seq.output_token_ids
        new = tokens[seq.num_reported_tokens:]
        seq.num_reported_tokens = len(tokens)
        text = None
        if seq.finish_reason is not None and seq.text_stream is not None:
            text = seq.text if seq.text_end is None else seq.text[:seq.text_end]
        return RequestOutput(seq.request_id, seq.prompt_token_ids, tokens,
                             seq.finish_reason, text=text, new_token_ids=new, index=seq.index,
                             logprobs=seq.output_logprobs,
                             prompt_logprobs=tuple(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None,
                             first_token_time=seq.first_token_time, stop_reason=stop_reason,
                             num_cached_tokens=seq.first_num_cached_tokens or 0,
                             num_draft_tokens=seq.num_draft_tokens, num_accepted_tokens=seq.num_accepted_tokens)

    def _record(self, out: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        decode = chunked = 0
        for c in out.scheduled:
            decode += c.num_tokens if c.is_decode else 0  # a decode's drafts count with it
            chunked += 0 if c.samples else c.num_tokens
        prefill = out.num_tokens - decode
        s = self.stats
        s.num_steps += 1
        s.num_preemptions += len(out.preempted)
        s.num_chunked_prefills += out.num_chunked
        s.num_cached_tokens += out.num_cached_tokens
        s.num_prefill_tokens += prefill
        s.num_decode_tokens += decode
        ended = [o for o in outputs if o.finished]
        self.last_step = StepRecord(
            scheduled={c.seq.name: c.num_tokens for c in out.scheduled},
            preempted=tuple(seq.name for seq in out.preempted),
            finished={o.name: o.token_ids for o in ended},
            num_free_blocks=self.num_free_blocks,
            num_prefill_tokens=prefill,
            num_decode_tokens=decode,
            num_chunked_tokens=chunked,
            num_cached_tokens=out.num_cached_tokens,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            finish_reasons={o.name: o.finish_reason for o in ended if o.finish_reason is not None},
        )

    # ---- invariants ---------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` if any invariant (``docs/design.md``, "The simulator") fails."""
        sched, cfg = self.scheduler, self.scheduler_config
        waiting, running = sched.waiting, sched.running
        queued = {s.name for s in waiting} | {s.name for s in running}
        if len(queued) != len(waiting) + len(running):
            raise InvariantError("a request is queued twice")
        if queued != self.requests.keys():
            raise InvariantError(f"queues {sorted(queued)} differ from unfinished {sorted(self.requests)}")
        for s in waiting:
            if (s.status is not SequenceStatus.WAITING or s.block_table or s.num_computed_tokens
                    or s.num_pending_tokens or s.state_slot is not None or s.pending_snapshots):
                raise InvariantError(f"{s}: a waiting (or preempted) sequence is not bare")
        for s in running:
            if s.status is not SequenceStatus.RUNNING or s.num_uncomputed_tokens + len(s.drafts) < 1:
                raise InvariantError(f"{s}: running but not RUNNING, or nothing left to compute")
        for s in [*waiting, *running]:
            if (s.grammar is None) != (s.sampling_params.structured_outputs is None) or (
                    s.grammar is not None and s.num_grammar_tokens != len(s.token_ids) - s.num_prompt_tokens):
                raise InvariantError(f"{s}: its grammar matcher has accepted {s.num_grammar_tokens} tokens, "
                                     f"not its {len(s.token_ids) - s.num_prompt_tokens} known completion tokens")
        if len(running) > cfg.max_num_seqs:
            raise InvariantError(f"{len(running)} running > max_num_seqs {cfg.max_num_seqs}")
        self._check_pending(running)
        retired = self._inflight.retired if self._inflight is not None else []
        sched.block_manager.check_invariants(running + retired)
        self._check_last_step()
        bm = sched.block_manager
        if not self.has_unfinished_requests() and (bm.num_free_blocks != bm.num_blocks or any(bm.ref_counts)):
            raise InvariantError("engine idle but blocks are still held")

    def _check_pending(self, running: list[Sequence]) -> None:
        """A running sequence's pending tokens are exactly its samples in the step in flight."""
        sampling = set()
        if self._inflight is not None:
            sampling = {c.seq.seq_id for c in self._inflight.out.scheduled if c.samples}
            if any(s.status is not SequenceStatus.FINISHED for s in self._inflight.retired):
                raise InvariantError("a retired sequence is not finished")
        for s in running:
            if s.num_pending_tokens != (s.seq_id in sampling):
                raise InvariantError(f"{s}: {s.num_pending_tokens} pending tokens, "
                                     f"{'one' if s.seq_id in sampling else 'no'} sample in flight")

    def _check_last_step(self) -> None:
        out, cfg = self._last_out, self.scheduler_config
        if out is None:
            return
        if out.num_tokens > cfg.max_num_batched_tokens:
            raise InvariantError(f"step scheduled {out.num_tokens} tokens > budget {cfg.max_num_batched_tokens}")
        if len(out.scheduled) > cfg.max_num_seqs:
            raise InvariantError("step scheduled more than max_num_seqs sequences")
        if any(c.num_tokens < 1 for c in out.scheduled):
            raise InvariantError("a scheduled sequence got 0 tokens")
        for c in out.scheduled:
            # A request's last token is sampled, never fed: nothing is scheduled past it.
            s = c.seq
            last = min(s.num_prompt_tokens + s.sampling_params.max_tokens, cfg.max_model_len) - 1
            if c.end > last:
                raise InvariantError(f"{s}: scheduled up to position {c.end - 1}, past its last fed "
                                     f"position {last - 1}")
        if any(s.status is SequenceStatus.WAITING and s.block_table for s in out.preempted):
            raise InvariantError("a preempted sequence still holds blocks")
