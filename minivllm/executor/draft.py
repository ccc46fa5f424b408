"""A draft model beside the target, in the target's executor (speculative decoding's
``method: "draft_model"``, ``spec/draft_model.py``).

Its K/V lives in a cache of its own, indexed by the target's block tables: whatever
position the target holds K/V for, the draft holds its own in the same slot. So
prefix-cache hits, preemption and rollback need nothing of it: a block is the
target's and the draft's at once, and a rejected draft's slot is rewritten before it
is read, by both models alike.

Every step (``DraftRunner.run``, before the target's forward):

1. Rows without drafts (prefill chunks, plain decodes): the draft runs over the step's
   tokens (``mirror``), writing its K/V where the target writes its own.
2. Rows with d drafts (their tokens are ``DRAFT_ON_DEVICE`` placeholders), k + 1
   decode-shaped steps: step j feeds the token at position L + j (L: the row's last
   known token, then the drafts made so far), writes its K/V there and, for j < d,
   takes the argmax as draft j + 1 (greedy drafting: the target's rejection sampling
   treats each draft as certain, which keeps the target's distribution exactly). Step
   d writes the last draft's K/V, which stands if the target keeps them all; a row's
   steps past d repeat step d without writing.
3. The drafts go into the step's input ids, in place, for the target to score.

On CUDA the whole of step 2, k + 1 forwards with the argmaxes between them, is one CUDA
graph per batch size (``capture_graphs``), replayed from static buffers.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Callable

import numpy as np
import torch

from minivllm.config import ModelConfig
from minivllm.executor.cuda_graph import CudaGraphRunner, capture_graphs, default_capture_sizes
from minivllm.executor.device_batch import DeviceBatch, resolve_input_ids
from minivllm.executor.inputs import BatchInputs
from minivllm.model.decoder import DecoderForCausalLM
from minivllm.ops.metadata import AttentionMetadata

Upload = Callable[..., list[torch.Tensor]]
# Most drafted rows whose drafting loop replays a CUDA graph (one graph per captured batch size
# up to it, each k + 1 forwards of the draft); more run it eagerly.
MAX_GRAPH_ROWS = 64


class DraftLoop:
    """A drafting loop's static buffers and CUDA graphs (a draft model's, ``DraftRunner``; the
    MTP head's, ``executor/mtp.py``): ``steps`` decode-shaped forwards over up to
    ``max_num_seqs`` rows, inputs (forward, row): the token fed first, each forward's position,
    slot (-1: no write) and kv_len, the rows' block tables; output: the drafts (row, draft).
    A batch of r drafted rows runs padded to the next captured size (the padding rows write
    nothing), replaying its graph; ``_loop(bs)`` is the loop itself."""

    def __init__(self, steps: int, num_drafts: int, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device) -> None:
        g, dev = max_num_seqs, device
        self.first = torch.zeros(g, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(steps, g, dtype=torch.int64, device=dev)
        self.slots = torch.full((steps, g), -1, dtype=torch.int64, device=dev)
        self.kv_lens = torch.zeros(steps, g, dtype=torch.int32, device=dev)
        self.tables = torch.full((g, max_blocks_per_seq), -1, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(g + 1, dtype=torch.int32, device=dev)
        self.drafts = torch.zeros(g, max(num_drafts, 1), dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.sizes: list[int] = []  # batch sizes the loop pads to (and with graphs replays)
        self.num_replays = 0

    def _loop(self, bs: int) -> None:
        raise NotImplementedError

    def _capture(self, max_num_seqs: int) -> None:
        self.sizes = [b for b in default_capture_sizes(max_num_seqs) if b <= MAX_GRAPH_ROWS]
        self.graphs = capture_graphs(self.sizes, self._loop)  # padding rows only: nothing written

    def padded_size(self, rows: int) -> int:
        """The batch size ``rows`` drafted rows run at."""
        return self.sizes[bisect.bisect_left(self.sizes, rows)] if self.sizes and rows <= self.sizes[-1] else rows

    def _stage(self, bs: int, first: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               kv_lens: torch.Tensor, tables: torch.Tensor) -> None:
        """The loop's inputs for ``first.shape[0]`` rows padded to ``bs`` (``positions``,
        ``slots``, ``kv_lens`` (steps, bs) already padded; ``tables`` (r, W') unpadded)."""
        r = first.shape[0]
        self.first[:r].copy_(first)
        self.first[r:bs].zero_()
        self.positions[:, :bs].copy_(positions)
        self.slots[:, :bs].copy_(slots)
        self.kv_lens[:, :bs].copy_(kv_lens)
        self.tables[:bs].fill_(-1)
        self.tables[:r, :tables.shape[1]].copy_(tables)

    def _run(self, bs: int, batch: DeviceBatch, into: torch.Tensor, made: torch.Tensor) -> None:
        """Replay (or run) the loop at ``bs`` and put drafts ``made`` (flat indices of
        ``drafts``) into the step's input ids at ``into``."""
        if bs in self.graphs:
            self.graphs[bs].replay()
            self.num_replays += 1
        else:
            self._loop(bs)
        batch.input_ids[into] = self.drafts.view(-1)[made]


class DraftRunner(DraftLoop):
    """The draft model, its K/V cache and the drafting loop (on CUDA one graph per batch size).

    Args:
        model: the draft model, loaded, on the device.
        model_config: its shapes (its vocabulary is the target's: checked by the caller).
        kv_cache: its cache, (layers, 2, num_blocks, block_size, kv_heads, head_dim), the
            target's number of blocks.
        num_speculative_tokens: k.
        dtype: the draft's activations' dtype.
        prev_sampled: the executor's buffer of last-step samples (tokens fed by reference).
        max_num_seqs, max_blocks_per_seq: the batch limits (the loop's static buffers).
        use_graphs: capture the loop for batches of up to ``MAX_GRAPH_ROWS`` drafted rows.
    """

    def __init__(self, model: DecoderForCausalLM, model_config: ModelConfig, kv_cache: torch.Tensor,
                 num_speculative_tokens: int, dtype: torch.dtype, prev_sampled: torch.Tensor, max_num_seqs: int,
                 max_blocks_per_seq: int, use_graphs: bool) -> None:
        super().__init__(num_speculative_tokens + 1, num_speculative_tokens, max_num_seqs, max_blocks_per_seq,
                         kv_cache.device)
        self.model = model
        self.model_config = model_config
        self.kv_cache = kv_cache
        self.k = k = num_speculative_tokens
        self.prev_sampled = prev_sampled
        self.width = max_blocks_per_seq
        # Beside the loop's inputs (``DraftLoop``): whether a step feeds the draft just made.
        self.feeds_new = torch.zeros(k + 1, max_num_seqs, dtype=torch.bool, device=kv_cache.device)
        # Decode steps without drafts (the draft's cache keeping up) replay graphs too.
        self.decode_graphs: CudaGraphRunner | None = None
        if use_graphs:
            self._capture(max_num_seqs)
            self.decode_graphs = CudaGraphRunner(model.forward, kv_cache, prev_sampled, model_config.hidden_size,
                                                 dtype, max_blocks_per_seq, default_capture_sizes(max_num_seqs))

    def _loop(self, bs: int) -> None:
        """k + 1 decode-shaped steps of the first ``bs`` rows (module docstring, 2.)."""
        token = self.first[:bs]
        for step in range(self.k + 1):
            meta = AttentionMetadata(slot_mapping=self.slots[step, :bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
                                     kv_lens=self.kv_lens[step, :bs], block_tables=self.tables[:bs], max_q_len=1,
                                     is_decode=True, kv_cache=self.kv_cache)
            hidden = self.model(token, self.positions[step, :bs], meta)
            if step == self.k:
                break
            guess = self.model.compute_logits(hidden).argmax(dim=-1)
            self.drafts[:bs, step] = guess
            token = torch.where(self.feeds_new[step + 1, :bs], guess, token)

    @torch.inference_mode()
    def run(self, batch: DeviceBatch, inputs: BatchInputs, num_drafts: np.ndarray | tuple[()],
            upload: Upload) -> None:
        """Keep the draft's cache up with the step's tokens and make the drafts of the rows
        with ``num_drafts`` (B,) > 0, written into ``batch.input_ids`` in place (module
        docstring). ``upload``: host int64 arrays -> device tensors, one copy."""
        rows = np.flatnonzero(num_drafts) if len(num_drafts) else np.zeros(0, dtype=np.int64)
        if len(rows) < len(inputs.kv_lens):
            self.mirror(batch)
        if len(rows):
            self._draft(batch, inputs, rows, np.asarray(num_drafts, dtype=np.int64)[rows], upload)

    def mirror(self, batch: DeviceBatch) -> None:
        """The draft over every token of the step, writing its K/V (drafts' placeholders as
        token 0: the drafted rows' slots past their first are rewritten by ``_draft``); a decode
        step replays the draft's decode graph."""
        if self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            self.decode_graphs.run(batch)
            return
        ids = resolve_input_ids(batch.input_ids.clamp(min=0), batch.prev_rows, self.prev_sampled)
        meta = dataclasses.replace(batch.attn_metadata, kv_cache=self.kv_cache, tile_map=None)
        self.model(ids, batch.positions, meta)

    def _draft(self, batch: DeviceBatch, inputs: BatchInputs, rows: np.ndarray, d: np.ndarray,
               upload: Upload) -> None:
        k, r = self.k, len(rows)
        bs = self.padded_size(r)
        first = inputs.cu_seqlens_q[rows].astype(np.int64)                   # the row's last known token
        start = inputs.kv_lens[rows].astype(np.int64) - 1 - d               # its position L
        j = np.minimum(np.arange(k + 1)[:, None], d[None, :])               # (k + 1, R): position L + j
        slots = inputs.slot_mapping[first[None, :] + j]
        slots[np.arange(k + 1)[:, None] > d[None, :]] = -1                  # steps past d write nothing
        pad = ((0, 0), (0, bs - r))
        tables = inputs.block_tables[rows]
        into = np.concatenate([first[i] + 1 + np.arange(d[i]) for i in range(r)])    # the drafts' input ids
        made = np.concatenate([i * self.drafts.shape[1] + np.arange(d[i]) for i in range(r)])  # ... in drafts
        first_t, pos_t, slots_t, kv_t, new_t, tables_t, into_t, made_t = upload(
            first, np.pad(start[None, :] + j, pad), np.pad(slots, pad, constant_values=-1),
            np.pad(start[None, :] + j + 1, pad), np.pad(np.arange(k + 1)[:, None] <= d[None, :], pad),
            tables, into, made)
        self._stage(bs, batch.input_ids[first_t], pos_t, slots_t, kv_t, tables_t)
        self.feeds_new[:, :bs].copy_(new_t)
        self._run(bs, batch, into_t, made_t)


def check_draft_config(draft: ModelConfig, target: ModelConfig, max_model_len: int) -> None:
    """A draft model must share the target's vocabulary, reach its context length and be
    attention-only.

    Raises:
        ValueError: naming the field that does not match.
    """
    if draft.is_hybrid:
        raise ValueError(f"speculative_config.model: the draft model {draft.architecture} has linear-attention "
                         "layers (recurrent state), which a draft model does not keep")
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model: the draft model's vocab_size {draft.vocab_size} is not "
                         f"the target's {target.vocab_size} (a draft model needs the target's vocabulary)")
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config.model: the draft model's max_position_embeddings "
                         f"{draft.max_position_embeddings} < max_model_len {max_model_len}")
