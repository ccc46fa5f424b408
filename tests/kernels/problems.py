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
