"""The paged KV cache's bookkeeping: which block belongs to whom.

A pool of ``num_blocks`` blocks of ``block_size`` token slots. Each live
sequence owns a block table; a block's ref count is the number of live
sequences whose table holds it. Free blocks (ref 0) sit in an LRU queue.

Prefix caching: every full, computed block is registered under a chained hash
``h_i = xxh64(h_{i-1} || token ids of block i)``, so equal hashes mean equal
whole prefixes. A freed block keeps its hash and stays hittable until the pool
hands it out again (least recently freed first), so a prefix is reused across
requests, not only between sequences alive at the same time. A block that is
hit is full and already computed, so a shared block (ref > 1) is never written.

Hybrid models (``state``, ``engine/state_cache.py``): a running sequence also holds a
state slot, and a hit resumes only from a block whose end has a state snapshot (the
deepest such one), which is evicted with its block's hash.

No tensor lives here; the executor owns the K/V values, addressed by
``slot = block_id * block_size + offset``.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from minivllm.config import cdiv
from minivllm.engine.sequence import Sequence
from minivllm.engine.state_cache import StateCache


class InvariantError(AssertionError):
    """An engine invariant does not hold (a bug in the engine, never user error)."""


def chain_hash(parent: int, block_tokens: list[int]) -> int:
    """Hash of a full block given its parent's hash (0 for the first block)."""
    data = parent.to_bytes(8, "little") + np.asarray(block_tokens, dtype=np.int64).tobytes()
    return xxhash.xxh64_intdigest(data)


