"""The fake model: a paged token store whose "next token" is a hash of what it reads.

``FakeExecutor`` keeps ``kv`` (int64 (num_blocks, block_size), -1 where nothing
was ever written). Each step it writes the fed token ids at the plan's slots and,
for every sequence that samples, reads the whole context back *through its block
table* and returns ``fake_next_token(context)``. A paging bug (wrong slot, stale
block, missing write, block freed too early) changes what is read back, so the
output differs from the unpaged oracle's. See ``docs/design.md``, "The simulator".

Steps are deferred as on one CUDA stream: ``submit`` queues a plan, and a step
is computed, in submission order, when its result (or a later step's) is
asked for. A plan may feed a sequence the token it sampled in the previous plan
by reference (``StepPlan.feeds_prev_sample``); it is resolved from this
executor's own record. Two asynchronous-scheduling bugs are caught here rather
than left to the outputs: a reference to a token the previous plan did not
sample, and a plan that hands a block to one sequence while a submitted,
unfinished step still writes that block for another.

Recorded mode (traces of live traffic, ``fake_model: recorded``): the next token
is the one the live model sampled (``recorded_next_token``). The engine's
decisions depend on the model only through the tokens it samples: they decide
when a request stops (eos, stop ids, stop strings, length) and which blocks hash
alike (prefix hits, also of recomputed sequences after preemption). Given the
live tokens, the simulator's engine therefore makes the live engine's decisions
step for step, whatever model, dtype or GPU produced them, without the model.
The context is still read back through the block table and must be the recorded
one, so paging bugs are caught as in the hash model.

Hybrid mode (``state_slots`` > 0, a model with recurrent state beside its K/V): the
executor also holds a state per slot and per snapshot, the running fold of the tokens
fed (``fold_tokens``), and the model's next token is the hash model's over the context
followed by that fold (``hybrid_view``). The plan says which slot each row's state is
in, how it starts (as it is, reset, or copied from a snapshot) and where to copy it out
(``StepPlan.state_*``); the fold is never recomputed from the context. A slot not
reset, a stale or swapped slot, a snapshot restored from the wrong block or saved at
the wrong token: each changes the fold, so the token, so the output the oracle (which
folds the plain token list) predicts.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np
import xxhash

from minivllm.engine.grammar import ALL_ALLOWED, allowed_tokens, bitmask_width
from minivllm.engine.plan import StepPlan, StepResult
from minivllm.engine.state_cache import STATE_CONTINUE, STATE_RESET
from minivllm.executor.inputs import BatchInputs, prepare_inputs
from minivllm.sampling import SamplingParams
from minivllm.spec.base import DRAFT_ON_DEVICE
from minivllm.step_types import TokenLogprobs


class Drafter(Protocol):
    """A fake draft model (``sim/fake_proposer.FakeProposer`` with ``on_device``)."""

    def guesses(self, context: Sequence[int], n: int, truth: Callable[[list[int]], int]) -> list[int]: ...


# What a slot holds once the draft token written there was rejected: its K/V is garbage,
# and a correct engine rewrites the slot before any step reads it.
REJECTED = -2

# The fake recurrent state: the zero state, and the fold's multiplier (FNV-1's prime) and mask.
FOLD_EMPTY = 0x2A
_FOLD_PRIME = 0x100000001B3
_FOLD_MASK = (1 << 63) - 1


def fold_tokens(fold: int, tokens: Sequence[int] | np.ndarray) -> int:
    """The fake model's recurrent state after ``tokens``, from state ``fold``."""
    for t in np.asarray(tokens, dtype=np.int64).tolist():
        fold = ((fold ^ (t + 1)) * _FOLD_PRIME) & _FOLD_MASK
    return fold


def hybrid_view(context: Sequence[int] | np.ndarray, fold: int) -> np.ndarray:
    """What the hybrid fake model hashes: ``context`` followed by its state ``fold``."""
    return np.append(np.asarray(context, dtype=np.int64), np.int64(fold))


