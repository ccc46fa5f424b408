"""A request's life inside the engine."""

from __future__ import annotations

import enum
from typing import Any, Sequence as Seq, TypeVar

from minivllm.outputs import FinishReason, sequence_name
from minivllm.sampling import SamplingParams


def is_decode_chunk(start: int, num_tokens: int, num_prompt_tokens: int) -> bool:
    """THE definition of a decode: a chunk of one token past the prompt.

    A chunk feeding ``num_tokens`` tokens from position ``start`` is a decode
    when it feeds exactly one token that the model sampled (``start >=
    num_prompt_tokens``). The 1-token remainder of a chunked prompt is prefill.
    The scheduler's ``prefill_first`` policy, the engine's statistics and the
    trace records all use this function.
    """
    return num_tokens == 1 and start >= num_prompt_tokens


T = TypeVar("T")


def extend_snapshot(snapshot: tuple[T, ...], items: list[T], start: int) -> tuple[T, ...]:
    """``tuple(items[start:])``, given ``snapshot``, an earlier result for the same list.

    ``items`` only ever grows at its end, so the earlier result is a prefix of
    the new one: only the items added since are read from the list (no slice of
    the whole list each step), and an unchanged list returns the very same tuple.
    """
    missing = len(items) - start - len(snapshot)
    assert missing >= 0, "items are append-only"
    return snapshot + tuple(items[-missing:]) if missing else snapshot


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # in the waiting queue; holds no blocks
    RUNNING = "running"    # in the running queue; holds blocks covering its computed tokens
    FINISHED = "finished"  # done (stop, length or abort); holds nothing


class Sequence:
    """One request's tokens and progress.

    The single idea behind prefill, chunked prefill, prefix-cache hits, decode
    and recompute after preemption: ``num_computed_tokens`` (tokens whose K/V
    are in the cache) catches up with ``num_tokens``. Each step feeds some of
    the uncomputed tokens; when the fed tokens reach the end, the step samples
    one more token, which is appended (uncomputed) and fed next step.

    With one step in flight (asynchronous scheduling) a sampled token is known
    one step late: ``num_pending_tokens`` counts tokens sampled by submitted
    steps whose values have not come back. They count in ``num_tokens`` (the
    next step is planned as if they were there, feeding them by reference) but
    not in ``token_ids``. Synchronous engines never have pending tokens.
    """

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: Seq[int],
                 sampling_params: SamplingParams, index: int = 0) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        # Which of the request's ``n`` completions; ``name`` tells them apart in records.
        self.index = index
        self.name = sequence_name(request_id, index)
        # Built once and shared by every output (and by the other n - 1 completions).
        self.prompt_token_ids: tuple[int, ...] = tuple(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)   # known tokens only, append-only
        self.num_pending_tokens = 0
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # Chained hashes of this sequence's full blocks of tokens (valid forever:
        # tokens are append-only); grown lazily by the block manager.
        self.block_hashes: list[int] = []
        # Leading blocks of block_table already offered to the prefix cache.
        self.num_registered_blocks = 0
        # Tokens served from the prefix cache at the last admission, and at the first (None
        # before it): what the request's outputs report (vLLM's ``num_cached_tokens``).
        self.num_cached_tokens = 0
        self.first_num_cached_tokens: int | None = None
        self.finish_reason: FinishReason | None = None
        # Completion tokens already handed out in a RequestOutput (streaming).
        self.num_reported_tokens = 0
        self.first_token_time: float | None = None  # time.monotonic() when its first completion token was applied
        # The last results of ``output_token_ids`` / ``output_logprobs``, extended as tokens come.
        self._output_token_ids: tuple[int, ...] = ()
        self._output_logprobs: tuple[dict[int, float], ...] = ()
        # Requests with stop strings: their text, grown token by token, and where the
        # final text ends (cut at the stop string found).
        self.text_stream: Any = None
        self.text = ""
        self.text_end: int | None = None
        # Requests asking for logprobs: one {token: logprob} per known completion token.
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        # The completion that computes the prompt's logprobs fills this (None for the
        # first token); it must compute every prompt position, so reads no cache.
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.computes_prompt_logprobs = sampling_params.prompt_logprobs is not None and index == 0
        if self.computes_prompt_logprobs:
            self.prompt_logprobs = [None] * self.num_prompt_tokens
        self.has_penalties = sampling_params.has_penalties
        self.has_token_rules = sampling_params.has_token_rules  # min_tokens, bad words (engine/token_rules.py)
        # Structured outputs: the matcher (engine/grammar.py), which has accepted exactly
        # the known completion tokens (``num_grammar_tokens`` of them); None when unconstrained.
        self.grammar: Any = None
        self.num_grammar_tokens = 0
        # Speculative decoding: the draft tokens proposed to follow its last token, from
        # proposal until the step that scores them is applied; and its totals so far.
        self.drafts: list[int] = []
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # Hybrid models (``engine/state_cache.py``): the state slot it holds while running, how
        # its next chunk starts from it (``STATE_*`` or a snapshot id), and the snapshots
        # reserved for its block boundaries that a step in flight is writing (full blocks ->
        # snapshot id), and how many leading blocks its last prefix lookup found cached
        # (K/V), snapshot or not: where its prefix branches off another's.
        self.state_slot: int | None = None
        self.state_init = -1  # STATE_CONTINUE
        self.pending_snapshots: dict[int, int] = {}
        self.cached_prefix_blocks = 0

    @property
    def reads_prefix_cache(self) -> bool:
        """False for the completion that must compute every prompt position (prompt logprobs)."""
        return not self.computes_prompt_logprobs

    @property
    def num_tokens(self) -> int:
        """Known plus pending tokens: what the scheduler plans with."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Completion tokens, pending ones included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        """The known completion tokens. Every output carries this tuple, so it is
        extended by the new tokens rather than sliced afresh from ``token_ids``."""
        self._output_token_ids = extend_snapshot(self._output_token_ids, self.token_ids, self.num_prompt_tokens)
        return self._output_token_ids

    @property
    def output_logprobs(self) -> tuple[dict[int, float], ...] | None:
        """``logprobs`` as a tuple (None unless asked for), extended like ``output_token_ids``."""
        if self.logprobs is None:
            return None
        self._output_logprobs = extend_snapshot(self._output_logprobs, self.logprobs, 0)
        return self._output_logprobs

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Its next chunk is a decode: see ``is_decode_chunk``."""
        return is_decode_chunk(self.num_computed_tokens, self.num_uncomputed_tokens, self.num_prompt_tokens)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, id={self.seq_id}, {self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table})")
