"""The vocab-parallel embedding lookup kernel (``kernels/vocab_embedding.py``) against its torch
reference, on the CPU under TRITON_INTERPRET=1 (conftest): each rank's shard, every rank's
``vocab_end`` (the next rank's first id) included, and the ranks' outputs summing to the
whole table's rows (an id looked up on two ranks, ``<=`` for ``<``, fails it)."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels.reference import vocab_shard_embedding_reference
from minivllm.kernels.vocab_embedding import vocab_shard_embedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,world,dim", [(12, 2, 24), (11, 2, 24), (10, 3, 1100), (4, 3, 8)])
def test_ranks_shards_sum_to_the_whole_table(dtype, vocab, world, dim):
    gen = torch.Generator().manual_seed(vocab * world)
    table = torch.randn(vocab, dim, generator=gen).to(dtype)
    shard = -(-vocab // world)
    edges = [i for r in range(world) for i in (r * shard - 1, r * shard, (r + 1) * shard) if 0 <= i < vocab]
    ids = torch.tensor(list(range(vocab)) + edges)
    total = torch.zeros(len(ids), dim, dtype=torch.float32)
    for rank in range(world):
        start, end = min(vocab, rank * shard), min(vocab, (rank + 1) * shard)
        rows = torch.zeros(shard, dim, dtype=dtype)  # padded as the layer pads the last rank
        rows[: end - start] = table[start:end]
        for kind in (torch.int64, torch.int32):
            got = vocab_shard_embedding(ids.to(kind), rows, start, end)
            assert torch.equal(got, vocab_shard_embedding_reference(ids, rows, start, end))
        total += got.float()
    assert torch.equal(total, table[ids].float())


def test_bad_arguments_are_named():
    w = torch.zeros(4, 8)
    with pytest.raises(TypeError, match="ids"):
        vocab_shard_embedding(torch.zeros(3), w, 0, 4)
    with pytest.raises(ValueError, match="ids"):
        vocab_shard_embedding(torch.zeros(1, 3, dtype=torch.int64), w, 0, 4)
    with pytest.raises(ValueError, match="weight"):
        vocab_shard_embedding(torch.zeros(3, dtype=torch.int64), torch.zeros(8, 4).t(), 0, 4)
    with pytest.raises(ValueError, match="range"):
        vocab_shard_embedding(torch.zeros(3, dtype=torch.int64), w, 2, 7)
    assert vocab_shard_embedding(torch.zeros(0, dtype=torch.int64), w, 0, 4).shape == (0, 8)
