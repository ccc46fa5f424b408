"""Vocab-parallel token embedding and LM head.

The vocabulary is cut into ``tp_size`` contiguous ranges of
``shard_size = ceil(vocab / tp_size)`` rows; rank r holds rows
``[r * shard_size, min(vocab, (r + 1) * shard_size))`` and zero padding up to
``shard_size``: only the trailing ranks pad (usually just the last; with a tiny
vocab a rank may hold nothing but padding), so the vocabulary needs no
divisibility by ``tp_size``. The embedding looks up the ids in its half-open
range ``[vocab_start, vocab_end)`` (an id equal to ``vocab_end`` belongs to the
next rank: every id is looked up on exactly one rank), zeros the others and
all-reduces; the LM head computes logits for its range and all-gathers them
along the vocabulary, then drops the trailing padding (or, with ``gather=False``, hands
back its own range for sampling from the shards: ``Sampler.forward_vocab_parallel``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.config import cdiv
from minivllm.layers.weights import Loaded, ShardId, check_tp, load_slice, set_weight_loader
from minivllm.ops.communicator import Communicator


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split across ranks by vocabulary range; the decoder looks
    rows up through ``Ops.embed``, which also sums the ranks' rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        check_tp(tp_rank, tp_size)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.shard_size = cdiv(num_embeddings, tp_size)
        self.vocab_start = min(num_embeddings, tp_rank * self.shard_size)
        self.vocab_end = min(num_embeddings, self.vocab_start + self.shard_size)
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        """Copy this rank's vocabulary rows of the full (vocab, dim) tensor (reading only
        those); zero the padding.

        Raises:
            ValueError: a shard id was given, or the checkpoint shape is wrong.
        """
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not packed; got shard id {shard_id!r}")
        n = self.vocab_end - self.vocab_start
        load_slice(param.data[:n], loaded, 0, self.vocab_start, self.num_embeddings, type(self).__name__)
        with torch.no_grad():
            param.data[n:].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection to logits; shares the embedding's sharding (and can
    share its weight, for tied embeddings)."""

    def forward(self, hidden: torch.Tensor, comm: Communicator | None = None,
                gather: bool = True) -> torch.Tensor:
        """Logits (S, vocab) for exactly the rows given (the caller passes only sampling rows),
        gathered over ranks by ``comm``; ``gather=False``: this rank's columns
        ``[vocab_start, vocab_end)`` only, (S, vocab_end - vocab_start), no collective."""
        logits = F.linear(hidden, self.weight)  # (S, shard_size)
        if self.tp_size == 1:
            return logits
        if not gather:
            return logits[:, : self.vocab_end - self.vocab_start]
        if comm is None:
            raise ValueError("a tensor-parallel LM head gathers its logits through a communicator")
        # One collective into one buffer (rank-major), then one copy into (S, vocab) order.
        rows, shard = logits.shape
        parts = comm.all_gather_rows(logits)
        return parts.view(self.tp_size, rows, shard).permute(1, 0, 2).reshape(rows, -1)[:, : self.num_embeddings]
