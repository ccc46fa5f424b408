"""Continuous batching: which sequences compute how many tokens this step.

``schedule()`` is a few named phases over two queues:

- ``waiting`` (FIFO; preempted sequences go back to its front) and
- ``running`` (in admission order; preemption takes from its tail).

Policies:

- ``prefill_first``: prefill work (running sequences mid-prefill, then waiting
  admissions) is scheduled first; if there was any, the step is prefill-only
  and decodes wait (the original design: time to first token first).
- ``mixed``: every running sequence first (decodes and prefill chunks), then
  waiting admissions fill the rest of the token budget, all in one batch.

When a running sequence needs a block and none is free, the *tail* of the
running queue (the most recently admitted sequence) is preempted by recompute:
its blocks are freed and it restarts later from its cache-hit prefix. If the
tail is the sequence itself, it preempts itself and stops the phase.

Scheduling a chunk advances the sequence at once (``num_computed_tokens``
grows, and a chunk that samples adds a pending token), so the next step can be
planned before this one has run (asynchronous scheduling). While a step is in
flight nothing is preempted (``can_preempt=False``): that step may still write
the victim's blocks, which must not go to another sequence. A shortage then
stops the phase (``blocked``) and the engine completes the in-flight step
before scheduling again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import Sequence, SequenceStatus, is_decode_chunk
from minivllm.engine.state_cache import StateCache


@dataclass(slots=True)
class ScheduledChunk:
    """One sequence's share of a step, fixed when it was scheduled: read-only.

    Not ``frozen``: one is built per sequence per step, and a frozen
    dataclass's ``__init__`` (an ``object.__setattr__`` call per field) costs
    about four times as much.
    """

    seq: Sequence
    start: int        # position of the first fed token (tokens computed before)
    num_tokens: int   # tokens fed this step (>= 1)
    samples: bool     # the chunk reaches the sequence's end: the step samples its next token
    is_decode: bool   # ``is_decode_chunk``: one sampled token fed back (and its drafts)
    num_drafts: int = 0  # draft tokens fed after it (``seq.drafts``, cut to fit)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    """The decisions of one ``schedule()`` call."""

    # One chunk per scheduled sequence, in batch order.
    scheduled: list[ScheduledChunk] = field(default_factory=list)
    # Sequences preempted (sent back to waiting) during this call.
    preempted: list[Sequence] = field(default_factory=list)
    # Whether this call may preempt (not while a submitted step may still write blocks).
    can_preempt: bool = True
    # A sequence needed blocks that only preemption could free, and preemption
    # was not allowed (a step is in flight).
    blocked: bool = False
    # Sequences that got fewer tokens than they have uncomputed (a prefill chunk).
    num_chunked: int = 0
    # Tokens still allowed this step (starts at max_num_batched_tokens).
    budget: int = 0
    # Prompt tokens served from the prefix cache for the sequences admitted.
    num_cached_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.scheduled)


class Scheduler:
    """Owns the queues and the block manager; decides each step's batch."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int, state: StateCache | None = None) -> None:
        self.config = scheduler_config
        self.block_manager = BlockManager(num_blocks, cache_config.block_size,
                                          cache_config.enable_prefix_caching, state)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_front(self, seqs: list[Sequence]) -> None:
        """Queue ``seqs`` (in order) ahead of every waiting sequence."""
        self.waiting.extendleft(reversed(seqs))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step -----------------------------------------------------------

    def schedule(self, can_preempt: bool = True) -> SchedulerOutput:
        """Pick this step's batch (see the module docstring for the policies).

        Args:
            can_preempt: False while a submitted step may still write blocks.
        """
        out = SchedulerOutput(budget=self.config.max_num_batched_tokens, can_preempt=can_preempt)
        if self.config.policy == "prefill_first":
            self._schedule_running(out, prefill_only=True)
            self._schedule_waiting(out)
            if not out.scheduled:
                self._schedule_running(out, prefill_only=False)
        else:
            self._schedule_running(out, prefill_only=False)
            self._schedule_waiting(out)
        return out

    def _num_new_tokens(self, remaining: int, budget: int) -> int:
        """Tokens to compute of ``remaining`` within ``budget`` (0 = does not fit)."""
        if remaining <= budget:
            return remaining
        return budget if self.config.chunked_prefill else 0

    def _schedule_running(self, out: SchedulerOutput, prefill_only: bool) -> None:
        """Running sequences in queue order; preempt from the tail when blocks run out."""
        bm = self.block_manager
        i = 0
        while i < len(self.running) and out.budget > 0:
            seq = self.running[i]
            i += 1
            if self._done_when_resolved(seq):
                continue
            start = seq.num_computed_tokens
            remaining = seq.num_uncomputed_tokens
            if is_decode_chunk(start, remaining, seq.num_prompt_tokens):
                if prefill_only:
                    continue
                if seq.drafts and self._take_drafts(out, seq):
                    continue
                if start < len(seq.block_table) * bm.block_size:
                    # The common case, kept short (it runs per sequence per step):
                    # one token into a last block that has a free slot; nothing to allocate.
                    self._take(out, seq, 1, 1)
                    continue
            n = self._num_new_tokens(remaining, out.budget)
            if n == 0:
                continue
            if not self._make_room(seq, n, out):
                break  # seq preempted itself (everything after it is gone too) or is blocked
            bm.append_slots(seq, n)
            self._take(out, seq, n, remaining)

    def _take_drafts(self, out: SchedulerOutput, seq: Sequence) -> bool:
        """Schedule a decode with as many of its drafts as the budget and the free blocks
        allow (never preempting for a draft); False (drafts dropped) when none fits."""
        bm = self.block_manager
        room = (len(seq.block_table) + bm.num_free_blocks) * bm.block_size - seq.num_computed_tokens
        d = min(len(seq.drafts), out.budget - 1, room - 1)
        del seq.drafts[max(d, 0):]
        if d <= 0:
            return False
        bm.append_slots(seq, 1 + d)
        start = seq.num_computed_tokens
        out.scheduled.append(ScheduledChunk(seq, start, 1 + d, True, True, d))
        out.budget -= 1 + d
        seq.num_computed_tokens += 1 + d
        seq.num_pending_tokens += 1
        return True

    def _done_when_resolved(self, seq: Sequence) -> bool:
        """Its pending token is its last allowed one: nothing is scheduled past a request's end."""
        if not seq.num_pending_tokens:
            return False
        return (seq.num_output_tokens >= seq.sampling_params.max_tokens
                or seq.num_tokens >= self.config.max_model_len)

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Preempt tail sequences until ``seq`` can grow by ``n`` tokens.

        Returns False if ``seq`` preempted itself, or if room was short and
        preemption is not allowed now (``out.blocked``).
        """
        bm = self.block_manager
        need = bm.blocks_needed(seq, n)  # fixed while others are preempted: only the pool grows
        if need > bm.num_free_blocks and not out.can_preempt:
            out.blocked = True
            return False
        while need > bm.num_free_blocks:
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput) -> None:
        """Admit waiting sequences in FIFO order while budget, seats and blocks allow.

        Nothing is admitted in a step that preempted: blocks were short, and the
        preempted sequence (now at the front of waiting) must not churn back in.
        """
        bm = self.block_manager
        if out.preempted or out.blocked:
            return
        while self.waiting and out.budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            assert not seq.num_pending_tokens, "a waiting sequence's tokens are all known"
            hit = bm.find_cached_prefix(seq)
            remaining = seq.num_tokens - len(hit) * bm.block_size
            n = self._num_new_tokens(remaining, out.budget)
            if n == 0 or bm.admission_cost(seq, hit, n) > bm.num_free_blocks or not bm.has_state_slot():
                break
            self.waiting.popleft()
            bm.allocate(seq, hit, n)
            out.num_cached_tokens += seq.num_cached_tokens
            if seq.first_num_cached_tokens is None:
                seq.first_num_cached_tokens = seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._take(out, seq, n, remaining)

    @staticmethod
    def _take(out: SchedulerOutput, seq: Sequence, n: int, remaining: int) -> None:
        """Record the chunk and advance ``seq`` past it (a sampling chunk adds a pending token)."""
        start = seq.num_computed_tokens
        samples = n == remaining
        out.scheduled.append(ScheduledChunk(seq, start, n, samples,
                                            is_decode_chunk(start, n, seq.num_prompt_tokens)))
        out.num_chunked += not samples
        out.budget -= n
        seq.num_computed_tokens += n
        seq.num_pending_tokens += samples

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.block_manager.free(seq)
        seq.drafts = []
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    # ---- after the step -----------------------------------------------------

    def finish(self, seq: Sequence, free_blocks: bool = True) -> None:
        """Remove a finished or aborted sequence from its queue; free its blocks unless a
        step in flight may still write them (then the caller frees them later)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if free_blocks:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
