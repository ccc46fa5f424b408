"""A Qwen3.5 model's own MTP head as the proposer (speculative decoding's ``method: "mtp"``,
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

All three run eagerly (no CUDA graph yet).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch

from minivllm.engine.plan import StepPlan
from minivllm.engine.state_cache import STATE_RESET
from minivllm.executor.device_batch import DeviceBatch, resolve_input_ids
from minivllm.executor.inputs import BatchInputs
from minivllm.executor.linear_state import LinearStates
from minivllm.model.qwen3_5 import Qwen3_5ForCausalLM
from minivllm.model.qwen3_5_mtp import Qwen3_5MTP
from minivllm.ops.metadata import AttentionMetadata

Upload = Callable[..., list[torch.Tensor]]


class MtpRunner:
    """The MTP head's two passes over a step (module doc).

    Args:
        target: the target model, its head attached (``model.mtp``).
        kv_cache: the head's cache, (1, 2, num_blocks, block_size, kv_heads, head_dim).
        states: the target's state tensors, with ``hidden``.
        prev_sampled: the executor's buffer of last-step samples (tokens fed by reference).
    """

    def __init__(self, target: Qwen3_5ForCausalLM, kv_cache: torch.Tensor, states: LinearStates,
                 prev_sampled: torch.Tensor) -> None:
        assert isinstance(target.mtp, Qwen3_5MTP) and states.hidden is not None
        self.target, self.head = target, target.mtp
        self.kv_cache, self.states, self.prev_sampled = kv_cache, states, prev_sampled

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
        k, r, bs = int(d.max()), len(rows), plan.block_size
        first = inputs.cu_seqlens_q[rows].astype(np.int64)                       # the row's token P
        start = inputs.positions[first].astype(np.int64)                          # P
        j = np.arange(k)[:, None]                                                 # (k, R): forward j
        # Forward j writes position P - 1 + j: for j >= 1 that is fed token j - 1's slot.
        slots = inputs.slot_mapping[np.minimum(first[None, :] + j - 1, len(inputs.slot_mapping) - 1)]
        slots[0] = self._slot_before(inputs, rows, bs)
        slots[j >= d[None, :]] = -1                                               # past the row's drafts
        into = np.concatenate([first[i] + 1 + np.arange(d[i]) for i in range(r)])  # the drafts' input ids
        made = np.concatenate([i * k + np.arange(d[i]) for i in range(r)])        # ... in (R, k) drafts
        first_t, pos_t, slots_t, kv_t, tables_t, into_t, made_t, srows_t = upload(
            first, start[None, :] - 1 + j, slots, start[None, :] + np.minimum(j, d[None, :]),  # within its blocks
            inputs.block_tables[rows], into, made, rows)
        token = resolve_input_ids(batch.input_ids[first_t], batch.prev_rows[first_t], self.prev_sampled)
        hidden = self.states.hidden[batch.attn_metadata.state.slots[srows_t]]  # type: ignore[index,union-attr]
        cu = torch.arange(r + 1, dtype=torch.int32, device=token.device)
        drafts = torch.zeros(r, k, dtype=torch.int64, device=token.device)
        for step in range(k):
            meta = AttentionMetadata(slot_mapping=slots_t[step], cu_seqlens_q=cu, kv_lens=kv_t[step].to(torch.int32),
                                     block_tables=tables_t.to(torch.int32), max_q_len=1, is_decode=True,
                                     kv_cache=self.kv_cache)
            hidden = self.head(token, pos_t[step], hidden, meta)
            token = self.target.compute_logits(hidden).argmax(dim=-1)
            drafts[:, step] = token
        batch.input_ids[into_t] = drafts.view(-1)[made_t]

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
