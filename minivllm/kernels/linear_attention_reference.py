"""Plain-torch references of the Gated DeltaNet's ops (Qwen3.5's linear attention): the causal
depthwise conv with its conv state, the decay/beta gating, and the gated delta rule in its
chunked form (prefill) and its one-step recurrence (decode). The Triton kernels to come are
tested against these; until then they are the ops' only implementation.

Varlen layout, as the attention ops: B sequences' tokens concatenated (T rows), sequence b
owning rows ``cu_seqlens[b] .. cu_seqlens[b + 1]`` and state slot ``slots[b]``::

    rows       | seq 0: t0 t1 t2 | seq 1: t0 | seq 2: t0 t1 |
    cu_seqlens   0               3           4              6
    slots        5               2           7              (slots of an 8-slot pool)

A sequence with ``has_initial_state[b]`` False starts from zero state (whatever its slot
holds is ignored); after its last row, its slot holds the state that row left. Slots are
distinct within a step.

Save points (prefix-cache snapshots, a drafted row's per-position states): entry ``i`` of
``save_rows`` / ``save_offsets`` / ``save_slots`` asks for sequence ``save_rows[i]``'s state
after its first ``save_offsets[i]`` rows (1 <= offset <= its rows) to be written into entry
``save_slots[i]`` of the same state tensor, an entry no sequence of the step owns. A save
at a sequence's last row is its final state.

The delta rule per value head h, with S a (K, V) state, k and q L2-normalised, q scaled by
K ** -0.5, every token t in order::

    S = exp(g_t) * S                      decay (g_t <= 0)
    u = beta_t * (v_t - S^T k_t)          the part of v_t that S does not predict yet
    S = S + k_t u^T                       write it
    o_t = S^T q_t
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Tokens per chunk of the chunked delta rule (the size transformers' and FLA's kernels use).
CHUNK_SIZE = 64
# The L2 norm's epsilon under the square root (FLA's and transformers' value).
L2_NORM_EPS = 1e-6


def _sequences(cu_seqlens: torch.Tensor) -> list[tuple[int, int, int]]:
    """(b, start, end) of every sequence with at least one row."""
    cu = cu_seqlens.tolist()
    return [(b, cu[b], cu[b + 1]) for b in range(len(cu) - 1) if cu[b + 1] > cu[b]]


SavePoints = dict[int, list[tuple[int, int]]]


def save_points(save_rows: torch.Tensor | None, save_offsets: torch.Tensor | None,
                save_slots: torch.Tensor | None) -> SavePoints:
    """Sequence -> its (offset, entry) save points (module doc), from the three (N,) int64
    tensors (None or empty: no save; a row -1 is no sequence's: a CUDA graph's unused entry)."""
    if save_rows is None or save_offsets is None or save_slots is None or save_rows.numel() == 0:
        return {}
    points: SavePoints = {}
    for b, offset, entry in zip(save_rows.tolist(), save_offsets.tolist(), save_slots.tolist()):
        if b >= 0:
            points.setdefault(b, []).append((offset, entry))
    return points


def causal_conv1d_reference(
    x: torch.Tensor,                  # (T, C) the conv's inputs (q, k, v channels)
    weight: torch.Tensor,             # (C, K) one filter per channel
    conv_state: torch.Tensor,         # (num_entries, C, K - 1) this layer's states, updated in place
    cu_seqlens: torch.Tensor,         # (B + 1,) int
    slots: torch.Tensor,              # (B,) int64
    has_initial_state: torch.Tensor,  # (B,) bool
    saves: SavePoints | None = None,  # sequence -> (offset, entry) save points (``save_points``)
) -> torch.Tensor:                    # (T, C) in x's dtype
    """SiLU of each channel's causal conv over its sequence, the K - 1 inputs before a
    sequence's first row taken from its conv state (zeros for a fresh start); the state then
    keeps the sequence's last K - 1 inputs (older state included when fewer rows came), and
    a save after ``offset`` rows the K - 1 inputs before row ``offset``, the same way.
    Computed in the weight's dtype, as transformers' conv; returned in x's dtype."""
    out = torch.empty_like(x)
    keep = weight.shape[1] - 1
    fresh = ~has_initial_state.cpu()
    saves = saves or {}
    for b, start, end in _sequences(cu_seqlens):
        slot = int(slots[b])
        past = torch.zeros_like(conv_state[slot]) if fresh[b] else conv_state[slot]     # (C, K-1)
        window = torch.cat([past.to(weight.dtype), x[start:end].t().to(weight.dtype)], dim=1)  # (C, K-1+L)
        y = F.conv1d(window[None], weight[:, None, :], groups=weight.shape[0])[0]        # (C, L)
        out[start:end] = F.silu(y).t().to(x.dtype)
        # Column j of the window is the input before row j - (K - 1): after o rows, the
        # K - 1 inputs before row o are columns o .. o + K - 2.
        for offset, entry in saves.get(b, []):
            assert 1 <= offset <= end - start, "a save point lies within its sequence's rows"
            conv_state[entry] = window[:, offset:offset + keep].to(conv_state.dtype)
        conv_state[slot] = window[:, window.shape[1] - keep:].to(conv_state.dtype)
    return out


