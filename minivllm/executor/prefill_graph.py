"""CUDA graphs for prefill and mixed steps, per token-count bucket (on CUDA unless ``enforce_eager``).

A step that is not a pure decode would run eagerly: about 260 launches whose host
cost exceeds the GPU's time for the step (docs/tuning.md, "CUDA graphs"). Here a step
of T tokens and B sequences is padded to the smallest captured bucket Tb >= T and
replayed from one graph, like a decode step:

    tokens      [0, T): the step's          [T, Tb): padding (id 0, position 0, slot -1)
    sequences   [0, B): the step's          B: the padding tokens, kv_len 0 (attention
                                               writes zeros for them); B+1..S_b - 1: empty
    attention   the prefill kernel's map mode: grid (capacity, Hkv) from the static
                ``tile_map`` buffer, whatever B and the q lengths are

A hybrid model's step also carries its state (``StateMetadata``): the step's B state slots,
then -1 for the padding sequence and the empty ones (the state kernels run a slot -1 from
zeros and write nothing), and its N save points (prefix snapshots, drafted rows' per-position
states) in a buffer of ``Tb + max_num_seqs`` (at most one save per fed token, and a snapshot
beside a drafted row's first draft save), ordered by row, each sequence's range in
``save_bounds``: a kernel's program visits its own sequence's only, and the padding and empty
sequences' ranges are empty; unused entries are on row -1.
The snapshots a step restores are copied into their slots before the replay, as eagerly.

A step has at most min(max_num_seqs, Tb) sequences (each feeds a token), so bucket Tb's graph
holds S_b = min(max_num_seqs, Tb) + 1 sequences: a small bucket's per-sequence kernels (the
state kernels' grids) launch no programs for sequences it cannot have.

Each bucket's graph bakes in ``max_q_len = Tb``, so the kernel's config (and its
tokens per q tile) is the one ``default_config`` picks for Tb; the host builds the
step's tile map with it (``tile_map_for``) and the executor uploads it with the
other inputs. Padding costs GEMM rows (up to 2x the tokens of a small step), not
correctness: every op is row-wise except attention, which never reads padding.

With ``capture=False`` (the CPU, tests) ``run`` calls the forward on the same
padded static buffers instead of replaying: the padding logic is checked where
no graph can be captured.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from minivllm.executor.cuda_graph import capture_graphs
from minivllm.executor.device_batch import DeviceBatch, resolve_input_ids
from minivllm.ops.dispatch import MAX_ROWS, Ops
from minivllm.ops.metadata import AttentionMetadata, StateMetadata

if TYPE_CHECKING:
    from minivllm.executor.linear_state import LinearStates


# A hybrid model's smallest buckets, powers of two up to the GEMV path's ``MAX_ROWS`` (2 to 16):
# a small step (a drafted batch-1 step, a short prompt's last chunk) runs at about its own size,
# so its projections take the GEMV path and its state kernels see no padding sequence of tens
# of tokens.
HYBRID_SMALL_BUCKETS = tuple(1 << k for k in range(1, MAX_ROWS.bit_length()))


def default_prefill_buckets(max_num_batched_tokens: int, hybrid: bool = False) -> list[int]:
    """Powers of two from 64 below the budget, and the budget itself (drafted steps of dense
    models too: smaller buckets made them slower, docs/tuning.md, "Speculative decoding"); a
    hybrid model's also ``HYBRID_SMALL_BUCKETS`` (docs/tuning.md, "Hybrid models")."""
    sizes = [1 << k for k in range(6, 32) if (1 << k) < max_num_batched_tokens]
    small = [b for b in HYBRID_SMALL_BUCKETS if b < max_num_batched_tokens] if hybrid else []
    return small + sizes + [max_num_batched_tokens]


