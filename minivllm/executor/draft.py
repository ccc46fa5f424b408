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

Steps of step 2 replay CUDA graphs of the draft's own (``CudaGraphRunner``) on CUDA.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch

from minivllm.config import ModelConfig
from minivllm.executor.cuda_graph import CudaGraphRunner, default_capture_sizes
from minivllm.executor.device_batch import DeviceBatch, resolve_input_ids
from minivllm.executor.inputs import BatchInputs
from minivllm.model.decoder import DecoderForCausalLM
from minivllm.ops.metadata import AttentionMetadata

Upload = Callable[..., list[torch.Tensor]]


class DraftRunner:
    """The draft model, its K/V cache and its decode graphs.

    Args:
        model: the draft model, loaded, on the device.
        model_config: its shapes (its vocabulary is the target's: checked by the caller).
        kv_cache: its cache, (layers, 2, num_blocks, block_size, kv_heads, head_dim), the
            target's number of blocks.
        num_speculative_tokens: k.
        dtype: the draft's activations' dtype.
        prev_sampled: the executor's buffer of last-step samples (tokens fed by reference).
        max_num_seqs, max_blocks_per_seq: the batch limits (graph sizes).
        use_graphs: capture the decode steps.
    """

    def __init__(self, model: DecoderForCausalLM, model_config: ModelConfig, kv_cache: torch.Tensor,
                 num_speculative_tokens: int, dtype: torch.dtype, prev_sampled: torch.Tensor, max_num_seqs: int,
                 max_blocks_per_seq: int, use_graphs: bool) -> None:
        self.model = model
        self.model_config = model_config
        self.kv_cache = kv_cache
        self.k = num_speculative_tokens
        self.prev_sampled = prev_sampled
        self.device = kv_cache.device
        self.block_size = kv_cache.shape[3]
        self.graph_runner = None
        if use_graphs:
            self.graph_runner = CudaGraphRunner(
                model.forward, kv_cache, prev_sampled, model_config.hidden_size, dtype,
                max_blocks_per_seq, default_capture_sizes(max_num_seqs))

    @torch.inference_mode()
    def run(self, batch: DeviceBatch, inputs: BatchInputs, num_drafts: np.ndarray,
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
        token 0: the drafted rows' slots past their first are rewritten by ``_draft``)."""
        ids = resolve_input_ids(batch.input_ids.clamp(min=0), batch.prev_rows, self.prev_sampled)
        meta = dataclasses.replace(batch.attn_metadata, kv_cache=self.kv_cache, tile_map=None)
        self.model(ids, batch.positions, meta)

    def _draft(self, batch: DeviceBatch, inputs: BatchInputs, rows: np.ndarray, d: np.ndarray,
               upload: Upload) -> None:
        k, r = self.k, len(rows)
        first = inputs.cu_seqlens_q[rows].astype(np.int64)                    # the row's last known token
        start = inputs.kv_lens[rows].astype(np.int64) - 1 - d                # its position L
        j = np.minimum(np.arange(k + 1)[:, None], d[None, :])                # (k + 1, R): position L + j
        fed = first[None, :] + j                                             # index of the token fed
        slots = inputs.slot_mapping[fed]
        slots[np.arange(k + 1)[:, None] > d[None, :]] = -1                   # steps past d write nothing
        tables = inputs.block_tables[rows]
        into = np.concatenate([first[i] + 1 + np.arange(d[i]) for i in range(r)])   # the drafts' input ids
        made = np.concatenate([i * k + np.arange(d[i]) for i in range(r)])          # ... in drafts (R, k)
        steps = np.arange(k + 1)[:, None] <= d[None, :]                      # (k + 1, R): feeds a new token
        fed_t, pos_t, slots_t, kv_t, tables_t, into_t, made_t, new_t = upload(
            fed, start[None, :] + j, slots, start[None, :] + j + 1, tables, into, made, steps.astype(np.int64))
        tables_t = tables_t.to(torch.int32)
        kv_t = kv_t.to(torch.int32)
        drafts = torch.zeros(r, k, dtype=torch.int64, device=self.device)
        token = batch.input_ids[fed_t[0]]                                     # the rows' last known tokens
        cu = torch.arange(r + 1, dtype=torch.int32, device=self.device)
        no_refs = torch.full((r,), -1, dtype=torch.int64, device=self.device)
        for step in range(k + 1):
            meta = AttentionMetadata(slot_mapping=slots_t[step], cu_seqlens_q=cu, kv_lens=kv_t[step],
                                     block_tables=tables_t, max_q_len=1, is_decode=True, kv_cache=self.kv_cache)
            step_batch = DeviceBatch(input_ids=token, prev_rows=no_refs, positions=pos_t[step],
                                     sample_indices=cu[:r].long(), attn_metadata=meta, num_seqs=r,
                                     table_width=tables.shape[1])
            if self.graph_runner is not None and self.graph_runner.can_run(step_batch):
                hidden = self.graph_runner.run(step_batch)
            else:
                hidden = self.model(token, pos_t[step], meta)
            if step == k:
                break
            guess = self.model.compute_logits(hidden).argmax(dim=-1)
            drafts[:, step] = guess
            # A row past its d drafts feeds its step d again (no write): its token stays.
            token = torch.where(new_t[step + 1] > 0, guess, token)
        batch.input_ids[into_t] = drafts.view(-1)[made_t]


def draft_block_bytes(model_config: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one block of the draft's cache, over its layers (K and V)."""
    c = model_config
    return c.num_hidden_layers * 2 * block_size * c.num_key_value_heads * c.head_dim * torch.finfo(kv_dtype).bits // 8


def check_draft_config(draft: ModelConfig, target: ModelConfig, max_model_len: int) -> None:
    """A draft model must share the target's vocabulary and reach its context length.

    Raises:
        ValueError: naming the field that does not match.
    """
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model: the draft model's vocab_size {draft.vocab_size} is not "
                         f"the target's {target.vocab_size} (a draft model needs the target's vocabulary)")
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config.model: the draft model's max_position_embeddings "
                         f"{draft.max_position_embeddings} < max_model_len {max_model_len}")
