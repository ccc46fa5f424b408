"""The Gated DeltaNet's causal depthwise conv for one token per sequence (decode), with the
conv state (each channel's last K - 1 inputs) read from the sequence's slot and shifted in
place.

One program per (sequence, tile of BLOCK_C channels); per channel c of sequence b::

    window = [conv_state[slot, c, 0 .. K-2], x[b, c]]     zeros for a fresh start
    out[b, c] = silu(sum_j weight[c, j] * window[j])        accumulated in float32
    conv_state[slot, c, :] = window[1 .. K-1]

Torch reference: :func:`minivllm.kernels.linear_attention_reference.causal_conv1d_reference`
(one row per sequence).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, check_same_device, next_pow2

MAX_KERNEL = 8


@triton.jit
def _causal_conv1d_decode_kernel(
    x_ptr,                        # (B, C) rows strided by stride_x
    weight_ptr,                   # (C, K) contiguous
    state_ptr,                    # (num_entries, C, K - 1) contiguous, in place
    slots_ptr, fresh_ptr,         # (B,) int64 slot; (B,) int8: 1 = start from zero state
    out_ptr,                      # (B, C) contiguous
    stride_x, C,
    K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_j = tl.arange(0, BLOCK_K)                     # window columns 0 .. K-1
    mc = offs_c < C
    slot = tl.load(slots_ptr + b)
    fresh = tl.load(fresh_ptr + b)
    row = state_ptr + (slot * C + offs_c[:, None]) * (K - 1)
    past = tl.load(row + offs_j[None, :], mask=mc[:, None] & (offs_j[None, :] < K - 1), other=0.0)
    past = tl.where(fresh != 0, 0.0, past.to(tl.float32))                       # (BLOCK_C, BLOCK_K)
    x = tl.load(x_ptr + b * stride_x + offs_c, mask=mc, other=0.0).to(tl.float32)
    window = tl.where(offs_j[None, :] == K - 1, x[:, None], past)
    w = tl.load(weight_ptr + offs_c[:, None] * K + offs_j[None, :], mask=mc[:, None] & (offs_j[None, :] < K),
                other=0.0).to(tl.float32)
    y = tl.sum(w * window, axis=1)
    y = y / (1.0 + tl.exp(-y))
    tl.store(out_ptr + b * C + offs_c, y.to(out_ptr.dtype.element_ty), mask=mc)
    # The new state: window columns 1 .. K-1, i.e. state column j takes window column j + 1.
    shifted = tl.where(offs_j[None, :] == K - 2, x[:, None], past)
    nxt = tl.load(row + offs_j[None, :] + 1, mask=mc[:, None] & (offs_j[None, :] < K - 2), other=0.0)
    nxt = tl.where(fresh != 0, 0.0, nxt.to(tl.float32))
    shifted = tl.where(offs_j[None, :] < K - 2, nxt, shifted)
    tl.store(row + offs_j[None, :], shifted.to(state_ptr.dtype.element_ty),
             mask=mc[:, None] & (offs_j[None, :] < K - 1))


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                         has_initial_state: torch.Tensor) -> torch.Tensor:
    """SiLU of each channel's causal conv at one new input per sequence; ``conv_state`` shifted
    in place at ``slots``.

    Args:
        x: (B, C), channels contiguous (rows may be strided).
        weight: (C, K) contiguous, 2 <= K <= ``MAX_KERNEL``.
        conv_state: (num_entries, C, K - 1) contiguous.
        slots: (B,) int64 entries of ``conv_state``, distinct.
        has_initial_state: (B,) bool; False starts that sequence from zeros.

    Returns:
        (B, C) in x's dtype.

    Raises:
        TypeError: non-float tensors.
        ValueError: shapes that disagree, a kernel width outside 2 .. ``MAX_KERNEL``,
            strided channels, or tensors on different devices.
    """
    b, c = x.shape
    if weight.dim() != 2 or weight.shape[0] != c or not 2 <= weight.shape[1] <= MAX_KERNEL:
        raise ValueError(f"weight must be ({c}, K) with 2 <= K <= {MAX_KERNEL}, got {tuple(weight.shape)}")
    k = weight.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[1:] != (c, k - 1) or not conv_state.is_contiguous():
        raise ValueError(f"conv_state must be a contiguous (entries, {c}, {k - 1}) tensor, got "
                         f"{tuple(conv_state.shape)}")
    if slots.shape != (b,) or has_initial_state.shape != (b,):
        raise ValueError(f"slots and has_initial_state must be ({b},), got {tuple(slots.shape)}, "
                         f"{tuple(has_initial_state.shape)}")
    for name, t in (("x", x), ("weight", weight), ("conv_state", conv_state)):
        check_dtype(name, t, (torch.bfloat16, torch.float16, torch.float32))
    check_same_device(x=x, weight=weight, conv_state=conv_state, slots=slots, has_initial_state=has_initial_state)
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("x needs contiguous channels and weight must be contiguous")
    out = torch.empty((b, c), dtype=x.dtype, device=x.device)
    if b == 0:
        return out
    block_c = min(256, next_pow2(c))
    _causal_conv1d_decode_kernel[(b, triton.cdiv(c, block_c))](
        x, weight, conv_state, slots.to(torch.int64), (~has_initial_state).to(torch.int8), out, x.stride(0), c,
        K=k, BLOCK_C=block_c, BLOCK_K=next_pow2(k),
    )
    return out
