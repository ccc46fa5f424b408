"""Plain-torch references of the kernels: what every kernel is tested against, and the
torch path of the fused ops (any device).

Cache layout (one layer): ``k_cache``, ``v_cache`` are (num_blocks, block_size,
num_kv_heads, head_dim); token slot s lives at ``[s // block_size, s % block_size]``.

The norm, activation and RoPE references round where Hugging Face's modules do (each op
in the model dtype unless noted).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.kernels.fp8 import (
    FP8_GROUP, ScaleMode, dequantize_fp8_block, dequantize_fp8_weight, quantize_fp8_per_token,
    quantize_fp8_per_token_group, quantize_with_scale,
)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)``; statistics in float32, cast back before the weight multiply."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``."""
    # Added in the model dtype, matching HF's ``residual + hidden_states``.
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]``, in x's dtype (each op rounds, as HF's)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` (T, H, D) and ``k`` (T, Hkv, D) by ``cos_sin_cache[positions]`` (neox
    style: the two halves of each head), in float32, rounded once to each input's dtype."""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # (T, 1, D/2) each
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)  # (T, H, D/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def quantize_kv_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the FP8 KV cache stores for ``x`` (``kernels/fp8.py``'s rule with the per-tensor
    ``scale``): e4m3 of x * (1 / scale) in fp32, saturated at +-448, ties to even."""
    return quantize_with_scale(x, scale.float())


def dequantize_kv_reference(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A cache's values in fp32: an FP8 cache's times its scale, any other cache's as they are."""
    if cache.dtype == torch.float8_e4m3fn:
        return cache.float() * scale.float()
    return cache.float()


def _to_cache(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if cache.dtype == torch.float8_e4m3fn:
        return quantize_kv_reference(x, scale)
    return x.to(cache.dtype)


def store_kv_reference(
    key: torch.Tensor,           # (T, Hkv, D)
    value: torch.Tensor,         # (T, Hkv, D)
    k_cache: torch.Tensor,       # (N, bs, Hkv, D)
    v_cache: torch.Tensor,       # (N, bs, Hkv, D)
    slot_mapping: torch.Tensor,  # (T,) int, -1 = padding row, write nothing
    k_scale: torch.Tensor | None = None,  # FP8 cache: (1,) float32
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write each token's K/V at its slot, in place; rows with slot -1 are skipped. An FP8
    cache stores ``quantize_kv_reference`` of each row with its scale."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = _to_cache(key[keep], k_cache, k_scale)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = _to_cache(value[keep], v_cache, v_scale)


def qk_norm_rope_store_reference(
    qkv: torch.Tensor,            # (T, (H + 2 Hkv) * D)
    positions: torch.Tensor,      # (T,) int
    q_weight: torch.Tensor | None,  # (D,); None (both): no norm
    k_weight: torch.Tensor | None,  # (D,)
    eps: float,
    cos_sin_cache: torch.Tensor,  # (P, D) float32 [cos | sin]
    k_cache: torch.Tensor,        # (N, bs, Hkv, D)
    v_cache: torch.Tensor,        # (N, bs, Hkv, D)
    slot_mapping: torch.Tensor,   # (T,) int, -1 = write nothing
    k_scale: torch.Tensor | None = None,  # FP8 cache: (1,) float32
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The unfused path: per-head RMSNorm of q and k (unless the weights are None), RoPE,
    K/V stored (``store_kv_reference``); returns q (T, H, D)."""
    hkv, d = k_cache.shape[2:]
    t = qkv.shape[0]
    q, k, v = qkv.view(t, -1, d).split([qkv.shape[1] // d - 2 * hkv, hkv, hkv], dim=1)
    if q_weight is not None and k_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    q, k = rope_ref(positions, q, k, cos_sin_cache)
    store_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The first ``kv_len`` tokens of one sequence, read through its block table: (kv_len, Hkv, D)."""
    bs = cache.shape[1]
    pos = torch.arange(kv_len, device=cache.device)
    blocks = block_table[pos // bs].long()
    return cache[blocks, pos % bs]


def paged_attention_reference(
    q: torch.Tensor,             # (T, H, D) new tokens' queries, sequences concatenated
    k_cache: torch.Tensor,       # (N, bs, Hkv, D), already holding the new tokens' K/V
    v_cache: torch.Tensor,       # (N, bs, Hkv, D)
    cu_seqlens_q: torch.Tensor,  # (B+1,) int
    kv_lens: torch.Tensor,       # (B,) int: cached prefix + new tokens
    block_tables: torch.Tensor,  # (B, max_blocks) int, -1 padded
    scale: float,
    k_scale: torch.Tensor | None = None,  # FP8 cache: (1,) float32, K = stored * k_scale
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context
    (an FP8 cache's values dequantized, ``dequantize_kv_reference``).

    Sequence b feeds q_len = cu_q[b+1] - cu_q[b] tokens at positions
    kv_len - q_len .. kv_len - 1; query i sees keys 0 .. kv_len - q_len + i.
    Covers prefill (q_len = kv_len), prefill over a cached prefix or earlier
    chunks (q_len < kv_len) and decode (q_len = 1) alike. Computed in fp32;
    returns q's dtype. A row with kv_len 0 (CUDA-graph padding) yields zeros.
    """
    T, H, D = q.shape
    hkv = k_cache.shape[2]
    out = torch.zeros(T, H, D, dtype=q.dtype, device=q.device)
    cu = cu_seqlens_q.tolist()
    lens = kv_lens.tolist()
    for b, kv_len in enumerate(lens):
        q_len = cu[b + 1] - cu[b]
        if q_len == 0 or kv_len == 0:
            continue
        k = dequantize_kv_reference(gather_kv(k_cache, block_tables[b], kv_len), k_scale)   # (S, Hkv, D)
        v = dequantize_kv_reference(gather_kv(v_cache, block_tables[b], kv_len), v_scale)
        k = k.repeat_interleave(H // hkv, dim=1)                   # (S, H, D)
        v = v.repeat_interleave(H // hkv, dim=1)
        qb = q[cu[b]:cu[b + 1]].float()                            # (q_len, H, D)
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale       # (H, q_len, S)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        k_pos = torch.arange(kv_len, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[cu[b]:cu[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def all_reduce_add_rms_norm_reference(parts: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``kernels/all_reduce_rms_norm.py`` returns on every rank: the ranks' partial
    sums added in rank order in float32 and rounded (the all-reduce), then
    ``add_rms_norm_ref``."""
    total = torch.zeros(parts[0].shape, dtype=torch.float32, device=parts[0].device)
    for p in parts:
        total += p.float()
    s = total.to(parts[0].dtype) + residual
    return rms_norm_ref(s, weight, eps), s


def vocab_shard_embedding_reference(ids: torch.Tensor, weight: torch.Tensor, vocab_start: int,
                                    vocab_end: int) -> torch.Tensor:
    """What ``kernels/vocab_embedding.py`` returns: the rows of the ids in ``[vocab_start,
    vocab_end)`` (``weight`` holds them from row 0), zeros for the others."""
    mine = (ids >= vocab_start) & (ids < vocab_end)
    out = torch.nn.functional.embedding((ids - vocab_start) * mine, weight)
    return out * mine.unsqueeze(-1).to(out.dtype)


def moe_topk_reference(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``kernels/moe_topk.py`` returns for router logits (T, E): ``(weights, ids)``
    (T, top_k), largest first, as transformers' Qwen3-MoE router: softmax in float32, top-k,
    divided by the sum when ``norm_topk_prob``; ids int32. Ties pick the lower expert index,
    as the kernel does (torch.topk leaves that order unspecified), hence a stable sort."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[..., :top_k], ids[..., :top_k]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def moe_align_reference(topk_ids: torch.Tensor, num_experts: int,
                        block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The used part of ``kernels/moe_align.py``'s layout for ``topk_ids`` (T, k):
    ``(sorted_pair_ids, block_expert)``, the pair ids t * k + j of each expert in ascending
    order, padded with T * k to a multiple of ``block_m``, and the expert of each block."""
    flat = topk_ids.reshape(-1).long()
    pad = flat.numel()
    rows, owners = [], []
    for e in range(num_experts):
        pairs = torch.nonzero(flat == e).flatten()
        blocks = -(-pairs.numel() // block_m)
        rows.append(torch.cat([pairs, pairs.new_full((blocks * block_m - pairs.numel(),), pad)]))
        owners.append(torch.full((blocks,), e, dtype=torch.long))
    return torch.cat(rows).to(torch.int32), torch.cat(owners).to(torch.int32)


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """What ``kernels/fused_moe.py`` returns: x (T, H), w13 (E, 2I, H) [gate | up], w2
    (E, H, I), topk_weights (T, k) float32, topk_ids (T, k) -> (T, H) in x's dtype. Each
    expert in x's dtype as transformers' Qwen3MoeExperts; the weighted rows summed in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == e)
        if token.numel() == 0:
            continue
        act = silu_and_mul_ref(F.linear(x[token], w13[e]))                 # (n, I)
        y = F.linear(act, w2[e]).float() * topk_weights[token, slot, None]  # (n, H)
        out.index_add_(0, token, y)
    return out.to(x.dtype)


def moe_sum_reference(rows: torch.Tensor, top_k: int) -> torch.Tensor:
    """What ``kernels/moe_sum.py`` returns: rows (T * k, H) -> (T, H), each token's k rows
    summed in float32 and rounded once to rows' dtype."""
    return rows.view(-1, top_k, rows.shape[1]).sum(dim=1, dtype=torch.float32).to(rows.dtype)


# FP8 (e4m3) weights: dequantize, then compute in float32 (scales: kernels/fp8.py).

def fp8_gemm_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       mode: ScaleMode) -> torch.Tensor:
    """What ``kernels/fp8_gemm.py`` returns for x (M, K) and fp8 W (N, K) with scales of
    ``mode``: x quantized as the kernel quantizes it (per token and 128-column group for
    "block", per token for "channel"), both operands dequantized, the product in float32,
    rounded once to x's dtype."""
    if mode == "block":
        x_fp8, x_scale = quantize_fp8_per_token_group(x, FP8_GROUP)
        xd = dequantize_fp8_block(x_fp8, x_scale, (1, FP8_GROUP))
    else:
        x_fp8, x_scale = quantize_fp8_per_token(x)
        xd = x_fp8.float() * x_scale
    return (xd @ dequantize_fp8_weight(weight, weight_scale, mode).T).to(x.dtype)


def fp8_gemv_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       mode: ScaleMode) -> torch.Tensor:
    """What ``kernels/fp8_gemv.py`` returns for one row x (1, K): W dequantized, x kept in
    its 16 bits, ``F.linear`` in float32, rounded once to x's dtype."""
    return F.linear(x.float(), dequantize_fp8_weight(weight, weight_scale, mode)).to(x.dtype)


def fused_moe_fp8_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                            mode: ScaleMode) -> torch.Tensor:
    """What ``kernels/fused_moe.py`` returns for fp8 experts w13 (E, 2I, H), w2 (E, H, I) with
    their scales of ``mode`` (per expert as ``fp8_gemm_reference`` takes them): each expert's
    products as :func:`fp8_gemm_reference` computes them (x, then act, quantized per token and
    128-column group for "block", per token for "channel"), at the rounding points of
    :func:`fused_moe_reference`."""
    return _fp8_experts_reference(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, mode, w8a8=True)


def moe_gemv_fp8_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                           mode: ScaleMode) -> torch.Tensor:
    """What ``kernels/moe_gemv.py`` returns for fp8 experts (arguments as
    :func:`fused_moe_fp8_reference`'s): the weights dequantized, x and act kept in their 16
    bits (:func:`fp8_gemv_reference`'s products), at the rounding points of
    :func:`fused_moe_reference`."""
    return _fp8_experts_reference(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, mode, w8a8=False)


def _fp8_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                           mode: ScaleMode, *, w8a8: bool) -> torch.Tensor:
    """:func:`fused_moe_reference` with each expert's products by :func:`fp8_gemm_reference`
    (``w8a8``) or :func:`fp8_gemv_reference` in place of ``F.linear``."""
    linear = fp8_gemm_reference if w8a8 else fp8_gemv_reference
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == e)
        if token.numel() == 0:
            continue
        act = silu_and_mul_ref(linear(x[token], w13[e], w13_scale[e], mode))                     # (n, I)
        y = linear(act, w2[e], w2_scale[e], mode).float() * topk_weights[token, slot, None]    # (n, H)
        out.index_add_(0, token, y)
    return out.to(x.dtype)


def moe_reference(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  top_k: int, norm_topk_prob: bool) -> torch.Tensor:
    """(T, H) -> (T, H): this rank's partial sum of the routed experts, as transformers'
    ``Qwen3MoeSparseMoeBlock`` computes it: router logits in x's dtype, softmax and top-k in
    float32 (renormalised when ``norm_topk_prob``; ties to the lower expert, as the kernels:
    :func:`moe_topk_reference`), the weights back in x's dtype, each expert a SiLU-gated MLP
    over its tokens, weighted and summed per token."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the torch reference experts route on the host and cannot be captured in a "
                           "CUDA graph: use the Triton kernels or enforce_eager=True")
    weights, ids = moe_topk_reference(F.linear(x, router), top_k, norm_topk_prob)  # (T, k)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    local = down.shape[2]
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        gu = F.linear(x[token], gate_up[e])                                      # (n, 2 I_local)
        act = F.silu(gu[:, :local]) * gu[:, local:]
        y = F.linear(act, down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


# ---- Qwen3.5 (hybrid) ops: norms with a unit offset, gates, partial RoPE --------------------

def rms_norm_1p_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The zero-centred RMSNorm: ``(1 + weight) * x / rms(x)``, all in float32 and rounded once
    to x's dtype (transformers' Qwen3_5RMSNorm; a weight of 0 is the identity scale)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm_1p_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm_1p(x + residual), x + residual)``, the sum in the model dtype."""
    residual = x + residual
    return rms_norm_1p_ref(residual, weight, eps), residual


def rms_norm_gated_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The DeltaNet output norm: ``weight * rms_norm(x) * silu(gate)`` over the last dim of x
    (..., V); the norm as :func:`rms_norm_ref` rounds it, the gate product in float32, rounded
    once to x's dtype (transformers' Qwen3_5RMSNormGated)."""
    return (rms_norm_ref(x, weight, eps) * F.silu(gate.float())).to(x.dtype)


def sigmoid_mul_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` in x's dtype (gate broadcast: (T, N) or (T, 1)), as transformers'
    attention output gate and shared-expert gate."""
    return x * torch.sigmoid(gate)


def partial_rope_ref(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half layout) of the first R dims of every head of x (T, H, D), R the width of
    ``cos_sin_cache`` (P, R); the other D - R dims pass through. float32, rounded once."""
    rotary = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # (T, 1, R/2) each
    return torch.cat([_rotate(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)


def qk_norm_1p_rope_store_reference(
    q: torch.Tensor,              # (T, H, D)
    k: torch.Tensor,              # (T, Hkv, D)
    v: torch.Tensor,              # (T, Hkv, D)
    positions: torch.Tensor,      # (T,) int
    q_weight: torch.Tensor,       # (D,) zero-centred
    k_weight: torch.Tensor,       # (D,)
    eps: float,
    cos_sin_cache: torch.Tensor,  # (P, R) float32 [cos | sin], R <= D the rotated dims
    k_cache: torch.Tensor,        # (N, bs, Hkv, D)
    v_cache: torch.Tensor,        # (N, bs, Hkv, D)
    slot_mapping: torch.Tensor,   # (T,) int, -1 = write nothing
    k_scale: torch.Tensor | None = None,  # FP8 cache: (1,) float32
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Qwen3.5's attention input: zero-centred RMSNorm per head of q and k, RoPE of their first
    R dims, K/V stored (``store_kv_reference``); returns q (T, H, D)."""
    q, k = rms_norm_1p_ref(q, q_weight, eps), rms_norm_1p_ref(k, k_weight, eps)
    q, k = partial_rope_ref(positions, q, cos_sin_cache), partial_rope_ref(positions, k, cos_sin_cache)
    store_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q