class BlockManager:
    """Allocates blocks to sequences and serves prefix-cache hits."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 state: StateCache | None = None) -> None:
        self.num_blocks = num_blocks
        self.state = state
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # LRU queue of free blocks: handed out from the front, freed to the back.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    # ---- prefix cache -------------------------------------------------------

    def _full_block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The chained hashes of the first ``num_blocks`` full blocks of ``seq``."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else 0, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes[:num_blocks]

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq``'s tokens.

        At most ``(num_tokens - 1) // block_size`` blocks: the last token is
        always recomputed, so a step always computes at least one token (the
        one that samples) and never writes into a hit block. None for a sequence
        that must compute its whole prompt (``reads_prefix_cache`` false).
        """
        if not self.enable_prefix_caching or not seq.reads_prefix_cache:
            return []
        hit: list[int] = []
        hashes = self._full_block_hashes(seq, (seq.num_tokens - 1) // self.block_size)
        for h in hashes:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hit.append(block)
        if self.state is not None:  # a hybrid model resumes only where its state was kept
            seq.cached_prefix_blocks = len(hit)  # a branch point: the rule snapshots it (StateCache.boundaries)
            del hit[self.state.deepest(hashes[:len(hit)]):]
        return hit

    def register_computed_blocks(self, seq: Sequence, num_done_tokens: int) -> None:
        """Offer ``seq``'s newly full blocks among its first ``num_done_tokens`` to the prefix cache.

        ``num_done_tokens`` counts tokens whose K/V a *completed* step wrote (the
        scheduler advances ``num_computed_tokens`` when it schedules, before the
        step runs): a block is hittable only once its contents exist.
        """
        num_full = num_done_tokens // self.block_size
        if not self.enable_prefix_caching or num_full <= seq.num_registered_blocks:
            return
        hashes = self._full_block_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block = seq.block_table[i]
            # An equal block may already be cached (the last block of a fully
            # cached prompt is recomputed into a fresh block): keep the first.
            if hashes[i] not in self.hash_to_block and self.block_hash[block] is None:
                self.hash_to_block[hashes[i]] = block
                self.block_hash[block] = hashes[i]
        seq.num_registered_blocks = num_full
        if self.state is not None and seq.pending_snapshots:
            self.state.bind(seq, hashes, num_full)

    # ---- allocation ---------------------------------------------------------

    def _take_free_block(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        old = self.block_hash[block]
        if old is not None:  # evict: its contents are about to be overwritten
            del self.hash_to_block[old]
            self.block_hash[block] = None
            if self.state is not None:
                self.state.drop(old)
        self.ref_counts[block] = 1
        return block

    def admission_cost(self, seq: Sequence, hit: list[int], num_new_tokens: int) -> int:
        """Free blocks needed to admit ``seq`` with ``hit`` and ``num_new_tokens`` to compute."""
        fresh = cdiv(len(hit) * self.block_size + num_new_tokens, self.block_size) - len(hit)
        revived = sum(1 for b in hit if self.ref_counts[b] == 0)
        return fresh + revived

    def reserve_snapshot(self, seq: Sequence, blocks: int) -> int | None:
        """``StateCache.reserve`` for ``seq``'s first ``blocks`` full blocks; a snapshot whose
        block no sequence holds may make way for it."""
        assert self.state is not None
        return self.state.reserve(seq, blocks, lambda h: self.ref_counts[self.hash_to_block[h]] == 0)

    def has_state_slot(self) -> bool:
        """Whether a sequence may be admitted as far as state goes (a free slot, or no state)."""
        return self.state is None or self.state.num_free_slots > 0

    def allocate(self, seq: Sequence, hit: list[int], num_new_tokens: int) -> None:
        """Give a waiting ``seq`` the hit blocks plus fresh ones for ``num_new_tokens`` (and, for
        a hybrid model, a slot starting from the hit's snapshot or from the zero state)."""
        assert not seq.block_table, "allocate() is for sequences holding no blocks"
        if self.state is not None:
            self.state.take_slot(seq, self.state.snapshot_of[seq.block_hashes[len(hit) - 1]] if hit else None)
        for block in hit:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
        seq.block_table = list(hit)
        seq.num_registered_blocks = len(hit)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hit) * self.block_size
        self.append_slots(seq, num_new_tokens)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks a running ``seq`` needs to compute ``num_new_tokens`` more tokens."""
        total = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(seq.block_table))

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend ``seq``'s table to cover ``num_new_tokens`` more tokens (caller checked room)."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need:  # most decode steps fit in the last block
            assert need <= len(self.free_blocks), "caller must check blocks_needed() first"
            seq.block_table.extend(self._take_free_block() for _ in range(need))

    def roll_back(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Forget ``seq``'s computed tokens past ``num_computed_tokens`` (rejected drafts: their
        K/V is garbage and is rewritten before it is read); blocks that held only those go
        back to the pool, first in line (they carry no hash worth keeping)."""
        assert num_computed_tokens <= seq.num_computed_tokens
        seq.num_computed_tokens = num_computed_tokens
        keep = cdiv(num_computed_tokens, self.block_size)
        for block in seq.block_table[keep:]:
            assert self.ref_counts[block] == 1 and self.block_hash[block] is None, "a draft's block is private"
            self.ref_counts[block] = 0
            self.free_blocks[block] = None
            self.free_blocks.move_to_end(block, last=False)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks; tail blocks first, so they are evicted first."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        seq.block_table = []
        seq.num_registered_blocks = 0
        seq.num_computed_tokens = 0
        if self.state is not None:
            self.state.release(seq)

    # ---- invariants ---------------------------------------------------------

    def check_invariants(self, live: list[Sequence]) -> None:
        """Raise ``InvariantError`` unless the pool agrees with the live tables.

        Called after every simulated step, so it compares whole collections and
        builds a message only when a check fails.
        """
        expected = [0] * self.num_blocks
        for seq in live:
            if len(set(seq.block_table)) != len(seq.block_table):
                raise InvariantError(f"{seq} holds a block twice")
            for block in seq.block_table:
                expected[block] += 1
        if expected != self.ref_counts:
            diff = [(b, e, r) for b, (e, r) in enumerate(zip(expected, self.ref_counts)) if e != r]
            raise InvariantError(f"ref counts differ from the live block tables (block, want, have): {diff}")
        zero = {b for b, r in enumerate(self.ref_counts) if r == 0}
        if zero != self.free_blocks.keys():
            raise InvariantError(f"free list {sorted(self.free_blocks)} != blocks with ref 0 {sorted(zero)}")
        for h, block in self.hash_to_block.items():
            if self.block_hash[block] != h:
                raise InvariantError(f"hash map points {h} at block {block}, which carries {self.block_hash[block]}")
        # Every map entry points at a block carrying it; equal counts make it one-to-one.
        carried = sum(h is not None for h in self.block_hash)
        if carried != len(self.hash_to_block):
            raise InvariantError(f"{carried} blocks carry a hash but the map has {len(self.hash_to_block)}")
        self._check_written_blocks(live)

    def _check_written_blocks(self, live: list[Sequence]) -> None:
        """Blocks that can still be written are private and unhashed; full ones precede them."""
        bs = self.block_size
        for seq in live:
            if len(seq.block_table) != cdiv(seq.num_computed_tokens, bs):
                raise InvariantError(f"{seq}: block table does not cover exactly its computed tokens")
            for block in seq.block_table[seq.num_computed_tokens // bs:]:
                if self.ref_counts[block] != 1 or self.block_hash[block] is not None:
                    raise InvariantError(f"{seq}: partially filled block {block} is shared or hashed")
        if not self.enable_prefix_caching and self.hash_to_block:
            raise InvariantError("blocks carry hashes with prefix caching off")
        if self.state is not None:
            errors = self.state.check(live, set(self.hash_to_block))
            if errors:
                raise InvariantError("; ".join(errors))
        elif any(s.state_slot is not None or s.pending_snapshots for s in live):
            raise InvariantError("a sequence holds a state slot or snapshot, but the model has no state")
