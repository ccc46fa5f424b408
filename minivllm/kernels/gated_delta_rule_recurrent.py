"""The gated delta rule token by token, over B sequences' concatenated tokens (varlen), each
sequence's state read from its slot, written back in place, and at its save points into
other entries. Decode (one token per sequence) is the case it is fastest at; a prefill chunk
runs its tokens in order, the state in registers throughout.

One program per (sequence, value head, tile of BLOCK_V value columns); the head's whole key
dimension K sits in registers, so the (K, BLOCK_V) float32 tile of the state is read once and
written once per step (and once per save point). Per token t of the sequence::

    k, q   = l2norm(k_t), l2norm(q_t) * K ** -0.5    of the q/k head serving value head h
    S      = exp(g_t) * S                             (K, BLOCK_V), from the slot (zeros: a fresh start)
    u      = beta_t * (v_t - S^T k)                   (BLOCK_V,)
    S      = S + k u^T
    o_t    = S^T q                                    (BLOCK_V,)

Save point i (``save_rows[i]`` = b) writes S after the sequence's first ``save_offsets[i]``
tokens into entry ``save_slots[i]``; the launcher orders them by (row, offset), and the
program runs its tokens up to each of its save points in turn.

Torch reference: :func:`minivllm.kernels.linear_attention_reference.gated_delta_rule_recurrent_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, check_same_device, check_state_step_args, next_pow2

L2_NORM_EPS = 1e-6  # under the square root, as the reference's
MAX_K = 256


@triton.jit
def _run_tokens(s, first, last, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, h, hk, offs_k, offs_v, mk, mv,
                stride_qk_row, stride_v_row, scale, eps, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Tokens ``first .. last - 1`` (rows of the step) through the recurrence from state ``s``."""
    for t in range(first, last):
        row = t  # int64: the bounds come from the int64 cu_seqlens
        q = tl.load(q_ptr + row * stride_qk_row + hk * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * stride_qk_row + hk * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q) + eps) * scale
        k = k / tl.sqrt(tl.sum(k * k) + eps)
        v = tl.load(v_ptr + row * stride_v_row + h * V + offs_v, mask=mv, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * H + h).to(tl.float32)
        beta = tl.load(beta_ptr + row * H + h).to(tl.float32)
        s = s * tl.exp(g)
        u = beta * (v - tl.sum(s * k[:, None], axis=0))                              # (BLOCK_V,)
        s = s + k[:, None] * u[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + (row * H + h) * V + offs_v, o.to(out_ptr.dtype.element_ty), mask=mv)
    return s


