"""Stateful property test of the paged block manager (hypothesis RuleBasedStateMachine).

Sequences are allocated (with prefix-cache hits), grown token by token,
and freed in random orders over a tiny pool; after every rule the manager's
own ``check_invariants`` plus a few model-level facts must hold.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minivllm.engine.block_manager import BlockManager, InvariantError, chain_hash
from minivllm.engine.sequence import Sequence
from minivllm.sampling import SamplingParams

import pytest

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 1, 2], [1, 2, 3, 4, 7, 7]]


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.live: list[Sequence] = []
        self.next_id = 0

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 12),
                caching=st.booleans())
    def setup(self, block_size: int, num_blocks: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, caching)

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=5),
          chunk=st.integers(1, 8))
    def allocate(self, prefix: list[int], tail: list[int], chunk: int) -> None:
        seq = Sequence(self.next_id, f"s{self.next_id}", prefix + tail, SamplingParams())
        self.next_id += 1
        hit = self.bm.find_cached_prefix(seq)
        assert len(hit) * self.bm.block_size < seq.num_tokens  # the last token is always computed
        n = min(chunk, seq.num_tokens - len(hit) * self.bm.block_size)
        if self.bm.admission_cost(seq, hit, n) > self.bm.num_free_blocks:
            return
        cost = self.bm.admission_cost(seq, hit, n)
        free_before = self.bm.num_free_blocks
        self.bm.allocate(seq, hit, n)
        assert free_before - self.bm.num_free_blocks == cost
        seq.num_computed_tokens += n
        self.bm.register_computed_blocks(seq, seq.num_computed_tokens)
        self.live.append(seq)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), n=st.integers(1, 5))
    def grow(self, data: st.DataObject, n: int) -> None:
        seq = data.draw(st.sampled_from(self.live))
        missing = seq.num_uncomputed_tokens
        if missing == 0:
            seq.token_ids.append(data.draw(st.integers(0, 3)))
            missing = 1
        n = min(n, missing)
        if self.bm.blocks_needed(seq, n) > self.bm.num_free_blocks:
            return
        self.bm.append_slots(seq, n)
        seq.num_computed_tokens += n
        self.bm.register_computed_blocks(seq, seq.num_computed_tokens)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.bm.free(seq)
        assert seq.block_table == [] and seq.num_computed_tokens == 0

    @invariant()
    def manager_consistent(self) -> None:
        self.bm.check_invariants(self.live)

    @invariant()
    def hashes_match_contents(self) -> None:
        # A hashed block that a live sequence holds must hold exactly the tokens its
        # hash names, at the same block index: the prefix cache never lies.
        bs = self.bm.block_size
        for seq in self.live:
            parent = 0
            for i, block in enumerate(seq.block_table[: seq.num_computed_tokens // bs]):
                h = chain_hash(parent, seq.token_ids[i * bs:(i + 1) * bs])
                assert self.bm.block_hash[block] in (None, h)
                parent = h


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                                 deadline=None)
TestBlockManager = BlockManagerMachine.TestCase


def _seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, f"s{i}", tokens, SamplingParams())


def test_prefix_survives_the_request_and_is_evicted_lru() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = _seq(0, [1, 2, 3, 4, 5])
    bm.allocate(a, [], 5)
    a.num_computed_tokens = 5
    bm.register_computed_blocks(a, a.num_computed_tokens)
    blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = _seq(1, [1, 2, 3, 4, 9])
    assert bm.find_cached_prefix(b) == blocks[:2]   # reuse across requests
    # Fill the pool with unrelated sequences: the cached blocks get evicted.
    c = _seq(2, list(range(20, 28)))
    bm.allocate(c, [], 8)
    c.num_computed_tokens = 8
    assert bm.find_cached_prefix(b) == []
    bm.check_invariants([c])


def test_fully_cached_prompt_recomputes_last_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = _seq(0, list(range(8)))
    bm.allocate(a, [], 8)
    a.num_computed_tokens = 8
    bm.register_computed_blocks(a, a.num_computed_tokens)
    b = _seq(1, list(range(8)))
    hit = bm.find_cached_prefix(b)
    assert hit == a.block_table[:1]            # (8 - 1) // 4 = 1 block, last token recomputed
    bm.allocate(b, hit, 8 - 4)
    b.num_computed_tokens = 8
    bm.register_computed_blocks(b, b.num_computed_tokens)             # equal block already cached: no double entry
    bm.check_invariants([a, b])


def test_broken_manager_is_caught() -> None:
    """Forgetting to drop a hash on reuse is a violation the invariants name."""
    bm = BlockManager(num_blocks=2, block_size=2, enable_prefix_caching=True)
    a = _seq(0, [1, 2, 3])
    bm.allocate(a, [], 3)
    a.num_computed_tokens = 3
    bm.register_computed_blocks(a, a.num_computed_tokens)
    bm.free(a)
    bm.block_hash[0] = None  # simulate a stale map entry: the map still points at block 0
    with pytest.raises(InvariantError, match="hash"):
        bm.check_invariants([])