class PrefillGraphRunner:
    """Captures ``forward(input_ids, positions, meta) -> hidden`` for prefill token buckets.

    Args:
        forward: the model's forward.
        kv_cache: the whole KV cache (its address is baked into the graphs).
        prev_sampled: the executor's buffer of last-step samples.
        hidden_size: width of the forward's output rows.
        dtype: the activations' dtype (the model's; the cache's may be e4m3).
        num_heads, num_kv_heads, head_dim: the attention shape on this rank (tile sizes).
        max_num_seqs: most sequences in a step.
        max_blocks_per_seq: block-table width W.
        buckets: token counts to capture.
        capture: capture CUDA graphs (else run the padded forward eagerly).
        states: a hybrid model's state tensors (``executor/linear_state.py: LinearStates``), or
            None.
    """

    def __init__(self, forward: Callable[..., torch.Tensor], kv_cache: torch.Tensor,
                 prev_sampled: torch.Tensor, hidden_size: int, dtype: torch.dtype, num_heads: int,
                 num_kv_heads: int, head_dim: int, max_num_seqs: int, max_blocks_per_seq: int, buckets: list[int],
                 capture: bool, states: "LinearStates | None" = None) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive token counts, got {buckets}")
        self.buckets = sorted(set(buckets))
        self.max_num_seqs = max_num_seqs
        self.width = max_blocks_per_seq
        self.forward = forward
        self.kv_cache = kv_cache
        self.prev_sampled = prev_sampled
        dev, t = kv_cache.device, self.buckets[-1]
        # Per bucket: tokens per q tile of the config its graph bakes in, and the map's rows
        # (every tile of B sequences and the padding one: tokens / tile + a part tile each).
        self.block_q = {b: Ops.prefill_tile_rows(dtype, head_dim, b, num_heads, num_kv_heads) for b in self.buckets}
        self.capacity = {b: -(-b // self.block_q[b]) + max_num_seqs + 1 for b in self.buckets}
        s = max_num_seqs + 1  # the step's sequences and the padding one
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.prev_rows = torch.full((t,), -1, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(t, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=dev)
        self.cu_seqlens_q = torch.zeros(s + 1, dtype=torch.int32, device=dev)
        self.kv_lens = torch.zeros(s, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((s, self.width), -1, dtype=torch.int32, device=dev)
        self.tile_map = torch.full((max(self.capacity.values()), 2), -1, dtype=torch.int32, device=dev)
        self.hidden = torch.zeros(t, hidden_size, dtype=dtype, device=dev)
        self.states = states
        if states is not None:
            self.state_slots = torch.full((s,), -1, dtype=torch.int64, device=dev)
            self.state_init = torch.zeros(s, dtype=torch.bool, device=dev)
            self.save_rows = torch.full((t + max_num_seqs,), -1, dtype=torch.int64, device=dev)
            self.save_offsets = torch.zeros(t + max_num_seqs, dtype=torch.int64, device=dev)
            self.save_slots = torch.zeros(t + max_num_seqs, dtype=torch.int64, device=dev)
            self.save_bounds = torch.zeros(s + 1, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0
        self.replays_by_bucket = dict.fromkeys(self.buckets, 0)
        if capture:
            self._capture()

    def max_saves(self, bucket: int) -> int:
        """The save points a step in ``bucket`` may carry (module doc)."""
        return bucket + self.max_num_seqs

    def num_seq_slots(self, bucket: int) -> int:
        """S_b: the sequences a step in ``bucket`` may have, and the padding one (module doc)."""
        return min(self.max_num_seqs, bucket) + 1

    def _meta(self, bucket: int) -> AttentionMetadata:
        seqs = self.num_seq_slots(bucket)
        state = None
        if self.states is not None:
            n = self.max_saves(bucket)
            state = StateMetadata(slots=self.state_slots[:seqs], has_initial_state=self.state_init[:seqs],
                                  conv_state=self.states.conv_state, recurrent_state=self.states.recurrent_state,
                                  save_rows=self.save_rows[:n], save_offsets=self.save_offsets[:n],
                                  save_slots=self.save_slots[:n], save_bounds=self.save_bounds[:seqs + 1])
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], cu_seqlens_q=self.cu_seqlens_q[:seqs + 1],
            kv_lens=self.kv_lens[:seqs], block_tables=self.block_tables[:seqs], max_q_len=bucket, is_decode=False,
            kv_cache=self.kv_cache, tile_map=self.tile_map[:self.capacity[bucket]], state=state)

    def _step(self, bucket: int) -> None:
        ids = resolve_input_ids(self.input_ids[:bucket], self.prev_rows[:bucket], self.prev_sampled)
        self.hidden[:bucket] = self.forward(ids, self.positions[:bucket], self._meta(bucket))

    def _capture(self) -> None:
        self.graphs = capture_graphs(self.buckets, self._step, before=self._fill_padding_only)

    def _fill_padding_only(self, bucket: int) -> None:
        """A step of only padding (what capture runs): one kv_len-0 sequence of every token."""
        self.cu_seqlens_q.fill_(bucket)
        self.cu_seqlens_q[0] = 0
        self.kv_lens.zero_()
        if self.states is not None:
            self.state_slots.fill_(-1)
            self.save_rows.fill_(-1)
            self.save_bounds.zero_()
        self.tile_map[:self.capacity[bucket]].copy_(torch.from_numpy(
            Ops.prefill_tile_map(np.array([bucket]), self.block_q[bucket], self.capacity[bucket])))

    def bucket_for(self, num_tokens: int, num_seqs: int, table_width: int, is_decode: bool,
                   num_saves: int = 0) -> int | None:
        """The bucket a step runs in, or None when it runs eagerly (a decode, too many tokens,
        sequences, blocks or save points)."""
        if is_decode or num_seqs > self.max_num_seqs or table_width > self.width:
            return None
        i = bisect.bisect_left(self.buckets, num_tokens)
        if i == len(self.buckets) or num_saves > self.max_saves(self.buckets[i]):
            return None
        return self.buckets[i]

    def tile_map_for(self, cu_seqlens_q: np.ndarray, bucket: int) -> np.ndarray:
        """The step's tile map (host): its sequences' q tiles and the padding sequence's."""
        q_lens = np.diff(cu_seqlens_q)
        padding = bucket - int(cu_seqlens_q[-1])
        return Ops.prefill_tile_map(np.append(q_lens, padding), self.block_q[bucket], self.capacity[bucket])

    def run(self, batch: DeviceBatch) -> torch.Tensor:
        """Replay the batch's bucket (its tensors, the tile map included, already on the device).

        Returns:
            (T, hidden_size) hidden states (a view into the static output).
        Raises:
            ValueError: the batch is not one this runner covers, or carries no tile map.
        """
        meta = batch.attn_metadata
        t, b, w = batch.positions.shape[0], batch.num_seqs, batch.table_width
        bucket = self.bucket_for(t, b, w, meta.is_decode)
        if bucket is None or meta.tile_map is None or meta.tile_map.shape[0] != self.capacity[bucket]:
            raise ValueError(f"prefill graphs cover up to {self.buckets[-1]} tokens, {self.max_num_seqs} "
                             f"sequences and {self.width} blocks with a tile map of the bucket's capacity; got "
                             f"{t} tokens, {b} sequences, {w} blocks, decode {meta.is_decode}, map "
                             f"{None if meta.tile_map is None else tuple(meta.tile_map.shape)}")
        self.input_ids[:t].copy_(batch.input_ids)
        self.input_ids[t:bucket].zero_()   # valid ids for the embedding
        self.prev_rows[:t].copy_(batch.prev_rows)
        self.prev_rows[t:bucket].fill_(-1)
        self.positions[:t].copy_(batch.positions)
        self.positions[t:bucket].zero_()
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.slot_mapping[t:bucket].fill_(-1)
        self.cu_seqlens_q[:b + 1].copy_(meta.cu_seqlens_q)
        self.cu_seqlens_q[b + 1:].fill_(bucket)  # sequence b: the padding tokens; the rest empty
        self.kv_lens[:b].copy_(meta.kv_lens)
        self.kv_lens[b:].zero_()
        self.block_tables.fill_(-1)
        self.block_tables[:b, :w].copy_(meta.block_tables)
        self.tile_map[:self.capacity[bucket]].copy_(meta.tile_map)
        if self.states is not None:
            state = meta.state
            assert state is not None and state.save_bounds is not None, "a hybrid step's state, its saves bounded"
            n = state.save_rows.shape[0]
            if n > self.max_saves(bucket):
                raise ValueError(f"{n} save points, but a step in bucket {bucket} holds {self.max_saves(bucket)}")
            self.state_slots[:b].copy_(state.slots)
            self.state_slots[b:].fill_(-1)
            self.state_init[:b].copy_(state.has_initial_state)
            self.save_rows[:n].copy_(state.save_rows)
            self.save_rows[n:].fill_(-1)
            self.save_offsets[:n].copy_(state.save_offsets)
            self.save_slots[:n].copy_(state.save_slots)
            self.save_bounds[:b + 1].copy_(state.save_bounds)
            self.save_bounds[b + 1:].fill_(n)   # the padding and empty sequences: none
        if self.graphs:
            self.graphs[bucket].replay()
        else:
            self._step(bucket)
        self.num_replays += 1
        self.replays_by_bucket[bucket] += 1
        return self.hidden[:t]
