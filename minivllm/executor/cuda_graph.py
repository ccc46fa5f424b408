"""CUDA graphs for decode steps.

A decode step runs the same kernels for every batch of the same size, so the
whole forward (all layers, attention included) is captured once per batch size
and replayed. The graphs read from static buffers owned by this runner; a
batch of B sequences is copied into the first B rows and replayed with the
smallest captured size >= B. The padding rows get slot -1 (their K/V write
nothing), kv_len 0 (attention reads nothing) and block tables of -1.

Tokens fed by reference (asynchronous scheduling) are gathered inside the graph
from the executor's ``prev_sampled`` buffer (a static address), so the previous
step's samples go from the sampler to the next forward without leaving the device.

    input_ids     (G,)     int64   -1 where fed by reference
    prev_rows     (G,)     int64   row of prev_sampled for those, -1 elsewhere
    positions     (G,)     int64
    slot_mapping  (G,)     int64   -1 beyond B
    kv_lens       (G,)     int32    0 beyond B
    block_tables  (G, W)   int32   -1 beyond each row's blocks
    hidden        (G, hidden_size) the graph's output

A hybrid model's graphs also read each row's state slot (``StateMetadata``) from static
buffers, and the state tensors at their fixed addresses:

    state_slots   (G,)     int64   -1 beyond B (the kernels run a padding row from zeros and
                                   write no state)
    state_init    (G,)     bool    False: the row starts from the zero state

Restored snapshots are copied into their slots before the replay (``LinearStates.metadata``).
A decode row's save point can only be after its one token, so it is the state the row leaves
in its slot: the runner copies it into the snapshot entry after the replay.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Callable

import torch

from minivllm.executor.device_batch import DeviceBatch, resolve_input_ids
from minivllm.ops.metadata import AttentionMetadata, StateMetadata

if TYPE_CHECKING:
    from minivllm.executor.linear_state import LinearStates


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_num_seqs`` (always including it)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


@torch.inference_mode()
def capture_graphs(sizes: list[int], step: Callable[[int], None],
                   before: Callable[[int], None] | None = None) -> dict[int, torch.cuda.CUDAGraph]:
    """A CUDA graph of ``step(size)`` for each size, largest first so that the smaller reuse
    its memory pool; each run once before its capture (kernels compile outside it), after
    ``before(size)`` (inputs it needs, set outside the graph)."""
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    pool = None
    for size in sorted(sizes, reverse=True):
        if before is not None:
            before(size)
        step(size)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            step(size)
        pool = graph.pool()
        graphs[size] = graph
    torch.cuda.synchronize()
    return graphs


class CudaGraphRunner:
    """Captures ``forward(input_ids, positions, meta) -> hidden`` for decode batch sizes.

    Args:
        forward: the model's forward.
        kv_cache: the whole KV cache (static: graphs bake in its address).
        prev_sampled: the executor's buffer of last-step samples (static too).
        hidden_size: width of the forward's output rows.
        dtype: the activations' dtype (the model's; the cache's may be e4m3).
        max_blocks_per_seq: block-table width W (max_model_len / block_size).
        capture_sizes: batch sizes to capture.
        states: a hybrid model's state tensors (``executor/linear_state.py``; static too), or None.
    """

    def __init__(self, forward: Callable[..., torch.Tensor], kv_cache: torch.Tensor,
                 prev_sampled: torch.Tensor, hidden_size: int, dtype: torch.dtype, max_blocks_per_seq: int,
                 capture_sizes: list[int], states: "LinearStates | None" = None) -> None:
        if not capture_sizes or min(capture_sizes) < 1:
            raise ValueError(f"capture_sizes must be positive batch sizes, got {capture_sizes}")
        self.sizes = sorted(set(capture_sizes))
        self.width = max_blocks_per_seq
        g, dev = self.sizes[-1], kv_cache.device
        self.input_ids = torch.zeros(g, dtype=torch.int64, device=dev)
        self.prev_rows = torch.full((g,), -1, dtype=torch.int64, device=dev)
        self.prev_sampled = prev_sampled
        self.positions = torch.zeros(g, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((g,), -1, dtype=torch.int64, device=dev)
        self.kv_lens = torch.zeros(g, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((g, self.width), -1, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(g + 1, dtype=torch.int32, device=dev)
        self.hidden = torch.zeros(g, hidden_size, dtype=dtype, device=dev)
        self.states = states
        self.state_slots = torch.full((g,), -1, dtype=torch.int64, device=dev)
        self.state_init = torch.zeros(g, dtype=torch.bool, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0
        self._capture(forward, kv_cache)

    def _meta(self, bs: int, kv_cache: torch.Tensor) -> AttentionMetadata:
        state = None
        if self.states is not None:
            state = StateMetadata(slots=self.state_slots[:bs], has_initial_state=self.state_init[:bs],
                                  conv_state=self.states.conv_state, recurrent_state=self.states.recurrent_state)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
            kv_lens=self.kv_lens[:bs], block_tables=self.block_tables[:bs], max_q_len=1,
            is_decode=True, kv_cache=kv_cache, state=state)

    def _capture(self, forward: Callable[..., torch.Tensor], kv_cache: torch.Tensor) -> None:
        def step(bs: int) -> None:
            ids = resolve_input_ids(self.input_ids[:bs], self.prev_rows[:bs], self.prev_sampled)
            self.hidden[:bs] = forward(ids, self.positions[:bs], self._meta(bs, kv_cache))
        self.graphs = capture_graphs(self.sizes, step)

    def can_run(self, batch: DeviceBatch) -> bool:
        """One token per sequence, a captured size and the static table width."""
        return (batch.attn_metadata.is_decode and batch.num_seqs <= self.sizes[-1]
                and batch.table_width <= self.width)

    def run(self, batch: DeviceBatch) -> torch.Tensor:
        """Replay for this batch (its tensors already on the device).

        Returns:
            (B, hidden_size) hidden states (a view into the static output).
        Raises:
            ValueError: the batch is not one this runner can replay.
        """
        if not self.can_run(batch):
            raise ValueError(f"CUDA graphs cover batches of one token per sequence, up to "
                             f"{self.sizes[-1]} sequences and {self.width} blocks per sequence; got "
                             f"{batch.num_seqs} sequences, decode-shaped {batch.attn_metadata.is_decode}, "
                             f"{batch.table_width} blocks")
        b, w = batch.num_seqs, batch.table_width
        g = self.sizes[bisect.bisect_left(self.sizes, b)]
        meta = batch.attn_metadata
        # Padding rows must hold valid ids: a -1 placeholder left by a larger batch would
        # index the embedding out of bounds.
        self.input_ids[b:g].zero_()
        self.input_ids[:b].copy_(batch.input_ids)
        self.prev_rows[b:g].fill_(-1)
        self.prev_rows[:b].copy_(batch.prev_rows)
        self.positions[:b].copy_(batch.positions)
        self.slot_mapping[b:g].fill_(-1)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.kv_lens[b:g].zero_()
        self.kv_lens[:b].copy_(meta.kv_lens)
        self.block_tables[:g].fill_(-1)
        self.block_tables[:b, :w].copy_(meta.block_tables)
        state = meta.state
        if self.states is not None:
            assert state is not None, "a hybrid model's batch carries its state slots"
            self.state_slots[b:g].fill_(-1)
            self.state_slots[:b].copy_(state.slots)
            self.state_init[:b].copy_(state.has_initial_state)
        self.graphs[g].replay()
        self.num_replays += 1
        if state is not None and state.save_rows.numel():  # each after the row's one token
            self.states.copy(state.slots[state.save_rows], state.save_slots)  # type: ignore[union-attr]
        return self.hidden[:b]
