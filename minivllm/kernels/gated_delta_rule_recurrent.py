"""The gated delta rule's one-step recurrence (Gated DeltaNet decode): one token per
sequence, each sequence's state read from its slot and written back in place.

One program per (sequence, value head, tile of BLOCK_V value columns); the head's whole
key dimension K sits in registers, so the (K, BLOCK_V) float32 tile of the state is read
once and written once, the step's only large traffic (the state is H x K x V float32 per
layer and slot; q, k, v are a few hundred bytes). Per program::

    k, q   = l2norm(k), l2norm(q) * K ** -0.5      of the q/k head serving value head h
    S      = exp(g) * S                              (K, BLOCK_V), from the slot (zeros: a fresh start)
    u      = beta * (v - S^T k)                      (BLOCK_V,)
    S      = S + k u^T
    o      = S^T q                                   (BLOCK_V,)

Torch reference: :func:`minivllm.kernels.linear_attention_reference.gated_delta_rule_recurrent_reference`
(one row per sequence).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, check_same_device, next_pow2

L2_NORM_EPS = 1e-6  # under the square root, as the reference's
MAX_K = 256


@triton.jit
def _gated_delta_rule_decode_kernel(
    q_ptr, k_ptr,                 # (B, Hk, K) rows strided by stride_qk_row
    v_ptr,                        # (B, H, V) rows strided by stride_v_row, heads contiguous
    g_ptr, beta_ptr,              # (B, H) float32 / any float
    state_ptr,                    # (num_entries, H, K, V) float32, contiguous
    slots_ptr, fresh_ptr,         # (B,) int64 slot; (B,) int8: 1 = start from zero state
    out_ptr,                      # (B, H, V) in v's dtype
    stride_qk_row, stride_v_row, scale, eps,
    H: tl.constexpr, GROUPS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vt = tl.program_id(2)
    hk = h // GROUPS
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vt * BLOCK_V + tl.arange(0, BLOCK_V)
    mk, mv = offs_k < K, offs_v < V

    q = tl.load(q_ptr + b * stride_qk_row + hk * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * stride_qk_row + hk * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q) + eps) * scale
    k = k / tl.sqrt(tl.sum(k * k) + eps)
    v = tl.load(v_ptr + b * stride_v_row + h * V + offs_v, mask=mv, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * H + h).to(tl.float32)
    beta = tl.load(beta_ptr + b * H + h).to(tl.float32)

    slot = tl.load(slots_ptr + b)
    fresh = tl.load(fresh_ptr + b)
    tile = (slot * H + h) * K * V + offs_k[:, None] * V + offs_v[None, :]           # (BLOCK_K, BLOCK_V)
    mask = mk[:, None] & mv[None, :]
    s = tl.load(state_ptr + tile, mask=mask, other=0.0)
    s = tl.where(fresh != 0, 0.0, s)     # a fresh start: the zero state, whatever the slot held (NaN too)
    s = s * tl.exp(g)
    u = beta * (v - tl.sum(s * k[:, None], axis=0))                                  # (BLOCK_V,)
    s = s + k[:, None] * u[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(state_ptr + tile, s, mask=mask)
    tl.store(out_ptr + (b * H + h) * V + offs_v, o.to(out_ptr.dtype.element_ty), mask=mv)


def gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                            has_initial_state: torch.Tensor) -> torch.Tensor:
    """One token per sequence through the delta rule; ``state`` updated in place at ``slots``.

    Args:
        q, k: (B, Hk, K), unnormalised (normalised and q scaled here); each row's heads contiguous.
        v: (B, H, V) with contiguous heads (rows may be strided, as views of a packed
            projection are), H a multiple of Hk (q/k head j serves value heads
            j * H / Hk .. (j + 1) * H / Hk - 1).
        g: (B, H) log decay (<= 0); beta: (B, H).
        state: (num_entries, H, K, V) float32, contiguous.
        slots: (B,) int64 entries of ``state``, distinct.
        has_initial_state: (B,) bool; False starts that sequence from the zero state.

    Returns:
        (B, H, V) in v's dtype.

    Raises:
        TypeError: a state that is not float32, or non-float q/k/v.
        ValueError: shapes that disagree, K above ``MAX_K``, strided heads, a non-contiguous
            state, or tensors on different devices.
    """
    b, hk, kd = q.shape
    _, h, vd = v.shape
    if k.shape != q.shape or v.shape[0] != b or h % hk or g.shape != (b, h) or beta.shape != (b, h):
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    if state.dim() != 4 or state.shape[1:] != (h, kd, vd) or not state.is_contiguous():
        raise ValueError(f"state must be a contiguous (entries, {h}, {kd}, {vd}) tensor, got {tuple(state.shape)}")
    if slots.shape != (b,) or has_initial_state.shape != (b,):
        raise ValueError(f"slots and has_initial_state must be ({b},), got {tuple(slots.shape)}, "
                         f"{tuple(has_initial_state.shape)}")
    if kd > MAX_K:
        raise ValueError(f"head_k_dim {kd} > MAX_K {MAX_K}")
    if state.dtype != torch.float32:
        raise TypeError(f"state must be float32, got {state.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dtype(name, t, (torch.bfloat16, torch.float16, torch.float32))
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, state=state, slots=slots,
                      has_initial_state=has_initial_state)
    if q.stride(2) != 1 or q.stride(1) != kd or k.stride() != q.stride() or v.stride()[1:] != (vd, 1):
        raise ValueError("q, k and v need contiguous heads (q and k of one row stride)")
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if b == 0:
        return out
    block_v = min(64, next_pow2(vd))
    grid = (b, h, triton.cdiv(vd, block_v))
    _gated_delta_rule_decode_kernel[grid](
        q, k, v, g.contiguous(), beta.contiguous(), state, slots.to(torch.int64),
        (~has_initial_state).to(torch.int8), out, q.stride(0), v.stride(0), kd ** -0.5, L2_NORM_EPS,
        H=h, GROUPS=h // hk, K=kd, V=vd, BLOCK_K=next_pow2(kd), BLOCK_V=block_v,
    )
    return out
