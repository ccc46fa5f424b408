"""A hybrid model's recurrent states on the device: the executor's side of
``engine/state_cache.py``.

Every linear-attention layer's states live in ONE tensor pair of ``StateLayout.num_entries``
entries (``layers/linear_attention.py: allocate_linear_state``)::

    entries  | slots 0 .. S-1 | snapshots S .. S+P-1 | draft states S+P .. S+P+B*k-1 |
    conv_state       (num_linear_layers, entries, conv_dim, kernel - 1)   the model's dtype
    recurrent_state  (num_linear_layers, entries, H, K, V)                 float32

(with tensor parallelism, conv_dim and H are the rank's share: its heads), and with an MTP head
(``executor/mtp.py``) a third tensor, replicated over ranks::

    hidden           (entries, hidden_size)   the model's dtype: the target's final hidden state
                                              of the last token before the entry's state

so snapshot id i
is entry ``S + i``: restoring one into a slot, or saving a row's state into one, is an index
copy within the same tensors, every layer at once.

Per step (``StateInputs.from_plan``, host numpy, uploaded with the step's other indices):

- each row reads and writes its slot (``StepPlan.state_slots``); it starts from the zero state
  where ``state_init`` is ``STATE_RESET``, and from snapshot ``state_init`` where that is an id
  (copied into the slot before the forward, ``LinearStates.restore``);
- the plan's save points (``state_saves``) become the forward's save points
  (``StateMetadata.save_*``) into snapshot entries;
- a drafted row (1 + d tokens: its last token and d drafts) also saves its state after each
  of its first d tokens into its draft entries (batch row b owns ``S + P + b k ..``); once the
  accepted counts are known (on the device), ``LinearStates.keep_accepted`` copies the one
  after the kept tokens into the slot, which the forward left holding the state after all
  1 + d. Cost: d extra state writes per drafted row and layer, and B k entries of memory
  (B = max_num_seqs, k = num_speculative_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from minivllm.config import ModelConfig
from minivllm.engine.plan import StepPlan
from minivllm.engine.state_cache import STATE_RESET
from minivllm.layers.linear_attention import allocate_linear_state
from minivllm.ops.metadata import StateMetadata

# Snapshots per running sequence where memory does not decide (the CPU, or a given num_blocks).
SNAPSHOTS_PER_SEQ = 4
# Sized from free memory, snapshots take at most this share of what the slots leave.
SNAPSHOT_MEMORY_SHARE = 0.25
# The most bytes a copy between entries gathers at once (``LinearStates.copy``): at Qwen3.5-9B's
# shapes an entry is 48 MB, and 256 rows restored from snapshots in one step gathered 12 GiB,
# beyond what the pool sized from free memory leaves.
COPY_CHUNK_BYTES = 256 << 20


def state_bytes(config: ModelConfig, dtype: torch.dtype, tp_size: int = 1, hidden: bool = False) -> int:
    """Bytes of one state entry over every linear-attention layer on one of ``tp_size`` ranks
    (its heads; conv in ``dtype``, recurrent float32), and with ``hidden`` the MTP head's
    hidden state (``dtype``)."""
    width = torch.finfo(dtype).bits // 8
    conv = int(np.prod(config.conv_state_shape(1, tp_size))) * width
    return conv + int(np.prod(config.recurrent_state_shape(1, tp_size))) * 4 + hidden * config.hidden_size * width


@dataclass(frozen=True)
class StateLayout:
    """How the state tensors' entries are shared out (module doc).

    Attributes:
        num_slots: one per running sequence (``max_num_seqs``).
        num_snapshots: prefix-cache snapshots (``engine/state_cache.py``).
        max_drafts: drafts a row may carry (``num_speculative_tokens``; 0 without speculation).
    """

    num_slots: int
    num_snapshots: int
    max_drafts: int = 0

    def __post_init__(self) -> None:
        if self.num_slots < 1 or self.num_snapshots < 0 or self.max_drafts < 0:
            raise ValueError(f"state layout: num_slots >= 1, num_snapshots >= 0 and max_drafts >= 0, got "
                             f"{self.num_slots}, {self.num_snapshots}, {self.max_drafts}")

    @property
    def draft_base(self) -> int:
        """The first draft entry (after the slots and snapshots)."""
        return self.num_slots + self.num_snapshots

    @property
    def num_entries(self) -> int:
        """Slots, snapshots and the draft entries of ``num_slots`` rows."""
        return self.draft_base + self.num_slots * self.max_drafts


def _int64(values: list[int] | np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


@dataclass(frozen=True)
class StateInputs:
    """A hybrid step's state indices on the host, all int64 (see the module doc)."""

    slots: np.ndarray              # (B,) each row's slot
    has_initial_state: np.ndarray  # (B,) 1: continues (its slot, or the snapshot restored into it)
    save_rows: np.ndarray          # (N,) save points, ordered by (row, offset): row,
    save_offsets: np.ndarray       # (N,) after how many of its fed tokens,
    save_slots: np.ndarray         # (N,) into which entry
    save_bounds: np.ndarray        # (B + 1,) row b's save points are save_bounds[b] .. save_bounds[b + 1] - 1
    restore_from: np.ndarray       # (R,) snapshot entries copied before the forward
    restore_to: np.ndarray         # (R,) into these slots

    def arrays(self) -> list[np.ndarray]:
        """The arrays in upload order (``LinearStates.metadata`` takes them back in it)."""
        return [self.slots, self.has_initial_state, self.save_rows, self.save_offsets, self.save_slots,
                self.save_bounds, self.restore_from, self.restore_to]

    @staticmethod
    def from_plan(plan: StepPlan, layout: StateLayout) -> "StateInputs":
        """The plan's state fields as entries of ``layout``.

        Raises:
            ValueError: naming the field: no state slot per row, a slot or snapshot outside the
                pool, two rows on one slot, an unknown ``state_init``, a save point outside a
                row's known tokens, or more drafts than ``layout.max_drafts``.
        """
        b = plan.num_seqs
        if len(plan.state_slots) != b or len(plan.state_init) != b:
            raise ValueError(f"a plan for a hybrid model needs state_slots and state_init, one per row: "
                             f"got {len(plan.state_slots)} and {len(plan.state_init)} for {b} rows")
        slots, init = _int64(plan.state_slots), _int64(plan.state_init)
        if b and (slots.min() < 0 or slots.max() >= layout.num_slots or len(set(slots.tolist())) != b):
            raise ValueError(f"state_slots {slots.tolist()} are not distinct slots of the pool of {layout.num_slots}")
        if b and (init.min() < STATE_RESET or init.max() >= layout.num_snapshots):
            raise ValueError(f"state_init {init.tolist()} holds a value that is neither STATE_CONTINUE, "
                             f"STATE_RESET nor one of {layout.num_snapshots} snapshots")
        drafts = _int64(plan.num_drafts) if len(plan.num_drafts) else np.zeros(b, dtype=np.int64)
        rows, offsets, entries = _plan_saves(plan, layout, drafts)
        drafted = np.flatnonzero(drafts)
        if drafted.size and int(drafts.max()) > layout.max_drafts:
            raise ValueError(f"num_drafts up to {int(drafts.max())}, but the state pool holds draft states "
                             f"for {layout.max_drafts} (speculative_config.num_speculative_tokens)")
        # Drafted row r saves after its first j tokens, j = 1 .. d, into draft entry j - 1 of its own.
        d = drafts[drafted]
        j = np.arange(d.sum(), dtype=np.int64) - np.repeat(np.cumsum(d) - d, d)  # 0 .. d - 1 per row
        row_of = np.repeat(drafted, d)
        restoring = np.flatnonzero(init >= 0)
        rows, offsets = np.concatenate([rows, row_of]), np.concatenate([offsets, j + 1])
        entries = np.concatenate([entries, layout.draft_base + row_of * layout.max_drafts + j])
        order = np.lexsort((offsets, rows))
        rows = rows[order]
        return StateInputs(
            slots=slots, has_initial_state=(init != STATE_RESET).astype(np.int64),
            save_rows=rows, save_offsets=offsets[order], save_slots=entries[order],
            save_bounds=np.searchsorted(rows, np.arange(b + 1)).astype(np.int64),
            restore_from=layout.num_slots + init[restoring], restore_to=slots[restoring])


