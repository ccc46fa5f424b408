"""The Gated DeltaNet's causal depthwise conv over B sequences' concatenated tokens (varlen),
each sequence continuing from the conv state in its slot (its last K - 1 inputs), which is
rewritten in place, and writing the state at its save points into other entries.

One program per (sequence, tile of BLOCK_C channels). Token t of a sequence starting at row
``start`` reads the K inputs ending at it, each from x when its row is in the sequence and
from the slot's old state before that (zeros for a fresh start)::

    input(r) = x[r]                                  r >= start
             = state[slot, :, K - 1 + (r - start)]   start - (K - 1) <= r < start
    out[t]   = silu(sum_j weight[:, j] * input(t - (K - 1) + j))     float32 accumulation

A state "after o tokens" is ``input(start + o - (K - 1) .. start + o - 1)``: the program
writes the save points' and then the slot's (o = the sequence's length) after all its reads
of the old state, so no other program reads what it overwrites.

Torch reference: :func:`minivllm.kernels.linear_attention_reference.causal_conv1d_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, check_same_device, check_state_step_args, next_pow2
from minivllm.kernels.gated_delta_rule_recurrent import save_ranges

MAX_KERNEL = 8


@triton.jit
def _inputs_before(x_ptr, state_ptr, start, upto, slot, fresh, offs_c, offs_j, mc, stride_x, C,
                   K: tl.constexpr):
    """(BLOCK_C, BLOCK_K) float32: column j < K - 1 holds input(upto - (K - 1) + j); zeros beyond."""
    r = upto - (K - 1) + offs_j                                                     # (BLOCK_K,)
    in_x = (r >= start) & (offs_j < K - 1)
    in_state = (r < start) & (offs_j < K - 1)
    col = K - 1 + (r - start)
    from_x = tl.load(x_ptr + r[None, :].to(tl.int64) * stride_x + offs_c[:, None],
                     mask=mc[:, None] & in_x[None, :], other=0.0).to(tl.float32)
    from_state = tl.load(state_ptr + (slot * C + offs_c[:, None]) * (K - 1) + col[None, :],
                         mask=mc[:, None] & in_state[None, :], other=0.0).to(tl.float32)
    from_state = tl.where(fresh != 0, 0.0, from_state)  # a fresh start: zeros, whatever the slot held
    return tl.where(in_x[None, :], from_x, from_state)


@triton.jit
def _causal_conv1d_kernel(
    x_ptr,                        # (T, C) rows strided by stride_x
    weight_ptr,                   # (C, K) contiguous
    state_ptr,                    # (num_entries, C, K - 1) contiguous, in place
    cu_ptr,                       # (B + 1,) int32 or int64 row offsets
    slots_ptr, init_ptr,          # (B,) int64 slot; (B,) bool as int8: 0 = start from zeros
    save_bounds_ptr,              # (B + 1,) int64: sequence b's save points are bounds[b] .. bounds[b + 1] - 1
    save_offsets_ptr, save_slots_ptr,   # (N,) int64
    out_ptr,                      # (T, C) contiguous
    stride_x, C,
    K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SAVES: tl.constexpr,
):
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_j = tl.arange(0, BLOCK_K)
    mc = offs_c < C
    start = tl.load(cu_ptr + b).to(tl.int64)
    end = tl.load(cu_ptr + b + 1).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    fresh = (tl.load(init_ptr + b) == 0).to(tl.int8)
    # slot -1: a graph's padding row, run from zeros (reads entry 0, unused), writing no state
    mc_state = mc & (offs_c * 0 + slot >= 0)
    fresh = tl.where(slot >= 0, fresh, 1)
    slot = tl.maximum(slot, 0)
    w = tl.load(weight_ptr + offs_c[:, None] * K + offs_j[None, :], mask=mc[:, None] & (offs_j[None, :] < K),
                other=0.0).to(tl.float32)                                            # (BLOCK_C, BLOCK_K)
    for t in range(start, end):
        window = _inputs_before(x_ptr, state_ptr, start, t, slot, fresh, offs_c, offs_j, mc, stride_x, C, K)
        x = tl.load(x_ptr + t * stride_x + offs_c, mask=mc, other=0.0).to(tl.float32)
        window = tl.where(offs_j[None, :] == K - 1, x[:, None], window)
        y = tl.sum(w * window, axis=1)
        y = y / (1.0 + tl.exp(-y))
        tl.store(out_ptr + t * C + offs_c, y.to(out_ptr.dtype.element_ty), mask=mc)
    keep = mc_state[:, None] & (offs_j[None, :] < K - 1)
    if HAS_SAVES:
        for i in range(tl.load(save_bounds_ptr + b), tl.load(save_bounds_ptr + b + 1)):
            saved = _inputs_before(x_ptr, state_ptr, start, start + tl.load(save_offsets_ptr + i), slot, fresh,
                                   offs_c, offs_j, mc, stride_x, C, K)
            entry = tl.load(save_slots_ptr + i)
            tl.store(state_ptr + (entry * C + offs_c[:, None]) * (K - 1) + offs_j[None, :],
                     saved.to(state_ptr.dtype.element_ty), mask=keep)
    last = _inputs_before(x_ptr, state_ptr, start, end, slot, fresh, offs_c, offs_j, mc, stride_x, C, K)
    tl.store(state_ptr + (slot * C + offs_c[:, None]) * (K - 1) + offs_j[None, :],
             last.to(state_ptr.dtype.element_ty), mask=keep)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
                  slots: torch.Tensor, has_initial_state: torch.Tensor, save_rows: torch.Tensor | None = None,
                  save_offsets: torch.Tensor | None = None, save_slots: torch.Tensor | None = None, *,
                  save_bounds: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU of each channel's causal conv over every sequence; ``conv_state`` rewritten in
    place at ``slots`` and written at the save points. Nothing here syncs the host.

    Args:
        x: (T, C), channels contiguous (rows may be strided).
        weight: (C, K) contiguous, 2 <= K <= ``MAX_KERNEL``.
        conv_state: (num_entries, C, K - 1) contiguous.
        cu_seqlens: (B + 1,) int32 or int64 row offsets of the B sequences.
        slots: (B,) int64 entries of ``conv_state``, distinct; -1: a padding row (of a CUDA graph),
            run from zeros, its state written nowhere.
        has_initial_state: (B,) bool; False starts that sequence from zeros.
        save_rows, save_offsets, save_slots: (N,) each, or None: save point i writes sequence
            save_rows[i]'s state after its first save_offsets[i] tokens into entry save_slots[i],
            which no sequence of the step owns.
        save_bounds: (B + 1,) int64, or None: as
            :func:`~minivllm.kernels.gated_delta_rule_recurrent.gated_delta_rule_recurrent`'s.

    Returns:
        (T, C) in x's dtype.

    Raises:
        TypeError: non-float tensors, or index dtypes other than ``check_state_step_args``'s.
        ValueError: shapes that disagree, a kernel width outside 2 .. ``MAX_KERNEL``,
            strided channels, or tensors on different devices.
    """
    t, c = x.shape
    nseq = slots.shape[0]
    if weight.dim() != 2 or weight.shape[0] != c or not 2 <= weight.shape[1] <= MAX_KERNEL:
        raise ValueError(f"weight must be ({c}, K) with 2 <= K <= {MAX_KERNEL}, got {tuple(weight.shape)}")
    k = weight.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[1:] != (c, k - 1) or not conv_state.is_contiguous():
        raise ValueError(f"conv_state must be a contiguous (entries, {c}, {k - 1}) tensor, got "
                         f"{tuple(conv_state.shape)}")
    check_state_step_args(cu_seqlens, slots, has_initial_state)
    for name, a in (("x", x), ("weight", weight), ("conv_state", conv_state)):
        check_dtype(name, a, (torch.bfloat16, torch.float16, torch.float32))
    check_same_device(x=x, weight=weight, conv_state=conv_state, cu_seqlens=cu_seqlens, slots=slots,
                      has_initial_state=has_initial_state)
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("x needs contiguous channels and weight must be contiguous")
    out = torch.empty((t, c), dtype=x.dtype, device=x.device)
    if nseq == 0 or t == 0:
        return out
    any_saves, bounds, offsets, entries = save_ranges(save_rows, save_offsets, save_slots, nseq, slots, save_bounds)
    block_c = min(256, next_pow2(c))
    _causal_conv1d_kernel[(nseq, triton.cdiv(c, block_c))](
        x, weight, conv_state, cu_seqlens, slots, has_initial_state.view(torch.int8),
        bounds, offsets, entries, out, x.stride(0), c,
        K=k, BLOCK_C=block_c, BLOCK_K=next_pow2(k), HAS_SAVES=any_saves,
    )
    return out
