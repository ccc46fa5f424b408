"""The gated delta rule a chunk of tokens at a time, over B sequences' concatenated tokens
(varlen): the same arguments and results as :mod:`minivllm.kernels.gated_delta_rule_recurrent`
(to float32 rounding for float32 inputs; for 16-bit ones its products are TF32, below their
output's rounding: ``dot_precision``), for prefill chunks, where the token-by-token recurrence
is a chain of small reductions and this form is a few matmuls per piece on tensor cores.

One program per (sequence, value head, tile of BLOCK_V value columns); the (K, BLOCK_V) float32
tile of the state stays in registers while the program walks its sequence's rows in pieces of at
most CHUNK tokens. A piece also ends at each of the sequence's save points (ordered by (row,
offset) by the launcher), so the state exists there and is stored. Per piece of L tokens, with
k, q of the q/k head serving value head h L2-normalised and q scaled by K ** -0.5 (rows L: CHUNK,
rows past the piece masked to zero), G the cumulative sum of g within the piece and
D_ij = exp(G_i - G_j) for j <= i (0 above)::

    A   = beta_i D_ij k_i.k_j  for j < i, else 0                     (L, L)
    U   = (I + A)^-1 (beta * (V - exp(G) * K S))                      (L, BLOCK_V): the writes u_t
    O   = exp(G) * Q S + (D * Q K^T) U                                 (L, BLOCK_V)
    S   = exp(G_L) S + (exp(G_L - G) * K)^T U                          (K, BLOCK_V)

Torch reference: :func:`minivllm.kernels.linear_attention_reference.gated_delta_rule_chunked_reference`
(and the token-by-token ``gated_delta_rule_recurrent_reference`` it equals).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_power_of_two, next_pow2
from minivllm.kernels.gated_delta_rule_recurrent import L2_NORM_EPS, check_gated_delta_rule_args, save_ranges

# Tokens per piece (a power of two >= 16: tl.dot's minimum). 64 did not compile within 150 s
# on an H100 (Triton 3.6: six levels of 64 x 64 inversion unrolled in registers); 16 compiles
# in under 5 s (docs/tuning.md, "Hybrid models").
CHUNK = 16
BLOCK_V = 32   # value columns per program: B * H * V / 32 programs for a GPU's SMs
NUM_WARPS = 4
# tl.dot's input precisions: float32 on CUDA cores; three TF32 tensor-core products (float32's
# accuracy); one (an 11-bit mantissa).
PRECISIONS = ("ieee", "tf32x3", "tf32")


def dot_precision(dtype: torch.dtype) -> str:
    """The products' precision for inputs of ``dtype``: "tf32" for 16-bit inputs (its error,
    about 5e-4 in the output at Qwen3.5-9B's shapes, is below a bf16 output's rounding), else
    "tf32x3" (the recurrence's float32 results). On an H200 at those shapes a 2,048-token
    prompt takes 0.44 ms at tf32, 1.5 ms at tf32x3, 11 ms on CUDA cores (docs/tuning.md,
    "Hybrid models")."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _unit_lower_inverse(a, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """(I + a)^-1 of a strictly lower (CHUNK, CHUNK) ``a``, by recursive block inversion: with T
    holding the inverses of the diagonal blocks of size b, those of size 2b are
    T - T E T, E the lower-left b-blocks of ``a`` inside them. Exact and stable (every T is an
    inverse of a diagonal block of I + a); the product (I - a)(I + a^2)(I + a^4).. is not, as
    repeated keys give entries near 1 whose powers overflow float32's precision."""
    offs = tl.arange(0, CHUNK)
    i, j = offs[:, None], offs[None, :]
    t = tl.where(i == j, 1.0, 0.0) - tl.where(i // 2 == j // 2, a, 0.0)           # size-2 blocks
    for level in tl.static_range(1, LOG2_CHUNK):
        e = tl.where(i // (2 << level) == j // (2 << level), a, 0.0)
        e = tl.where(i // (1 << level) == j // (1 << level), 0.0, e)
        t = t - _dot(t, _dot(e, t, PRECISION), PRECISION)
    return t


@triton.jit
def _piece(s, first, last, q_head, k_head, v_head, g_head, beta_head, out_head, offs_k, offs_v, mk, mv,
           stride_qk_row, stride_v_row, scale, eps, H: tl.constexpr, V: tl.constexpr,
           CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """Rows ``first .. last - 1`` (at most CHUNK) through the rule from state ``s`` (BLOCK_K, BLOCK_V);
    their outputs stored; the state after them returned."""
    offs_l = tl.arange(0, CHUNK)
    rows = first + offs_l                                                          # int64 (CHUNK,)
    ml = rows < last
    m_qk = ml[:, None] & mk[None, :]
    at_qk = rows[:, None] * stride_qk_row + offs_k[None, :]
    q = tl.load(q_head + at_qk, mask=m_qk, other=0.0).to(tl.float32)               # (CHUNK, BLOCK_K)
    k = tl.load(k_head + at_qk, mask=m_qk, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=1) + eps)[:, None] * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=1) + eps)[:, None]
    m_v = ml[:, None] & mv[None, :]
    v = tl.load(v_head + rows[:, None] * stride_v_row + offs_v[None, :], mask=m_v, other=0.0).to(tl.float32)
    # Masked rows: g = 0 keeps G flat past the piece, beta = 0 and k = 0 make their writes zero.
    g = tl.load(g_head + rows * H, mask=ml, other=0.0).to(tl.float32)
    beta = tl.load(beta_head + rows * H, mask=ml, other=0.0).to(tl.float32)
    cum = tl.cumsum(g, axis=0)                                                     # G (CHUNK,)
    i, j = offs_l[:, None], offs_l[None, :]
    decay = tl.exp(tl.where(j <= i, cum[:, None] - cum[None, :], float("-inf")))  # D (CHUNK, CHUNK)
    a = tl.where(j < i, beta[:, None] * decay * _dot(k, tl.trans(k), PRECISION), 0.0)
    rhs = beta[:, None] * (v - tl.exp(cum)[:, None] * _dot(k, s, PRECISION))       # (CHUNK, BLOCK_V)
    u = _dot(_unit_lower_inverse(a, CHUNK, LOG2_CHUNK, PRECISION), rhs, PRECISION)
    o = tl.exp(cum)[:, None] * _dot(q, s, PRECISION) + _dot(decay * _dot(q, tl.trans(k), PRECISION), u, PRECISION)
    tl.store(out_head + rows[:, None] * (H * V) + offs_v[None, :], o.to(out_head.dtype.element_ty), mask=m_v)
    total = tl.sum(g)                                                              # G_L
    return tl.exp(total) * s + _dot(tl.trans(k * tl.exp(total - cum)[:, None]), u, PRECISION)


@triton.jit
def _run_pieces(s, first, last, q_head, k_head, v_head, g_head, beta_head, out_head, offs_k, offs_v, mk, mv,
                stride_qk_row, stride_v_row, scale, eps, H: tl.constexpr, V: tl.constexpr,
                CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """Rows ``first .. last - 1`` in pieces of CHUNK (the last one short) from state ``s``."""
    for c in range(first, last, CHUNK):
        s = _piece(s, c, tl.minimum(c + CHUNK, last), q_head, k_head, v_head, g_head, beta_head, out_head,
                   offs_k, offs_v, mk, mv, stride_qk_row, stride_v_row, scale, eps, H, V, CHUNK, LOG2_CHUNK,
                   PRECISION)
    return s


@triton.jit
def _gated_delta_rule_chunked_kernel(
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
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr,
    PRECISION: tl.constexpr, HAS_SAVES: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vt = tl.program_id(2)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vt * BLOCK_V + tl.arange(0, BLOCK_V)
    mk, mv = offs_k < K, offs_v < V
    mask = mk[:, None] & mv[None, :]
    q_head, k_head = q_ptr + (h // GROUPS) * K, k_ptr + (h // GROUPS) * K
    v_head, out_head = v_ptr + h * V, out_ptr + h * V
    g_head, beta_head = g_ptr + h, beta_ptr + h
    start = tl.load(cu_ptr + b).to(tl.int64)
    end = tl.load(cu_ptr + b + 1).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    mask = mask & (offs_v[None, :] * 0 + slot >= 0)  # slot -1: a graph's padding row, from zeros, no state written
    in_head = offs_k[:, None] * V + offs_v[None, :]                                  # (BLOCK_K, BLOCK_V)
    s = tl.load(state_ptr + (slot * H + h) * K * V + in_head, mask=mask, other=0.0)
    s = tl.where(tl.load(init_ptr + b) == 0, 0.0, s)  # a fresh start: zeros, whatever the slot held (NaN too)
    done = start
    if HAS_SAVES:
        for n in range(tl.load(save_bounds_ptr + b), tl.load(save_bounds_ptr + b + 1)):
            upto = start + tl.load(save_offsets_ptr + n)
            s = _run_pieces(s, done, upto, q_head, k_head, v_head, g_head, beta_head, out_head, offs_k, offs_v,
                            mk, mv, stride_qk_row, stride_v_row, scale, eps, H, V, CHUNK, LOG2_CHUNK, PRECISION)
            done = upto
            entry = tl.load(save_slots_ptr + n)
            tl.store(state_ptr + (entry * H + h) * K * V + in_head, s, mask=mask)
    s = _run_pieces(s, done, end, q_head, k_head, v_head, g_head, beta_head, out_head, offs_k, offs_v,
                    mk, mv, stride_qk_row, stride_v_row, scale, eps, H, V, CHUNK, LOG2_CHUNK, PRECISION)
    tl.store(state_ptr + (slot * H + h) * K * V + in_head, s, mask=mask)


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor,
                             slots: torch.Tensor, has_initial_state: torch.Tensor,
                             save_rows: torch.Tensor | None = None, save_offsets: torch.Tensor | None = None,
                             save_slots: torch.Tensor | None = None, *, save_bounds: torch.Tensor | None = None,
                             chunk: int = CHUNK,
                             block_v: int = BLOCK_V, num_warps: int = NUM_WARPS,
                             precision: str | None = None) -> torch.Tensor:
    """Every sequence's tokens through the delta rule, ``chunk`` tokens per piece; ``state``
    updated in place at ``slots`` and written at the save points. Nothing here syncs the host
    (CUDA graphs). Arguments, results and errors as
    :func:`~minivllm.kernels.gated_delta_rule_recurrent.gated_delta_rule_recurrent`, and:

    Args:
        chunk: tokens per piece, a power of two >= 16.
        block_v: value columns per program, a power of two >= 16 (narrowed to V's).
        num_warps: warps per program.
        precision: the products' ``tl.dot`` input precision, one of ``PRECISIONS`` (None:
            :func:`dot_precision` of v's dtype).

    Raises:
        ValueError: also a ``chunk`` or ``block_v`` that is not a power of two >= 16, or an
            unknown ``precision``.
    """
    check_gated_delta_rule_args(q, k, v, g, beta, state, cu_seqlens, slots, has_initial_state)
    check_power_of_two("chunk", chunk, minimum=16)
    check_power_of_two("block_v", block_v, minimum=16)
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    t, hk, kd = q.shape
    h, vd = v.shape[1:]
    nseq = slots.shape[0]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if nseq == 0 or t == 0:
        return out
    any_saves, bounds, offsets, entries = save_ranges(save_rows, save_offsets, save_slots, nseq, slots, save_bounds)
    block_v = min(block_v, max(16, next_pow2(vd)))
    grid = (nseq, h, triton.cdiv(vd, block_v))
    _gated_delta_rule_chunked_kernel[grid](
        q, k, v, g.contiguous(), beta.contiguous(), state, cu_seqlens, slots,
        has_initial_state.view(torch.int8), bounds, offsets, entries, out,
        q.stride(0), v.stride(0), kd ** -0.5, L2_NORM_EPS,
        H=h, GROUPS=h // hk, K=kd, V=vd, BLOCK_K=max(16, next_pow2(kd)), BLOCK_V=block_v,
        CHUNK=chunk, LOG2_CHUNK=chunk.bit_length() - 1, PRECISION=precision or dot_precision(v.dtype),
        HAS_SAVES=any_saves,
        num_warps=num_warps,
    )
    return out
