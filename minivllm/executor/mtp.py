"""A Qwen3.5 or Qwen3-Next model's own MTP head as the proposer (speculative decoding's ``method: "mtp"``,
``model/qwen3_5_mtp.py``), in the target's executor.

The head at position t reads the target's final hidden state h_t and token t + 1, and guesses
token t + 2. So a sequence whose known tokens end at position P (the row's first fed token)
drafts from h_{P-1}, which the previous step computed. That hidden state is kept as one more
part of the sequence's recurrent state: ``LinearStates.hidden`` holds, for every slot, snapshot
and draft entry, the hidden state of the last token before the state it holds. It is restored
with a snapshot (a prefix hit drafts as well as a miss), saved at the save points, and set back
to the kept tokens' with the rest of the state when drafts are rejected (``keep_accepted``).

The head's K/V lives in a cache of its own (one layer), indexed by the target's block tables as
a draft model's is (``executor/draft.py``): the entry at position t is the head's at t.

Every step, around the target's forward:

1. ``draft`` (before it), rows with d drafts: d forwards of the head, one token per row; forward
   j at position P - 1 + j feeds token P + j (the row's first fed token, then the drafts so far)
   with h_{P-1} from the slot, then the head's own output; its argmax is draft j + 1. The drafts
   go into the step's input ids, in place, for the target to score.
2. ``mirror`` (after it), every row: the head's K/V at the step's positions shifted one back
   (position t from h_t and token t + 1), h from this forward (and the slot's for the row's first
   token), which overwrites what the drafting wrote from the head's own outputs. K/V need the
   layer's input only, so this pass is the K/V half of the layer (``Qwen3_5MTP.store_kv``). A
   row starting from the zero state has no position P - 1: its first token writes nothing.
   K/V written from a draft that the target then rejects is rewritten before it is read, as the
   target's own is.
3. ``LinearStates.save_hidden``: the step's hidden states into the save points and slots.

On CUDA the drafting loop (1: k forwards of the head, the LM head and an argmax between them)
is one CUDA graph per batch size of drafted rows (``capture_graphs``), replayed from static
buffers as a draft model's loop is (``executor/draft.py``): rows past their own d drafts, and
padding rows, write nothing (slot -1). The target's drafted step replays its token bucket's
graph (``executor/prefill_graph.py``); 2 and 3 run eagerly.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch

from minivllm.engine.plan import StepPlan
from minivllm.engine.state_cache import STATE_RESET
from minivllm.executor.device_batch import DeviceBatch, resolve_input_ids
from minivllm.executor.draft import DraftLoop
from minivllm.executor.inputs import BatchInputs
from minivllm.executor.linear_state import LinearStates
from minivllm.model.qwen3_5 import Qwen3_5ForCausalLM
from minivllm.model.qwen3_5_mtp import Qwen3_5MTP
from minivllm.ops.metadata import AttentionMetadata

Upload = Callable[..., list[torch.Tensor]]


class MtpRunner(DraftLoop):
    """The MTP head's two passes over a step (module doc).

    Args:
        target: the target model, its head attached (``model.mtp``).
        kv_cache: the head's cache, (1, 2, num_blocks, block_size, kv_heads, head_dim).
        states: the target's state tensors, with ``hidden``.
        prev_sampled: the executor's buffer of last-step samples (tokens fed by reference).
        num_speculative_tokens: k, the forwards of the drafting loop.
        max_num_seqs, max_blocks_per_seq: the batch limits (the loop's static buffers).
        use_graphs: capture the loop for batches of up to ``MAX_GRAPH_ROWS`` drafted rows.
    """

    def __init__(self, target: Qwen3_5ForCausalLM, kv_cache: torch.Tensor, states: LinearStates,
                 prev_sampled: torch.Tensor, num_speculative_tokens: int, max_num_seqs: int,
                 max_blocks_per_seq: int, use_graphs: bool) -> None:
        assert isinstance(target.mtp, Qwen3_5MTP) and states.hidden is not None
        super().__init__(num_speculative_tokens, num_speculative_tokens, max_num_seqs, max_blocks_per_seq,
                         kv_cache.device)
        self.target, self.head = target, target.mtp
        self.kv_cache, self.states, self.prev_sampled = kv_cache, states, prev_sampled
        self.k = num_speculative_tokens
        # Beside the loop's inputs (``DraftLoop``): the state entry whose hidden state each row
        # drafts from.
        self.hidden_from = torch.zeros(max_num_seqs, dtype=torch.int64, device=kv_cache.device)
        if use_graphs:
            self._capture(max_num_seqs)

    def _loop(self, bs: int) -> None:
        """The k forwards of the head over the first ``bs`` rows (module doc, 1)."""
        token = self.first[:bs]
        hidden = self.states.hidden[self.hidden_from[:bs]]  # type: ignore[index]
        for step in range(self.k):
            meta = AttentionMetadata(slot_mapping=self.slots[step, :bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
                                     kv_lens=self.kv_lens[step, :bs], block_tables=self.tables[:bs], max_q_len=1,
                                     is_decode=True, kv_cache=self.kv_cache)
            hidden = self.head(token, self.positions[step, :bs], hidden, meta)
            token = self.target.compute_logits(hidden).argmax(dim=-1)
            self.drafts[:bs, step] = token

    @staticmethod
    def _slot_before(inputs: BatchInputs, rows: np.ndarray, block_size: int) -> np.ndarray:
        """The cache slot of position P - 1 for rows ``rows`` (P: the row's first fed position)."""
        before = inputs.positions[inputs.cu_seqlens_q[rows]].astype(np.int64) - 1
        blocks = inputs.block_tables[rows, np.maximum(before, 0) // block_size].astype(np.int64)
        return blocks * block_size + before % block_size

    @torch.inference_mode()
    def draft(self, plan: StepPlan, batch: DeviceBatch, inputs: BatchInputs, upload: Upload) -> None:
        """The drafts of the rows with ``plan.num_drafts`` > 0, into ``batch.input_ids`` (module doc, 1)."""
        if not len(plan.num_drafts):
            return
        rows = np.flatnonzero(plan.num_drafts)
        d = np.asarray(plan.num_drafts, dtype=np.int64)[rows]
        if (np.asarray(plan.state_init)[rows] == STATE_RESET).any():
            raise ValueError("a drafted row starts from the zero state: it has no hidden state to draft from")
        if int(d.max()) > self.k:
            raise ValueError(f"num_drafts up to {int(d.max())}, but the MTP loop makes {self.k}")
        k, r = self.k, len(rows)
        bs = self.padded_size(r)
        first = inputs.cu_seqlens_q[rows].astype(np.int64)                       # the row's token P
        start = inputs.positions[first].astype(np.int64)                          # P
        j = np.arange(k)[:, None]                                                 # (k, R): forward j
        # Forward j writes position P - 1 + j: for j >= 1 that is fed token j - 1's slot.
        slots = inputs.slot_mapping[np.minimum(first[None, :] + j - 1, len(inputs.slot_mapping) - 1)]
        slots[0] = self._slot_before(inputs, rows, plan.block_size)
        slots[j >= d[None, :]] = -1                                               # past the row's drafts
        into = np.concatenate([first[i] + 1 + np.arange(d[i]) for i in range(r)])  # the drafts' input ids
        made = np.concatenate([i * k + np.arange(d[i]) for i in range(r)])        # ... in (R, k) drafts
        pad = ((0, 0), (0, bs - r))
        tables = inputs.block_tables[rows]
        first_t, pos_t, slots_t, kv_t, tables_t, into_t, made_t, srows_t = upload(
            first, np.pad(start[None, :] - 1 + j, pad), np.pad(slots, pad, constant_values=-1),
            np.pad(start[None, :] + np.minimum(j, d[None, :]), pad),  # within its blocks
            tables, into, made, rows)
        self._stage(bs, resolve_input_ids(batch.input_ids[first_t], batch.prev_rows[first_t], self.prev_sampled),
                    pos_t, slots_t, kv_t, tables_t)
        self.hidden_from[:r].copy_(batch.attn_metadata.state.slots[srows_t])  # type: ignore[union-attr]
        self.hidden_from[r:bs].zero_()
        self._run(bs, batch, into_t, made_t)

    @torch.inference_mode()
    def mirror(self, plan: StepPlan, batch: DeviceBatch, inputs: BatchInputs, hidden: torch.Tensor,
               upload: Upload) -> None:
        """The head's K/V of the step's tokens from the target's ``hidden`` (T, H) (module doc, 2)."""
        cu = inputs.cu_seqlens_q.astype(np.int64)
        firsts = cu[:-1]
        slots = np.empty_like(inputs.slot_mapping)
        slots[1:] = inputs.slot_mapping[:-1]
        rows = np.arange(plan.num_seqs)
        fresh = (np.asarray(plan.state_init) == STATE_RESET) | (inputs.positions[firsts] == 0)
        slots[firsts] = np.where(fresh, -1, self._slot_before(inputs, rows, plan.block_size))
        slots_t, firsts_t = upload(slots, firsts)
        shifted = torch.empty_like(hidden)
        shifted[1:] = hidden[:-1]
        state = batch.attn_metadata.state
        assert state is not None
        shifted[firsts_t] = self.states.hidden[state.slots].to(hidden.dtype)  # type: ignore[index]
        meta = dataclasses.replace(batch.attn_metadata, slot_mapping=slots_t, kv_cache=self.kv_cache,
                                   tile_map=None, state=None)
        ids = resolve_input_ids(batch.input_ids, batch.prev_rows, self.prev_sampled)
        self.head.store_kv(ids, (batch.positions - 1).clamp(min=0), shifted, meta)