@triton.jit
def _gated_delta_rule_recurrent_kernel(
    q_ptr, k_ptr,                 # (T, Hk, K) rows strided by stride_qk_row
    v_ptr,                        # (T, H, V) rows strided by stride_v_row
    g_ptr, beta_ptr,              # (T, H) contiguous
    state_ptr,                    # (num_entries, H, K, V) float32, contiguous
    cu_ptr,                       # (B + 1,) int32 or int64 row offsets
    slots_ptr, init_ptr,          # (B,) int64 slot; (B,) bool as int8: 0 = start from zero state
    save_bounds_ptr,              # (B + 1,) int64: sequence b's save points are bounds[b] .. bounds[b + 1] - 1
    save_offsets_ptr, save_slots_ptr,   # (N,) int64, by (row, offset)
    out_ptr,                      # (T, H, V) contiguous, in v's dtype
    stride_qk_row, stride_v_row, scale, eps,
    H: tl.constexpr, GROUPS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_SAVES: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vt = tl.program_id(2)
    hk = h // GROUPS
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vt * BLOCK_V + tl.arange(0, BLOCK_V)
    mk, mv = offs_k < K, offs_v < V
    mask = mk[:, None] & mv[None, :]
    start = tl.load(cu_ptr + b).to(tl.int64)
    end = tl.load(cu_ptr + b + 1).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    fresh = (tl.load(init_ptr + b) == 0).to(tl.int8)
    mask = mask & (offs_v[None, :] * 0 + slot >= 0)  # slot -1: a graph's padding row, from zeros, no state written
    in_head = offs_k[:, None] * V + offs_v[None, :]                                  # (BLOCK_K, BLOCK_V)
    s = tl.load(state_ptr + (slot * H + h) * K * V + in_head, mask=mask, other=0.0)
    s = tl.where(fresh != 0, 0.0, s)     # a fresh start: the zero state, whatever the slot held (NaN too)
    done = start
    if HAS_SAVES:
        for i in range(tl.load(save_bounds_ptr + b), tl.load(save_bounds_ptr + b + 1)):
            upto = start + tl.load(save_offsets_ptr + i)
            s = _run_tokens(s, done, upto, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, h, hk, offs_k, offs_v,
                            mk, mv, stride_qk_row, stride_v_row, scale, eps, H, K, V)
            done = upto
            entry = tl.load(save_slots_ptr + i)
            tl.store(state_ptr + (entry * H + h) * K * V + in_head, s, mask=mask)
    s = _run_tokens(s, done, end, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, h, hk, offs_k, offs_v,
                    mk, mv, stride_qk_row, stride_v_row, scale, eps, H, K, V)
    tl.store(state_ptr + (slot * H + h) * K * V + in_head, s, mask=mask)


def gated_delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor,
                               slots: torch.Tensor, has_initial_state: torch.Tensor,
                               save_rows: torch.Tensor | None = None, save_offsets: torch.Tensor | None = None,
                               save_slots: torch.Tensor | None = None, *, save_bounds: torch.Tensor | None = None,
                               block_v: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """Every sequence's tokens through the delta rule, in order; ``state`` updated in place at
    ``slots`` and written at the save points. Nothing here syncs the host (CUDA graphs).

    Args:
        q, k: (T, Hk, K), unnormalised (normalised and q scaled here); heads contiguous, rows
            of one stride (views of a packed projection are fine).
        v: (T, H, V) with contiguous heads, H a multiple of Hk (q/k head j serves value heads
            j * H / Hk .. (j + 1) * H / Hk - 1).
        g: (T, H) log decay (<= 0); beta: (T, H).
        state: (num_entries, H, K, V) float32, contiguous.
        cu_seqlens: (B + 1,) int32 or int64 row offsets of the B sequences.
        slots: (B,) int64 entries of ``state``, distinct; -1: a padding row (of a CUDA graph), run
            from the zero state, its state written nowhere.
        has_initial_state: (B,) bool; False starts that sequence from the zero state.
        save_rows, save_offsets, save_slots: (N,) each, or None: save point i writes sequence
            save_rows[i]'s state after its first save_offsets[i] tokens (1 .. its tokens) into
            entry save_slots[i], which no sequence of the step owns.
        save_bounds: (B + 1,) int64, or None: the save points are ordered by (row, offset) and
            sequence b's are ``save_bounds[b] .. save_bounds[b + 1] - 1`` (``save_rows`` then
            unread); None: they are sorted here (``save_ranges``).
        block_v: value columns per program (None: ``default_block_v``); num_warps: per program.

    Returns:
        (T, H, V) in v's dtype.

    Raises:
        TypeError: a state that is not float32, non-float q/k/v, or index dtypes other than
            ``check_state_step_args``'s.
        ValueError: shapes that disagree, K above ``MAX_K``, strided heads, a non-contiguous
            state, or tensors on different devices.
    """
    check_gated_delta_rule_args(q, k, v, g, beta, state, cu_seqlens, slots, has_initial_state)
    t, hk, kd = q.shape
    h, vd = v.shape[1:]
    nseq = slots.shape[0]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if nseq == 0 or t == 0:
        return out
    any_saves, bounds, offsets, entries = save_ranges(save_rows, save_offsets, save_slots, nseq, slots, save_bounds)
    block_v = min(block_v or default_block_v(nseq * h), next_pow2(vd))
    grid = (nseq, h, triton.cdiv(vd, block_v))
    _gated_delta_rule_recurrent_kernel[grid](
        q, k, v, g.contiguous(), beta.contiguous(), state, cu_seqlens, slots,
        has_initial_state.view(torch.int8), bounds, offsets, entries, out,
        q.stride(0), v.stride(0), kd ** -0.5, L2_NORM_EPS,
        H=h, GROUPS=h // hk, K=kd, V=vd, BLOCK_K=next_pow2(kd), BLOCK_V=block_v, HAS_SAVES=any_saves,
        num_warps=num_warps,
    )
    return out


def default_block_v(heads: int) -> int:
    """Value columns per program for ``heads`` (sequence, value head) pairs: narrow tiles when
    there are few, so a small batch still spreads its state over every SM (at batch 1 and 32
    heads, 64-wide tiles made 64 programs for 132 SMs), wide ones when there are many."""
    return 16 if heads < 256 else 32 if heads < 1024 else 64


def check_gated_delta_rule_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                beta: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor,
                                slots: torch.Tensor, has_initial_state: torch.Tensor) -> None:
    """The checks every gated-delta-rule launcher makes (the Raises of
    :func:`gated_delta_rule_recurrent`)."""
    t, hk, kd = q.shape
    h, vd = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != t or h % hk or g.shape != (t, h) or beta.shape != (t, h):
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    if state.dim() != 4 or state.shape[1:] != (h, kd, vd) or not state.is_contiguous():
        raise ValueError(f"state must be a contiguous (entries, {h}, {kd}, {vd}) tensor, got {tuple(state.shape)}")
    check_state_step_args(cu_seqlens, slots, has_initial_state)
    if kd > MAX_K:
        raise ValueError(f"head_k_dim {kd} > MAX_K {MAX_K}")
    if state.dtype != torch.float32:
        raise TypeError(f"state must be float32, got {state.dtype}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_dtype(name, x, (torch.bfloat16, torch.float16, torch.float32))
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, state=state, cu_seqlens=cu_seqlens, slots=slots,
                      has_initial_state=has_initial_state)
    if q.stride(2) != 1 or q.stride(1) != kd or k.stride() != q.stride() or v.stride()[1:] != (vd, 1):
        raise ValueError("q, k and v need contiguous heads (q and k of one row stride)")


