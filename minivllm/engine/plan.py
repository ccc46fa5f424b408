"""The only data that crosses between scheduler and executor.

``StepPlan`` (scheduler -> executor) and ``StepResult`` (executor -> scheduler)
are frozen plain data: ints, tuples and read-only numpy arrays, never tensors.
The same plan drives the numpy fake executor and the torch model executor, so
the simulator exercises every index computation that runs on the GPU.

Layout of a plan with B scheduled sequences and T = sum(query_lens) tokens::

    seq_ids          (B,)  engine-wide sequence ids
    token_ids        (T,)  tokens fed this step, sequences concatenated in order
    query_lens       (B,)  tokens fed per sequence (>= 1)
    start_positions  (B,)  position of each sequence's first fed token
                           (= tokens already in its KV cache: prefix hit or
                           earlier chunks), so position i of row r is
                           start_positions[r] + i
    block_tables     B tuples, block ids covering start_positions + query_lens tokens
    sample           (B,)  True where the last fed token is the sequence's last
                           token, so the step produces its next token
    feeds_prev_sample (B,) True where the sequence's last fed token is the token
                           it sampled in the PREVIOUS plan (asynchronous
                           scheduling: the value is not known when this plan is
                           built); token_ids holds -1 there and the executor
                           fills it in from its own record, e.g. a device buffer
    histories        B entries (or () when no row needs one): for a sampling
                           sequence whose params have penalties, its known
                           tokens (``TokenHistory``); None elsewhere. A token
                           fed by reference is not in it: the executor adds
                           the resolved value (it is a completion token)
    masked           (B,)  True where the row samples under a grammar or a token rule
                           (``engine/token_rules.py``): its token bitmask
                           is filled once the tokens before it are known and comes to
                           the executor through ``StepHandle.set_token_bitmask``
                           (``engine/grammar.py``), before the step's result is asked for
    prompt_logprob_targets B entries (or ()): for a sequence asking for
                           prompt_logprobs whose chunk feeds prompt positions,
                           int64 (P,) with P <= query_len: the prompt token that
                           fed position i predicts (the next prompt token), for
                           the chunk's first P positions; None elsewhere
    num_drafts       (B,)  (or () when no row has any) d >= 0: the row's chunk is its
                           last token followed by d draft tokens (speculative
                           decoding); a sampling row with d > 0 is scored at its
                           last d + 1 positions, and the executor accepts a prefix
                           of the drafts (``StepResult.num_accepted``)
    drafts_on_device       the drafts are made by the executor within the step (a
                           draft model, ``spec/base.py``): in ``token_ids`` they are
                           ``DRAFT_ON_DEVICE`` placeholders, and ``StepResult.drafts``
                           returns them
    state_slots      (B,)  (or () for a model without recurrent state) hybrid models: the
                           state slot of each row (``engine/state_cache.py``), which holds
                           the state after the row's first ``start_positions`` tokens and
                           is left holding the state after its computed ones (a drafted
                           row: its last token and the accepted drafts)
    state_init       (B,)  (with state_slots) how the row's slot starts the step:
                           ``STATE_CONTINUE`` (as it is), ``STATE_RESET`` (the zero
                           state), or a snapshot id >= 0 to copy in first (a prefix hit)
    state_saves      B entries (or () when no row saves one): (offset, snapshot id)
                           pairs: after the row's first ``offset`` fed tokens, copy its
                           state into that snapshot (a block boundary of the prefix cache)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from minivllm.sampling import SamplingParams
from minivllm.step_types import TokenHistory, TokenLogprobs


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@dataclass(frozen=True)
class StepPlan:
    """One step of work for the executor (see the module docstring for shapes)."""

    # Engine-wide sequence ids, in batch order.
    seq_ids: tuple[int, ...]
    # int64 (T,): the token ids fed this step, all sequences concatenated.
    token_ids: np.ndarray
    # int32 (B,): number of tokens fed per sequence.
    query_lens: np.ndarray
    # int32 (B,): position of each sequence's first fed token.
    start_positions: np.ndarray
    # Per sequence, its block ids (covering start_position + query_len tokens).
    block_tables: tuple[tuple[int, ...], ...]
    # bool (B,): whether the sequence samples a next token this step.
    sample: np.ndarray
    # Per sequence, its sampling settings.
    sampling_params: tuple[SamplingParams, ...]
    # Tokens per KV block.
    block_size: int
    # bool (B,): the last fed token is this sequence's sample of the previous plan.
    feeds_prev_sample: np.ndarray
    # Per sequence (or () when none): penalty histories / prompt-logprob targets.
    histories: tuple[TokenHistory | None, ...] = ()
    prompt_logprob_targets: tuple[np.ndarray | None, ...] = ()
    # bool (B,), or () when no row is: samples under a token bitmask given later.
    masked: np.ndarray | tuple[()] = ()
    # int32 (B,), or () when no row has any: the draft tokens ending the row's chunk.
    num_drafts: np.ndarray | tuple[()] = ()
    drafts_on_device: bool = False
    # int32 (B,) each, or () for a model without recurrent state: state slots and their start.
    state_slots: np.ndarray | tuple[()] = ()
    state_init: np.ndarray | tuple[()] = ()
    # Per sequence (or () when none): (offset, snapshot id) pairs to save after.
    state_saves: tuple[tuple[tuple[int, int], ...], ...] = ()

    @staticmethod
    def build(
        seq_ids: list[int],
        token_chunks: list[list[int]],
        start_positions: list[int],
        block_tables: list[tuple[int, ...]],
        sample: list[bool],
        sampling_params: list[SamplingParams],
        block_size: int,
        feeds_prev_sample: list[bool] | None = None,
        histories: list[TokenHistory | None] | None = None,
        prompt_logprob_targets: list[np.ndarray | None] | None = None,
        masked: list[bool] | None = None,
        num_drafts: list[int] | None = None,
        drafts_on_device: bool = False,
        state_slots: list[int] | None = None,
        state_init: list[int] | None = None,
        state_saves: list[tuple[tuple[int, int], ...]] | None = None,
    ) -> "StepPlan":
        """Assemble a plan from per-sequence lists (one concatenation, no per-token loop).

        A chunk whose sequence ``feeds_prev_sample`` ends with the placeholder -1.
        ``histories`` / ``prompt_logprob_targets`` / ``masked``: per sequence, or None when
        no sequence has one (stored as ()).
        """
        lens = np.fromiter((len(c) for c in token_chunks), dtype=np.int32, count=len(token_chunks))
        flat = np.fromiter(chain.from_iterable(token_chunks), dtype=np.int64, count=int(lens.sum()))
        return StepPlan(
            seq_ids=tuple(seq_ids),
            token_ids=_frozen(flat),
            query_lens=_frozen(lens),
            start_positions=_frozen(np.asarray(start_positions, dtype=np.int32)),
            block_tables=tuple(block_tables),
            sample=_frozen(np.asarray(sample, dtype=bool)),
            sampling_params=tuple(sampling_params),
            block_size=block_size,
            feeds_prev_sample=_frozen(np.asarray(
                feeds_prev_sample if feeds_prev_sample is not None else [False] * len(seq_ids), dtype=bool)),
            histories=tuple(histories) if histories is not None and any(h is not None for h in histories) else (),
            prompt_logprob_targets=(tuple(prompt_logprob_targets) if prompt_logprob_targets is not None
                                    and any(t is not None for t in prompt_logprob_targets) else ()),
            masked=_frozen(np.asarray(masked, dtype=bool)) if masked is not None and any(masked) else (),
            num_drafts=(_frozen(np.asarray(num_drafts, dtype=np.int32)) if num_drafts is not None
                        and any(num_drafts) else ()),
            drafts_on_device=drafts_on_device and num_drafts is not None and any(num_drafts),
            state_slots=_frozen(np.asarray(state_slots, dtype=np.int32)) if state_slots is not None else (),
            state_init=_frozen(np.asarray(state_init, dtype=np.int32)) if state_init is not None else (),
            state_saves=tuple(state_saves) if state_saves is not None and any(state_saves) else (),
        )

    @property
    def prev_sample_slots(self) -> np.ndarray:
        """int64 (R,): indices into ``token_ids`` of the tokens fed by reference."""
        ends = np.cumsum(self.query_lens, dtype=np.int64) - 1
        return ends[self.feeds_prev_sample]

    @property
    def num_masked_rows(self) -> int:
        """Rows sampling under a token bitmask (0: the step needs none)."""
        return int(np.count_nonzero(self.masked)) if len(self.masked) else 0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def one_token_per_seq(self) -> bool:
        """Every sequence feeds exactly one token: the shape of the decode kernel and
        of the CUDA graphs. Whether a chunk *is* a decode is the question of
        ``is_decode_chunk``; a 1-token prefill remainder has this shape too."""
        return bool(np.all(self.query_lens == 1))


@dataclass(frozen=True)
class StepResult:
    """What the executor produced: the next token of every sampling sequence.

    Attributes:
        sampled: sequence id -> sampled token id, for exactly the sequences with
            ``plan.sample`` true.
        logprobs: sequence id -> the sampled token's ``TokenLogprobs`` (P = 1), for
            exactly the sampling sequences whose params ask for ``logprobs``.
        prompt_logprobs: sequence id -> ``TokenLogprobs`` of its P targets, for
            exactly the sequences with ``plan.prompt_logprob_targets`` set.
        num_accepted: sequence id -> a, for rows with drafts (absent: 0): the row's first
            a drafts are accepted and ``sampled`` is the token after them (the correction
            of draft a + 1, or the bonus token after all d); its ``logprobs`` then cover
            those a + 1 tokens (P = a + 1).
        drafts: sequence id -> the row's d drafts, for rows whose drafts the executor made
            (``StepPlan.drafts_on_device``).
    """

    sampled: dict[int, int]
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    num_accepted: dict[int, int] = field(default_factory=dict)
    drafts: dict[int, list[int]] = field(default_factory=dict)