def _plan_saves(plan: StepPlan, layout: StateLayout, drafts: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The plan's snapshot saves as (rows, offsets, entries), checked against each row's known tokens."""
    if not plan.state_saves:
        return _int64([]), _int64([]), _int64([])
    if len(plan.state_saves) != plan.num_seqs:
        raise ValueError(f"state_saves has {len(plan.state_saves)} entries for {plan.num_seqs} rows")
    rows, offsets, snaps = [], [], []
    for r, pairs in enumerate(plan.state_saves):
        known = int(plan.query_lens[r]) - int(drafts[r])
        for offset, snap in pairs:
            if not 1 <= offset <= known or not 0 <= snap < layout.num_snapshots:
                raise ValueError(f"state_saves: snapshot {snap} after {offset} of row {r}'s {known} known fed "
                                 f"tokens (snapshots: {layout.num_snapshots})")
            rows.append(r)
            offsets.append(offset)
            snaps.append(snap)
    return _int64(rows), _int64(offsets), layout.num_slots + _int64(snaps)


class LinearStates:
    """The state tensors of a ``StateLayout`` (module doc), and the copies between their entries.

    Args:
        config: the hybrid model's shapes.
        layout: how many slots, snapshots and draft entries.
        dtype: the conv state's dtype (the model's); the recurrent state is float32.
        device: where they live.
        tp_size: the ranks the heads are split over; the tensors hold one rank's heads.
    """

    def __init__(self, config: ModelConfig, layout: StateLayout, dtype: torch.dtype,
                 device: torch.device, tp_size: int = 1, hidden: bool = False) -> None:
        self.layout = layout
        self.conv_state, self.recurrent_state = allocate_linear_state(config, layout.num_entries, dtype, device,
                                                                      tp_size)
        self.hidden = (torch.zeros(layout.num_entries, config.hidden_size, dtype=dtype, device=device)
                       if hidden else None)
        self._tensors = [t for t in (self.conv_state, self.recurrent_state, self.hidden) if t is not None]
        self.entry_bytes = sum(t.nbytes // layout.num_entries for t in self._tensors)   # ``state_bytes``

    def metadata(self, uploaded: list[torch.Tensor]) -> StateMetadata:
        """The step's ``StateMetadata`` from ``StateInputs.arrays()`` on the device (same order),
        after the restores are copied into their slots (before the forward reads them)."""
        slots, has_init, save_rows, save_offsets, save_slots, save_bounds, restore_from, restore_to = uploaded
        if restore_from.numel():
            self.copy(restore_from, restore_to)
        return StateMetadata(slots=slots, has_initial_state=has_init.bool(), conv_state=self.conv_state,
                             recurrent_state=self.recurrent_state, save_rows=save_rows,
                             save_offsets=save_offsets, save_slots=save_slots, save_bounds=save_bounds)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Entries ``src`` (R,) into entries ``dst`` (R,), every layer, every tensor: a gather
        and a scatter each, over at most ``COPY_CHUNK_BYTES`` of entries at a time. ``dst``
        distinct; an entry may be its own source, but no other row's destination."""
        rows = max(1, COPY_CHUNK_BYTES // max(self.entry_bytes, 1))
        for start in range(0, src.shape[0], rows):
            src_c, dst_c = src[start:start + rows], dst[start:start + rows]
            for t in self._tensors:
                dim = 0 if t is self.hidden else 1
                t.index_copy_(dim, dst_c, t.index_select(dim, src_c))

    def save_hidden(self, hidden: torch.Tensor, state: StateMetadata, cu_seqlens_q: torch.Tensor) -> None:
        """With ``hidden`` kept (an MTP head): the step's final hidden states (T, H) into the
        entries its state went to, each the hidden state of the entry's last token: the save
        points' (``state.save_*``) and each row's slot (its last fed token)."""
        if self.hidden is None:
            return
        starts = cu_seqlens_q.to(torch.int64)
        if state.save_rows.numel():
            self.hidden[state.save_slots] = hidden[starts[state.save_rows] + state.save_offsets - 1].to(self.hidden.dtype)
        self.hidden[state.slots] = hidden[starts[1:] - 1].to(self.hidden.dtype)

    def keep_accepted(self, plan: StepPlan, accepted: torch.Tensor,
                      upload: Callable[..., list[torch.Tensor]]) -> None:
        """After a drafted step's verification: each drafted row's slot holds the state after its
        last token and its accepted drafts. The forward left it after all 1 + d tokens, right
        when every draft is kept; else draft entry a (the state after 1 + a tokens) is copied in.
        ``accepted``: (S,) per sampling row, on the device (no host sync); ``upload``: host
        int64 arrays -> device tensors, one copy."""
        drafted = np.flatnonzero(plan.num_drafts)
        sampling_row = (np.cumsum(plan.sample) - 1)[drafted]
        assert bool(plan.sample[drafted].all()), "a drafted row samples"
        own = self.layout.draft_base + drafted * self.layout.max_drafts
        rows_t, own_t, d_t, slots_t = upload(sampling_row.astype(np.int64), own.astype(np.int64),
                                             _int64(plan.num_drafts[drafted]), _int64(plan.state_slots[drafted]))
        a = accepted[rows_t]
        self.copy(torch.where(a < d_t, own_t + a, slots_t), slots_t)


def check_no_state_fields(plan: StepPlan) -> None:
    """A plan for a model without recurrent state carries none of the state fields.

    Raises:
        ValueError: naming the field the plan carries.
    """
    for name in ("state_slots", "state_init", "state_saves"):
        if len(getattr(plan, name)):
            raise ValueError(f"plan carries {name} for a model without recurrent state")

