"""Problems shared by the kernel tests on the CPU (under the interpreter) and on the GPU.

No interpreter switch here: ``tests_gpu`` imports this module, and an import that set
``TRITON_INTERPRET`` would turn every kernel decorated after it into interpreted code."""

from __future__ import annotations

import torch


def cos_sin_table(head_dim: int, max_position: int, base: float) -> torch.Tensor:
    """The (P, D) float32 [cos | sin] table of plain RoPE, as the rotary layer builds it."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # (P, D/2)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def make_qk_norm_problem(
    t: int, h: int, hkv: int, d: int, dtype: torch.dtype, gen: torch.Generator, exact_sums: bool = False,
    norm: bool = True,
) -> tuple[list, list]:
    """Arguments of ``qk_norm_rope_store`` and a deep copy for the reference.

    ``exact_sums``: QKV entries are multiples of 1/4 in [-1, 1], so every head's sum of
    squares is exact in any order (the one place the kernel may round differently).
    ``norm=False``: no q/k norm weights (Qwen2, Llama): RoPE and the store only."""
    width = (h + 2 * hkv) * d
    if exact_sums:
        qkv = torch.randint(-4, 5, (t, width), generator=gen) * 0.25
    else:
        qkv = torch.randn(t, width, generator=gen) * 3
    q_weight = 1 + 0.5 * torch.randn(d, generator=gen)
    k_weight = 1 + 0.5 * torch.randn(d, generator=gen)
    max_pos = 200
    positions = torch.randint(0, max_pos, (t,), generator=gen)
    cos_sin = cos_sin_table(d, max_pos, 10_000.0)
    n, bs = 3 * t + 2, 4
    slots = torch.randperm(n * bs, generator=gen)[:t]
    slots[1::3] = -1
    k_cache = torch.randn(n, bs, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(n, bs, hkv, d, generator=gen).to(dtype)
    weights = [q_weight.to(dtype), k_weight.to(dtype)] if norm else [None, None]
    args = [qkv.to(dtype), positions, *weights, 1e-6, cos_sin, k_cache, v_cache, slots]
    ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    return args, ref_args


def make_qk_norm_1p_problem(
    t: int, h: int, hkv: int, d: int, rotary: int, dtype: torch.dtype, gen: torch.Generator,
    exact_sums: bool = False, kv_dtype: torch.dtype | None = None,
) -> tuple[list, list]:
    """Arguments of ``qk_norm_1p_rope_store`` and a deep copy for the reference, q, k and v as
    the Qwen3.5 layer passes them: views of one projection row ``[q0 g0 q1 g1 .. | k | v]``
    (each query head beside its gate head), so q's heads are 2 D apart and no view is
    contiguous. RoPE over the first ``rotary`` dims; every third slot -1.

    ``exact_sums``: entries are multiples of 1/4 in [-1, 1] (every head's sum of squares exact
    in any order). ``kv_dtype``: the cache's dtype (default ``dtype``); e4m3 brings scales."""
    width = (2 * h + 2 * hkv) * d
    if exact_sums:
        qkv = torch.randint(-4, 5, (t, width), generator=gen) * 0.25
    else:
        qkv = torch.randn(t, width, generator=gen) * 3
    q_weight = 0.3 * torch.randn(d, generator=gen)
    k_weight = 0.3 * torch.randn(d, generator=gen)
    max_pos = 200
    positions = torch.randint(0, max_pos, (t,), generator=gen)
    cos_sin = cos_sin_table(rotary, max_pos, 10_000.0)
    n, bs = 3 * t + 2, 4
    slots = torch.randperm(n * bs, generator=gen)[:t]
    slots[1::3] = -1
    kv_dtype = kv_dtype or dtype
    k_cache = torch.randn(n, bs, hkv, d, generator=gen).to(kv_dtype)
    v_cache = torch.randn(n, bs, hkv, d, generator=gen).to(kv_dtype)
    scales = [torch.tensor([0.05]), torch.tensor([0.02])] if kv_dtype == torch.float8_e4m3fn else [None, None]
    qkv = qkv.to(dtype)
    q = qkv[:, :2 * h * d].view(t, h, 2 * d)[..., :d]
    k = qkv[:, 2 * h * d:(2 * h + hkv) * d].view(t, hkv, d)
    v = qkv[:, (2 * h + hkv) * d:].view(t, hkv, d)
    args = [q, k, v, positions, q_weight.to(dtype), k_weight.to(dtype), 1e-6, cos_sin, k_cache, v_cache, slots,
            *scales]
    ref_args = [a.clone() if isinstance(a, torch.Tensor) and a.dim() != 3 else a for a in args]
    return args, ref_args


def make_delta_rule_problem(t: int, hk: int, h: int, kd: int, vd: int, dtype: torch.dtype, seed: int = 0,
                            entries: int = 9, max_decay: float = 2.0) -> tuple[torch.Tensor, ...]:
    """Inputs of the gated delta rule's kernels: q, k (t, hk, kd) and v (t, h, vd) in ``dtype``,
    float32 log decays g in (-max_decay, 0], beta (t, h) in ``dtype``, and a float32 state of
    ``entries`` entries holding garbage (random values where nobody resets)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(t, hk, kd, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(t, h, vd, generator=gen).to(dtype)
    g = -torch.rand(t, h, generator=gen) * max_decay
    beta = torch.rand(t, h, generator=gen).to(dtype)
    state = torch.randn(entries, h, kd, vd, generator=gen)
    return q, k, v, g, beta, state

