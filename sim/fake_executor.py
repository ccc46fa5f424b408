"""The fake model: a paged token store whose "next token" is a hash of what it reads.

``FakeExecutor`` keeps ``kv`` (int64 (num_blocks, block_size), -1 where nothing
was ever written). Each step it writes the fed token ids at the plan's slots and,
for every sequence that samples, reads the whole context back *through its block
table* and returns ``fake_next_token(context)``. A paging bug (wrong slot, stale
block, missing write, block freed too early) changes what is read back, so the
output differs from the unpaged oracle's. See DESIGN.md, "The fake model".
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import xxhash

from minivllm.engine.plan import StepPlan, StepResult
from minivllm.executor.inputs import prepare_inputs


def fake_next_token(context: Sequence[int] | np.ndarray, vocab_size: int) -> int:
    """The fake model's next token after ``context`` (positions 0..n-1)."""
    data = np.asarray(context, dtype=np.int64).tobytes()
    return xxhash.xxh64_intdigest(data) % vocab_size


class PagingError(RuntimeError):
    """A plan addressed KV slots the fake executor's pool does not have."""


class FakeExecutor:
    """Numpy executor implementing the fake model over a paged KV pool.

    Args:
        vocab_size: tokens are drawn from ``[0, vocab_size)``.
        block_size: tokens per KV block; every plan must use the same.
        num_blocks: size of the pool (what ``num_kv_blocks`` reports).
    """

    def __init__(self, vocab_size: int, block_size: int, num_blocks: int) -> None:
        if vocab_size < 1 or block_size < 1 or num_blocks < 1:
            raise ValueError(
                f"vocab_size, block_size and num_blocks must be >= 1, "
                f"got {vocab_size}, {block_size}, {num_blocks}"
            )
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        # int64 (num_blocks, block_size): token id stored in each slot, -1 = never written.
        self.kv = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.num_steps = 0

    def num_kv_blocks(self) -> int:
        """The pool size given at construction."""
        return self.num_blocks

    def execute(self, plan: StepPlan) -> StepResult:
        """Write the fed tokens, read back sampling contexts, hash them."""
        if plan.block_size != self.block_size:
            raise PagingError(f"plan block_size {plan.block_size} != executor block_size {self.block_size}")
        inputs = prepare_inputs(plan)
        self._write(inputs.slot_mapping, inputs.input_ids)
        rows = np.flatnonzero(plan.sample)
        contexts = self._read(inputs.block_tables[rows], inputs.kv_lens[rows])
        sampled = {
            plan.seq_ids[r]: fake_next_token(ctx, self.vocab_size)
            for r, ctx in zip(rows.tolist(), contexts)
        }
        self.num_steps += 1
        return StepResult(sampled=sampled)

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
        return [flat[i, :n] for i, n in enumerate(kv_lens.tolist())]