def gdn_gating_reference(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                         dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, H) ``a`` and ``b`` projections -> ``(g, beta)``: the log decay
    ``g = -exp(A_log) * softplus(a + dt_bias)`` in float32 (so a 16-bit A never overflows), and
    ``beta = sigmoid(b)`` in b's dtype, as transformers' Qwen3.5 computes them."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid()


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """float32, q/k heads repeated to the v heads (each q/k head serves consecutive v heads),
    q and k L2-normalised, q scaled by head_k_dim ** -0.5; (T, H, .) layouts kept."""
    groups = v.shape[1] // k.shape[1]
    q, k = (x.float().repeat_interleave(groups, dim=1) for x in (q, k))
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + L2_NORM_EPS) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + L2_NORM_EPS)
    return q, k, v.float(), g.float(), beta.float()


def _initial_state(state: torch.Tensor, slot: int, fresh: bool) -> torch.Tensor:
    """(H, K, V) float32: the slot's state, or zeros for a fresh start."""
    return torch.zeros_like(state[slot], dtype=torch.float32) if fresh else state[slot].float()


def gated_delta_rule_recurrent_reference(
    q: torch.Tensor,                  # (T, Hk, K)
    k: torch.Tensor,                  # (T, Hk, K)
    v: torch.Tensor,                  # (T, H, V), H a multiple of Hk
    g: torch.Tensor,                  # (T, H) log decay, <= 0
    beta: torch.Tensor,               # (T, H)
    state: torch.Tensor,              # (num_entries, H, K, V) float32, updated in place
    cu_seqlens: torch.Tensor,         # (B + 1,) int
    slots: torch.Tensor,              # (B,) int64
    has_initial_state: torch.Tensor,  # (B,) bool
    saves: SavePoints | None = None,  # sequence -> (offset, entry) save points (``save_points``)
) -> torch.Tensor:                    # (T, H, V) in v's dtype
    """The delta rule token by token (module doc), every sequence from its slot's state, its
    save points written as the tokens pass them; the decode path, and the definition the
    chunked form is tested against."""
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    fresh = ~has_initial_state.cpu()
    saves = saves or {}
    for b, start, end in _sequences(cu_seqlens):
        slot = int(slots[b])
        at = _saves_at(saves.get(b, []), end - start)
        s = _initial_state(state, slot, bool(fresh[b]))                            # (H, K, V)
        for t in range(start, end):
            s = s * gf[t].exp()[:, None, None]
            u = bf[t, :, None] * (vf[t] - torch.einsum("hkv,hk->hv", s, kf[t]))      # (H, V)
            s = s + kf[t, :, :, None] * u[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", s, qf[t])
            for entry in at.get(t + 1 - start, ()):
                state[entry] = s.to(state.dtype)
        state[slot] = s.to(state.dtype)
    return out.to(v.dtype)


def _saves_at(points: list[tuple[int, int]], length: int) -> dict[int, list[int]]:
    """A sequence's save points as offset -> entries (offsets within 1 .. ``length``)."""
    at: dict[int, list[int]] = {}
    for offset, entry in points:
        assert 1 <= offset <= length, "a save point lies within its sequence's rows"
        at.setdefault(offset, []).append(entry)
    return at


def gated_delta_rule_chunked_reference(
    q: torch.Tensor,                  # (T, Hk, K)
    k: torch.Tensor,                  # (T, Hk, K)
    v: torch.Tensor,                  # (T, H, V), H a multiple of Hk
    g: torch.Tensor,                  # (T, H) log decay, <= 0
    beta: torch.Tensor,               # (T, H)
    state: torch.Tensor,              # (num_entries, H, K, V) float32, updated in place
    cu_seqlens: torch.Tensor,         # (B + 1,) int
    slots: torch.Tensor,              # (B,) int64
    has_initial_state: torch.Tensor,  # (B,) bool
    saves: SavePoints | None = None,  # sequence -> (offset, entry) save points (``save_points``)
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:                    # (T, H, V) in v's dtype
    """The same results as :func:`gated_delta_rule_recurrent_reference` (to float32 rounding),
    ``chunk_size`` tokens at a time: within a chunk the recurrence is solved as one triangular
    system (:func:`_delta_chunk`), so the state is read and written once per chunk, not per
    token. Chunks start at each sequence's first row; the last one may be short. A save point
    inside a chunk splits it there (the state exists only between chunks)."""
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    fresh = ~has_initial_state.cpu()
    saves = saves or {}
    for b, start, end in _sequences(cu_seqlens):
        slot = int(slots[b])
        at = _saves_at(saves.get(b, []), end - start)
        cuts = sorted({*range(start, end, chunk_size), *(start + o for o in at if o < end - start)}) + [end]
        s = _initial_state(state, slot, bool(fresh[b]))                            # (H, K, V)
        for c, c_end in zip(cuts, cuts[1:]):
            rows = slice(c, c_end)
            out[rows], s = _delta_chunk(*(x[rows].transpose(0, 1) for x in (qf, kf, vf, gf, bf)), s)
            for entry in at.get(c_end - start, ()):
                state[entry] = s.to(state.dtype)
        state[slot] = s.to(state.dtype)
    return out.to(v.dtype)


def _delta_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 s0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of L tokens, every head at once: q, k (H, L, K), v (H, L, V), g, beta (H, L),
    s0 (H, K, V) -> (outputs (L, H, V), state after the chunk (H, K, V)).

    With G_i the decay summed over the chunk's tokens up to i, and D_ij = exp(G_i - G_j) for
    j <= i (0 above the diagonal), the recurrence's writes u_i solve the unit lower-triangular
    system ``(I + A) U = beta * (V - exp(G) * K S0)`` with ``A_ij = beta_i D_ij k_i.k_j`` for
    j < i; then ``O = exp(G) * Q S0 + (D * Q K^T) U`` and
    ``S = exp(G_L) S0 + (exp(G_L - G) * K)^T U``."""
    length = q.shape[1]
    cum = g.cumsum(dim=1)                                                           # (H, L)
    lower = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    diff = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf"))  # (H, L, L), -inf above
    decay = diff.exp()
    kk = k @ k.transpose(1, 2)                                                      # (H, L, L)
    system = (beta[:, :, None] * decay * kk).tril(-1) + torch.eye(length, device=q.device)
    rhs = beta[:, :, None] * (v - cum.exp()[:, :, None] * (k @ s0))                 # (H, L, V)
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    o = cum.exp()[:, :, None] * (q @ s0) + (decay * (q @ k.transpose(1, 2))) @ u   # (H, L, V)
    last = cum[:, -1:]                                                              # (H, 1)
    s = last.exp()[:, :, None] * s0 + ((last - cum).exp()[:, :, None] * k).transpose(1, 2) @ u
    return o.transpose(0, 1), s