def save_ranges(rows: torch.Tensor | None, offsets: torch.Tensor | None, entries: torch.Tensor | None,
                nseq: int, dummy: torch.Tensor, bounds: torch.Tensor | None = None
                ) -> tuple[bool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The save points as the state kernels take them: ``(any, bounds, offsets, entries)``, the
    points ordered by (row, offset) and sequence b's at ``bounds[b] .. bounds[b + 1] - 1``, so
    that each program visits its own only. ``bounds`` (B + 1,) given: the caller has ordered
    them (a CUDA graph's static buffers, entries past ``bounds[B]`` unused); else they are
    sorted and bounded here, on the device (no host sync). ``dummy``: any int64 tensor on the
    device, passed where there are none."""
    if rows is None or offsets is None or entries is None or (bounds is None and rows.numel() == 0):
        return False, dummy, dummy, dummy
    if bounds is not None:
        if bounds.dtype != torch.int64 or bounds.shape != (nseq + 1,):
            raise ValueError(f"save_bounds must be int64 ({nseq + 1},), got {bounds.dtype} {tuple(bounds.shape)}")
        return True, bounds, offsets, entries
    rows, offsets, entries = (x.to(device=dummy.device, dtype=torch.int64) for x in (rows, offsets, entries))
    order = torch.argsort(rows * (1 << 32) + offsets)
    rows = rows[order]
    bounds = torch.searchsorted(rows, torch.arange(nseq + 1, dtype=torch.int64, device=dummy.device))
    return True, bounds, offsets[order], entries[order]
