"""A request's life inside the engine."""

from __future__ import annotations

import enum

from minivllm.outputs import FinishReason
from minivllm.sampling import SamplingParams


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
    """

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
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
        # Tokens served from the prefix cache at the last admission.
        self.num_cached_tokens = 0
        self.finish_reason: FinishReason | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self.token_ids[self.num_prompt_tokens:])

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, id={self.seq_id}, {self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table})")
