"""What the attention ops read each step, built by the executor and passed to every forward
as an explicit argument (no forward context)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _no_saves() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True)
class StateMetadata:
    """The linear-attention state of one step (hybrid models): every sequence's state slot.

    A Gated DeltaNet layer reads each sequence's conv and recurrent state at its slot (zeros
    where ``has_initial_state`` is False) and writes back, in place, the state after the
    sequence's last token fed this step; at each save point it also writes the state after a
    sequence's first ``offset`` tokens into another entry (a prefix-cache snapshot, or a
    drafted row's per-position scratch: ``executor/model_executor.py``). Layer ``l`` of the
    state tensors is the model's ``l``-th linear-attention layer (``ModelConfig.kind_index``);
    their shapes are ``ModelConfig.conv_state_shape`` / ``recurrent_state_shape`` (this rank's
    heads under tensor parallelism) of all
    entries (the executor's slots first, then its snapshots and scratch).
    """

    # int64 (B,): the state entry of each of the step's B sequences (distinct).
    slots: torch.Tensor
    # bool (B,): False: the sequence starts from zero state (its first chunk: whatever the slot
    # holds is ignored); True: it continues from the state in its slot.
    has_initial_state: torch.Tensor
    # (num_linear_layers, num_slots, conv_dim, kernel_size - 1), the model's dtype: the last
    # kernel_size - 1 conv inputs (q, k, v channels) of each slot, oldest first.
    conv_state: torch.Tensor
    # float32 (num_linear_layers, num_slots, num_v_heads, head_k_dim, head_v_dim): each slot's
    # delta-rule state per value head.
    recurrent_state: torch.Tensor
    # int64 (N,) each, empty when none: save point i writes sequence save_rows[i]'s state after
    # its first save_offsets[i] fed tokens (1 .. its tokens) into entry save_slots[i] (no
    # sequence of the step owns it).
    save_rows: torch.Tensor = field(default_factory=_no_saves)
    save_offsets: torch.Tensor = field(default_factory=_no_saves)
    save_slots: torch.Tensor = field(default_factory=_no_saves)
    # int64 (B + 1,) or None: the save points are ordered by (row, offset) and sequence b's are
    # save_bounds[b] .. save_bounds[b + 1] - 1 (entries past save_bounds[B] unused: a CUDA graph's
    # padding); the kernels then visit each sequence's own only. None: in any order.
    save_bounds: torch.Tensor | None = None

    def __post_init__(self) -> None:
        """Shapes and dtypes (host-side metadata only: nothing here syncs a device).

        Raises:
            ValueError: naming the field that breaks the layout above.
        """
        if self.slots.dtype != torch.int64 or self.slots.dim() != 1:
            raise ValueError(f"slots must be int64 (B,), got {self.slots.dtype} {tuple(self.slots.shape)}")
        if self.has_initial_state.dtype != torch.bool or self.has_initial_state.shape != self.slots.shape:
            raise ValueError(f"has_initial_state must be bool {tuple(self.slots.shape)}, got "
                             f"{self.has_initial_state.dtype} {tuple(self.has_initial_state.shape)}")
        for name in ("save_rows", "save_offsets", "save_slots"):
            t = getattr(self, name)
            if t.dtype != torch.int64 or t.dim() != 1 or t.shape != self.save_rows.shape:
                raise ValueError(f"{name} must be int64 (N,) like save_rows {tuple(self.save_rows.shape)}, "
                                 f"got {t.dtype} {tuple(t.shape)}")
        if self.save_bounds is not None and (self.save_bounds.dtype != torch.int64
                                             or self.save_bounds.shape != (self.slots.shape[0] + 1,)):
            raise ValueError(f"save_bounds must be int64 ({self.slots.shape[0] + 1},), got "
                             f"{self.save_bounds.dtype} {tuple(self.save_bounds.shape)}")
        if self.conv_state.dim() != 4:
            raise ValueError(f"conv_state must be (layers, slots, conv_dim, kernel - 1), "
                             f"got {tuple(self.conv_state.shape)}")
        if self.recurrent_state.dtype != torch.float32 or self.recurrent_state.dim() != 5 \
                or self.recurrent_state.shape[:2] != self.conv_state.shape[:2]:
            raise ValueError(f"recurrent_state must be float32 (layers, slots, heads, k_dim, v_dim) with conv_state's "
                             f"{tuple(self.conv_state.shape[:2])}, got {self.recurrent_state.dtype} "
                             f"{tuple(self.recurrent_state.shape)}")


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one step, on the model's device.

    B sequences feed T tokens (shapes as in ``minivllm/executor/inputs.py``).
    """

    # int64 (T,): cache slot of each fed token (-1 = write nothing).
    slot_mapping: torch.Tensor
    # int32 (B+1,): prefix sums of the tokens fed per sequence.
    cu_seqlens_q: torch.Tensor
    # int32 (B,): keys each sequence attends to (cached + fed).
    kv_lens: torch.Tensor
    # int32 (B, W): block ids per sequence, -1 padded.
    block_tables: torch.Tensor
    # Most tokens fed by one sequence (a host int: kernels size their grid by it).
    max_q_len: int
    # Every sequence feeds exactly one token (T == B): the decode kernel applies.
    is_decode: bool
    # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim): all layers' K/V (a hybrid
    # model's full-attention layers at their index among them, ``ModelConfig.kind_index``).
    kv_cache: torch.Tensor
    # int32 (capacity, 2): the prefill kernel's work list (its map mode: a grid that does not
    # depend on the batch, for CUDA graphs of prefill steps); None: the grid from max_q_len.
    tile_map: torch.Tensor | None = None
    # Hybrid models: the linear-attention layers' state slots; None for a model without them.
    state: StateMetadata | None = None