def hybrid_context(context: Sequence[int] | np.ndarray) -> np.ndarray:
    """The oracle's view of ``context`` under the hybrid model: the fold of the plain list."""
    return hybrid_view(context, fold_tokens(FOLD_EMPTY, context))


def fake_next_token(context: Sequence[int] | np.ndarray, vocab_size: int) -> int:
    """The fake model's next token after ``context`` (positions 0..n-1)."""
    data = np.asarray(context, dtype=np.int64).tobytes()
    return xxhash.xxh64_intdigest(data) % vocab_size


def fake_masked_next_token(context: Sequence[int] | np.ndarray, allowed: np.ndarray, vocab_size: int) -> int:
    """The fake model's next token after ``context`` under a mask, as a real model's argmax
    under one: its unmasked token (``fake_next_token``) where ``allowed`` holds it, else of
    the ``allowed`` token ids (ascending) the one whose score
    ``splitmix64(xxh64(context) ^ token)`` is smallest (the smallest id on a tie). So a mask
    that allows everything changes nothing."""
    if not len(allowed):
        raise PagingError("a token bitmask row allows no token")
    digest = xxhash.xxh64_intdigest(np.asarray(context, dtype=np.int64).tobytes())
    free = digest % vocab_size  # fake_next_token(context, vocab_size)
    at = np.searchsorted(allowed, free)
    if at < len(allowed) and allowed[at] == free:
        return int(free)
    h = np.uint64(digest)
    z = np.asarray(allowed, dtype=np.uint64) ^ h
    z += np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return int(allowed[int(np.argmin(z))])


def fake_logprob(context: Sequence[int] | np.ndarray, token: int, vocab_size: int) -> float:
    """The fake model's log-probability of ``token`` after ``context``: 0 for its next
    token, then -1/8 per step further round the vocabulary."""
    return -((token - fake_next_token(context, vocab_size)) % vocab_size) / 8


def fake_top_logprobs(context: Sequence[int] | np.ndarray, k: int, vocab_size: int) -> list[tuple[int, float]]:
    """The fake model's ``k`` most likely tokens after ``context``, most likely first."""
    nxt = fake_next_token(context, vocab_size)
    return [((nxt + j) % vocab_size, -j / 8) for j in range(min(k, vocab_size))]


def _fake_token_logprobs(contexts: list[np.ndarray], tokens: list[int], k: int, vocab_size: int) -> TokenLogprobs:
    tops = [fake_top_logprobs(c, k, vocab_size) for c in contexts]
    return TokenLogprobs(
        token_logprobs=np.array([fake_logprob(c, t, vocab_size) for c, t in zip(contexts, tokens)], dtype=np.float32),
        top_ids=np.array([[i for i, _ in top] for top in tops], dtype=np.int64).reshape(len(tops), -1),
        top_logprobs=np.array([[lp for _, lp in top] for top in tops], dtype=np.float32).reshape(len(tops), -1))


class PagingError(RuntimeError):
    """A plan addressed KV slots the fake executor's pool does not have."""


def recorded_next_token(context: Sequence[int] | np.ndarray, recorded: Sequence[int] | None,
                        vocab_size: int) -> int:
    """The recorded fake model's next token after ``context``.

    Args:
        context: the tokens read back (positions 0..n-1).
        recorded: the sequence's prompt + completion in the live run; None when the
            trace has none (a recording that ended before the sequence did).

    Returns ``recorded[n]``; past the recorded tokens (a token the live run sampled
    for a request that had just ended, and dropped) or without a record, the hash
    model's token.

    Raises:
        PagingError: ``context`` is not the first n recorded tokens.
    """
    n = len(context)
    if recorded is None or n >= len(recorded):
        return fake_next_token(context, vocab_size)
    got, want = np.asarray(context, dtype=np.int64), np.asarray(recorded[:n], dtype=np.int64)
    if not np.array_equal(got, want):
        at = int(np.flatnonzero(got != want)[0])
        raise PagingError(f"context read back differs from the recorded one at position {at}: "
                          f"{got[at]} != {want[at]}")
    return int(recorded[n])


class FakeExecutor:
    """Numpy executor implementing the fake model over a paged KV pool.

    Args:
        vocab_size: tokens are drawn from ``[0, vocab_size)``.
        block_size: tokens per KV block; every plan must use the same.
        num_blocks: size of the pool (what ``num_kv_blocks`` reports).
        recorded: recorded mode (module docstring): each sequence's prompt + completion
            in the live run, by sequence name (``sequence_name``).
        name_of: recorded mode: the name of a scheduled sequence id (asked once per
            sequence, when a plan first schedules it).
        drafter: the draft model of plans whose drafts are made on the device
            (``StepPlan.drafts_on_device``): it guesses them within the step, from the
            context read back through the block table (``sim/fake_proposer.py``).
        state_slots, state_snapshots: hybrid mode (module docstring): the states held for
            running sequences and for prefix-cache snapshots (``state_pool``); 0 slots: none.
    """

    def __init__(self, vocab_size: int, block_size: int, num_blocks: int,
                 recorded: Mapping[str, Sequence[int]] | None = None,
                 name_of: Callable[[int], str] | None = None, drafter: Drafter | None = None,
                 state_slots: int = 0, state_snapshots: int = 0) -> None:
        if vocab_size < 1 or block_size < 1 or num_blocks < 1:
            raise ValueError(
                f"vocab_size, block_size and num_blocks must be >= 1, "
                f"got {vocab_size}, {block_size}, {num_blocks}"
            )
        if (recorded is None) != (name_of is None):
            raise ValueError("recorded and name_of come together")
        if state_slots < 0 or state_snapshots < 0 or (state_snapshots and not state_slots):
            raise ValueError(f"state_slots and state_snapshots must be >= 0, snapshots only with slots; "
                             f"got {state_slots}, {state_snapshots}")
        if state_slots and recorded is not None:
            raise ValueError("the recorded model has no recurrent state: a hybrid trace is hash-model only")
        self.recorded = recorded
        self.name_of = name_of
        self.drafter = drafter
        self._names: dict[int, str] = {}   # recorded mode: sequence id -> name
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        # int64 (num_blocks, block_size): token id stored in each slot, -1 = never written.
        self.kv = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.num_steps = 0
        # Submitted steps whose results were not taken yet, oldest first.
        self._queue: list[_FakeStep] = []
        self._last_sampled: dict[int, int] = {}   # the last computed step's samples by sequence
        self._last_submitted: StepPlan | None = None
        # Hybrid mode: the fold each slot and snapshot holds; garbage (never FOLD_EMPTY)
        # until a plan resets or fills it.
        self.slots = [1000 + i for i in range(state_slots)]
        self.snapshots = [7000 + i for i in range(state_snapshots)]
        # Per step being computed: row -> the fold after each of its fed tokens (index 0: before).
        self._folds: dict[int, list[int]] = {}

    def num_kv_blocks(self) -> int:
        """The pool size given at construction."""
        return self.num_blocks

    def state_pool(self) -> tuple[int, int]:
        """The states given at construction: (slots, snapshots)."""
        return len(self.slots), len(self.snapshots)

    def verifies_drafts(self, params: SamplingParams) -> bool:
        """Every row: the fake model is greedy (``_sample_rows``)."""
        return True

    def execute(self, plan: StepPlan) -> StepResult:
        """``submit(plan).result()``."""
        return self.submit(plan).result()

    def submit(self, plan: StepPlan) -> "_FakeStep":
        """Check and queue ``plan``; it is computed when a result at or after it is asked for."""
        if plan.block_size != self.block_size:
            raise PagingError(f"plan block_size {plan.block_size} != executor block_size {self.block_size}")
        if self._queue and self._queue[-1].plan.num_masked_rows and self._queue[-1].bitmask is None:
            raise PagingError("a plan submitted before the previous step's token bitmask was given "
                              "(the previous step's samples, which this plan may feed, depend on it)")
        if plan.drafts_on_device and self.drafter is None:
            raise PagingError("a plan asks for drafts made on the device, but this executor has no draft model")
        if not plan.drafts_on_device and (plan.token_ids == DRAFT_ON_DEVICE).any():
            raise PagingError("a plan holds draft placeholders, but does not ask for drafts made on the device")
        if plan.num_seqs and bool(self.slots) != bool(len(plan.state_slots)):
            raise PagingError("a plan without state slots for a hybrid model" if self.slots
                              else "a plan with state slots for a model without recurrent state")
        inputs = prepare_inputs(plan)
        self._check_references(plan)
        for earlier in self._queue:
            _check_no_handover(earlier, plan, inputs)
        if self.name_of is not None:  # while the engine still holds every scheduled sequence
            for sid in plan.seq_ids:
                if sid not in self._names:
                    self._names[sid] = self.name_of(sid)
        step = _FakeStep(self, plan, inputs)
        self._queue.append(step)
        self._last_submitted = plan
        return step

    def _check_references(self, plan: StepPlan) -> None:
        """Every token fed by reference was sampled by the previous plan."""
        if not plan.feeds_prev_sample.any():
            return
        prev = self._last_submitted
        sampled = {sid for sid, s in zip(prev.seq_ids, prev.sample) if s} if prev is not None else set()
        bad = [sid for sid, r in zip(plan.seq_ids, plan.feeds_prev_sample) if r and sid not in sampled]
        if bad:
            raise PagingError(f"plan feeds sequence(s) {bad[:8]} the previous step's sample, "
                              "but the previous plan did not sample for them")

    def _run_until(self, step: "_FakeStep") -> None:
        """Compute every queued step up to and including ``step``, in submission order."""
        for queued in self._queue:
            if queued.value is None:
                if queued.plan.num_masked_rows and queued.bitmask is None:
                    raise PagingError("a step with masked rows runs before its token bitmask was given")
                queued.value = self._compute(queued.plan, queued.inputs, queued.bitmask)
            if queued is step:
                return
        raise PagingError("result() of a step whose result was already taken")

    def _compute(self, plan: StepPlan, inputs: BatchInputs, bitmask: np.ndarray | None) -> StepResult:
        """Write the fed tokens (references resolved), read back sampling contexts, hash them
        (a masked row: ``fake_masked_next_token`` over the tokens its bitmask row allows)."""
        ids = inputs.input_ids
        if plan.feeds_prev_sample.any():
            ids = ids.copy()
            refs = np.asarray(plan.seq_ids)[plan.feeds_prev_sample].tolist()
            ids[plan.prev_sample_slots] = [self._last_sampled[sid] for sid in refs]
        made: dict[int, list[int]] = {}
        if plan.drafts_on_device:
            ids = ids.copy()
            made = self._make_drafts(plan, inputs, ids)
        if (ids == DRAFT_ON_DEVICE).any():
            raise PagingError("a draft placeholder is left where no draft was made")
        self._write(inputs.slot_mapping, ids)
        if self.slots:
            self._fold_rows(plan, inputs, ids)
        rows = np.flatnonzero(plan.sample)
        contexts = self._read(inputs.block_tables[rows], inputs.kv_lens[rows])
        result = self._sample_rows(plan, inputs, rows, contexts, bitmask)
        if self.slots:
            self._keep_states(plan, result)
        return dataclasses.replace(result, drafts=made) if made else result

    def _fold_rows(self, plan: StepPlan, inputs: BatchInputs, ids: np.ndarray) -> None:
        """Hybrid mode: start each row's slot as the plan says, fold its fed tokens from it (the
        folds after each kept for the row's contexts), and save the snapshots it asks for."""
        if len(set(plan.state_slots.tolist())) != plan.num_seqs:
            raise PagingError(f"two rows of one step share a state slot: {plan.state_slots.tolist()}")
        saves = plan.state_saves or ((),) * plan.num_seqs
        self._folds = {}
        for r in range(plan.num_seqs):
            slot, init = int(plan.state_slots[r]), int(plan.state_init[r])
            if not 0 <= slot < len(self.slots):
                raise PagingError(f"state slot {slot} outside the pool of {len(self.slots)}")
            if init == STATE_RESET:
                self.slots[slot] = FOLD_EMPTY
            elif 0 <= init < len(self.snapshots):
                self.slots[slot] = self.snapshots[init]
            elif init != STATE_CONTINUE:
                raise PagingError(f"state init {init} is neither continue, reset nor one of "
                                  f"{len(self.snapshots)} snapshots")
            folds = [self.slots[slot]]
            for t in ids[inputs.cu_seqlens_q[r]:inputs.cu_seqlens_q[r + 1]].tolist():
                folds.append(((folds[-1] ^ (t + 1)) * _FOLD_PRIME) & _FOLD_MASK)  # fold_tokens, one at a time
            self._folds[r] = folds
            known = len(folds) - 1 - (int(plan.num_drafts[r]) if len(plan.num_drafts) else 0)
            for offset, snap in saves[r]:
                if not 1 <= offset <= known or not 0 <= snap < len(self.snapshots):
                    raise PagingError(f"a snapshot saved into {snap} after {offset} of a row's {known} "
                                      f"known fed tokens (snapshots: {len(self.snapshots)})")
                self.snapshots[snap] = folds[offset]

    def _keep_states(self, plan: StepPlan, result: StepResult) -> None:
        """Each row's slot keeps the state after its kept tokens: all it fed, but a drafted
        row's rejected drafts."""
        for r, sid in enumerate(plan.seq_ids):
            rejected = (int(plan.num_drafts[r]) if len(plan.num_drafts) else 0) - result.num_accepted.get(sid, 0)
            self.slots[int(plan.state_slots[r])] = self._folds[r][len(self._folds[r]) - 1 - rejected]

    def _view(self, plan: StepPlan, row: int, context: np.ndarray) -> np.ndarray:
        """What the model hashes for a row's context: itself, or in hybrid mode followed by the
        fold after it, from the row's state (never from the context)."""
        if not self.slots:
            return context
        return hybrid_view(context, self._folds[row][len(context) - int(plan.start_positions[row])])

    def _make_drafts(self, plan: StepPlan, inputs: BatchInputs, ids: np.ndarray) -> dict[int, list[int]]:
        """The drafter's guesses for each drafted row, written over its placeholders in ``ids``:
        the context is what the row's block table holds before its chunk, then the chunk's
        first token (its last known one)."""
        assert self.drafter is not None
        made = {}
        for r in np.flatnonzero(plan.num_drafts).tolist():
            sid, d, first = plan.seq_ids[r], int(plan.num_drafts[r]), int(inputs.cu_seqlens_q[r])
            start = int(inputs.kv_lens[r]) - 1 - d
            (before,) = self._read(inputs.block_tables[r:r + 1], np.array([start]))
            context = before.tolist() + [int(ids[first])]
            made[sid] = self.drafter.guesses(context, d, lambda ctx, sid=sid: self._draft_truth(sid, ctx))
            ids[first + 1:first + 1 + d] = made[sid]
        return made

    def _sample_rows(self, plan: StepPlan, inputs: BatchInputs, rows: np.ndarray, contexts: list[np.ndarray],
                     bitmask: np.ndarray | None) -> StepResult:
        """Each sampling row with d drafts (0 without) is scored at its last d + 1 positions;
        its drafts are accepted while each equals the fake model's token there, then it
        samples the model's token after the accepted ones. The slots of rejected drafts are
        marked ``REJECTED``, so a later read of one before it is rewritten fails. A masked
        row's position j samples under its bitmask row ``offset + j``
        (``fake_masked_next_token``)."""
        sampled, accepted, logprobs = {}, {}, {}
        num_drafts = (plan.num_drafts[rows].astype(np.int64) if len(plan.num_drafts)
                      else np.zeros(len(rows), dtype=np.int64))
        offsets = np.concatenate([[0], np.cumsum(1 + num_drafts)])
        for i, (r, ctx) in enumerate(zip(rows.tolist(), contexts)):
            sid, d = plan.seq_ids[r], int(num_drafts[i])
            masked = bitmask is not None and bool(len(plan.masked) and plan.masked[r])

            def pick(j: int, context: np.ndarray) -> int:
                if not masked:
                    return self._next_token(sid, self._view(plan, r, context))
                assert bitmask is not None  # masked implies it
                allowed = allowed_tokens(bitmask[offsets[i] + j], self.vocab_size)
                return fake_masked_next_token(self._view(plan, r, context), allowed, self.vocab_size)
            first = len(ctx) - d  # ctx[:first + j]: the context that predicts draft j
            ctxs = [ctx[:first + j] for j in range(d + 1)]
            a = 0
            while a < d and ctx[first + a] == pick(a, ctxs[a]):
                a += 1
            ctxs = ctxs[:a + 1]
            run = [int(t) for t in ctx[first:first + a]] + [pick(a, ctxs[a])]
            if d:
                accepted[sid] = a
                self._reject(inputs, r, first + a, len(ctx))
            sampled[sid] = run[-1]
            k = plan.sampling_params[r].logprobs
            if k is not None:
                logprobs[sid] = _fake_token_logprobs([self._view(plan, r, c) for c in ctxs], run, k, self.vocab_size)
        self._last_sampled = sampled
        self.num_steps += 1
        return StepResult(sampled=sampled, logprobs=logprobs, prompt_logprobs=self._prompt_logprobs(plan, inputs),
                          num_accepted=accepted)

    def _reject(self, inputs: BatchInputs, row: int, lo: int, hi: int) -> None:
        """Mark the slots of positions ``lo .. hi - 1`` of ``row`` as holding rejected drafts."""
        if lo >= hi:
            return
        pos = np.arange(lo, hi)
        table = inputs.block_tables[row]
        self.kv.reshape(-1)[table[pos // self.block_size] * self.block_size + pos % self.block_size] = REJECTED

    def _draft_truth(self, seq_id: int, context: list[int]) -> int:
        """What the drafter takes as the right token after ``context``: the recorded one while
        ``context`` is the recording's prefix, else the hash model's (a context a wrong draft
        led astray; so a recorded hash-model run replays its drafts)."""
        rec = self.recorded.get(self._names[seq_id]) if self.recorded is not None else None
        if rec is not None and len(context) < len(rec) and list(rec[:len(context)]) == context:
            return int(rec[len(context)])
        return fake_next_token(hybrid_context(context) if self.slots else context, self.vocab_size)

    def _next_token(self, seq_id: int, context: np.ndarray) -> int:
        if self.recorded is None:
            return fake_next_token(context, self.vocab_size)
        return recorded_next_token(context, self.recorded.get(self._names[seq_id]), self.vocab_size)

    def _prompt_logprobs(self, plan: StepPlan, inputs: BatchInputs) -> dict[int, TokenLogprobs]:
        """Position j of a chunk with targets: the fake logprobs of its target after tokens 0..j,
        read back through the block table (after this step's writes)."""
        out = {}
        for r, targets in enumerate(plan.prompt_logprob_targets):
            if targets is None:
                continue
            start = int(plan.start_positions[r])
            (full,) = self._read(inputs.block_tables[r:r + 1], inputs.kv_lens[r:r + 1])
            contexts = [self._view(plan, r, full[:start + i + 1]) for i in range(len(targets))]
            k = plan.sampling_params[r].prompt_logprobs
            out[plan.seq_ids[r]] = _fake_token_logprobs(contexts, targets.tolist(), k, self.vocab_size)
        return out

    def _write(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Store ``tokens`` (T,) at flat ``slots`` (T,); two different tokens in one slot is an error."""
        if not slots.size:
            return
        pool = self.num_blocks * self.block_size
        if slots.min() < 0 or slots.max() >= pool:
            bad = slots[(slots < 0) | (slots >= pool)]
            raise PagingError(
                f"plan writes slot(s) {bad.tolist()[:8]} outside the pool of "
                f"{self.num_blocks} blocks x {self.block_size} = {pool} slots"
            )
        flat = self.kv.reshape(-1)
        flat[slots] = tokens
        # With duplicate slots the last write wins; reading back exposes a clash.
        if not np.array_equal(flat[slots], tokens):
            clash = slots[flat[slots] != tokens]
            raise PagingError(f"one step writes different tokens to slot(s) {clash.tolist()[:8]}")

    def _read(self, tables: np.ndarray, kv_lens: np.ndarray) -> list[np.ndarray]:
        """Gather each row's first ``kv_len`` tokens through its padded block table.

        ``tables`` is int32 (S, W) padded with -1 and ``kv_lens`` (S,); returns S
        contiguous int64 arrays. Padding is never read: kv_len <= W * block_size
        and prepare_inputs checked that the table covers every fed position.
        """
        if tables.size:
            hi = int(tables.max())
            used = np.arange(tables.shape[1])[None, :] < -(-kv_lens[:, None] // self.block_size)
            if hi >= self.num_blocks or (tables[used] < 0).any():
                ids = tables[used]
                raise PagingError(
                    f"a block table holds block id(s) outside [0, {self.num_blocks}): "
                    f"{ids[(ids < 0) | (ids >= self.num_blocks)].tolist()[:8]}"
                )
        # (S, W * block_size): every sequence's slots in position order.
        flat = self.kv[np.where(tables >= 0, tables, 0)].reshape(len(tables), tables.shape[1] * self.block_size)
        read = [flat[i, :n] for i, n in enumerate(kv_lens.tolist())]
        if (flat == REJECTED).any() and any((ctx == REJECTED).any() for ctx in read):
            raise PagingError("a step reads a slot that holds a rejected draft, before any step rewrote it")
        return read


class _FakeStep:
    """Handle of a submitted fake step: ``result()`` computes it (and the steps before it)."""

    def __init__(self, executor: FakeExecutor, plan: StepPlan, inputs: BatchInputs) -> None:
        self.executor = executor
        self.plan = plan
        self.inputs = inputs
        self.value: StepResult | None = None
        self.bitmask: np.ndarray | None = None

    def set_token_bitmask(self, bitmask: np.ndarray) -> None:
        """Check and keep the token masks (``StepHandle.set_token_bitmask``): one row per
        scored position (a sampling row with d drafts has 1 + d), every bit set on unmasked
        rows, given once, before the step runs."""
        plan = self.plan
        if not plan.num_masked_rows:
            raise PagingError("a token bitmask for a step without masked rows")
        if self.bitmask is not None or self.value is not None:
            raise PagingError("a token bitmask given twice, or after the step ran")
        scored = 1 + (plan.num_drafts[plan.sample] if len(plan.num_drafts) else np.zeros(int(plan.sample.sum()), int))
        want = (int(scored.sum()), bitmask_width(self.executor.vocab_size))
        if bitmask.shape != want or bitmask.dtype != np.int32:
            raise PagingError(f"token bitmask of shape {bitmask.shape} {bitmask.dtype}, want {want} int32")
        unmasked = np.repeat(~plan.masked[plan.sample], scored)
        if (bitmask[unmasked] != ALL_ALLOWED).any():
            raise PagingError("an unmasked row (no grammar, no token rule) has a restricted token bitmask")
        self.bitmask = bitmask.copy()

    def result(self) -> StepResult:
        try:
            self.executor._run_until(self)
        finally:  # a step that failed is not retried by the next one
            if self in self.executor._queue:
                self.executor._queue.remove(self)
        assert self.value is not None
        return self.value


def _check_no_handover(running: _FakeStep, plan: StepPlan, inputs: BatchInputs) -> None:
    """Raise ``PagingError`` if ``plan`` gives a block to a sequence while the unfinished step
    ``running`` writes it for another sequence."""
    if not running.inputs.slot_mapping.size or not plan.num_seqs:
        return
    writer = running.inputs.slot_mapping // running.plan.block_size          # (T,) block written per token
    seq_of_token = np.repeat(np.asarray(running.plan.seq_ids), running.plan.query_lens)
    owner = dict(zip(writer.tolist(), seq_of_token.tolist()))                 # block -> writing sequence
    for sid, table in zip(plan.seq_ids, plan.block_tables):
        for block in table:
            w = owner.get(block)
            if w is not None and w != sid:
                raise PagingError(f"block {block} is handed to sequence {sid} while a step in flight "
                                  f"still writes it for sequence {w}")
