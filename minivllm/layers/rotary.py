"""Rotary position embedding (RoPE), neox / half-rotation style as in Qwen3.

For a head vector ``x = [x1 | x2]`` (two halves of D/2) at position p::

    x1' = x1 * cos(p f) - x2 * sin(p f)
    x2' = x2 * cos(p f) + x1 * sin(p f)        f_i = theta ** (-2i / D)

which is Hugging Face's ``x * cos + rotate_half(x) * sin``. The cos/sin table is
built once, in float32, for every position below ``max_position`` and indexed
by the positions the caller passes (from the plan), never derived from
sequence lengths.

Llama 3.1's scaling (``Llama3RopeScaling``) changes only the frequencies, so
it lives entirely in the table: every consumer of ``cos_sin_cache`` (the torch
path, the fused q/k-norm + RoPE kernel) applies it without knowing. With
``L`` the pre-training context and wavelength ``w_i = 2 pi / f_i``::

    w_i < L / high_freq_factor:   f_i                        (high frequencies: unchanged)
    w_i > L / low_freq_factor:    f_i / factor               (low frequencies: slowed)
    otherwise:                    (1 - s) f_i / factor + s f_i,
                                  s = (L / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor)
"""

from __future__ import annotations

import math

import torch
from torch import nn

from minivllm.config import Llama3RopeScaling


class RotaryEmbedding(nn.Module):
    """RoPE's position-indexed cos/sin table, which the fused q/k-norm + RoPE op
    (``Ops.qk_norm_rope_store``) reads, and the check of the positions it is indexed by.

    Args:
        head_dim: D, even.
        max_position: number of positions in the cache (max_position_embeddings).
        base: theta.
        scaling: Llama 3.1 frequency scaling, or None for plain RoPE.

    Raises:
        ValueError: odd ``head_dim`` or non-positive ``max_position``.
    """

    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: Llama3RopeScaling | None = None) -> None:
        super().__init__()
        if head_dim % 2 or max_position < 1:
            raise ValueError(f"need an even head_dim and max_position >= 1, got {head_dim}, {max_position}")
        self.head_dim = head_dim
        self.max_position = max_position
        # Same float32 arithmetic as HF, so float32 results agree bit for bit.
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if scaling is not None:
            inv_freq = llama3_scaled_frequencies(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # (P, D/2)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)                          # (P, D)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def check_positions(self, positions: torch.Tensor) -> None:
        """Raise ``ValueError`` for a position outside the cache (CPU tensors only:
        checking a device tensor would sync the host every step)."""
        if positions.device.type == "cpu" and positions.numel() and (
                int(positions.min()) < 0 or int(positions.max()) >= self.max_position):
            raise ValueError(
                f"positions must be in [0, {self.max_position}) (max_position_embeddings), got "
                f"[{int(positions.min())}, {int(positions.max())}]"
            )


def llama3_scaled_frequencies(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1's frequency scaling of ``inv_freq`` (D/2,) float32 (formula in the module docstring).

    Computed in float32 as written there, so the frequencies equal Hugging Face's.
    """
    context = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    slowed = inv_freq / scaling.factor
    s = (context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    between = (1 - s) * slowed + s * inv_freq
    scaled = torch.where(wavelen > context / scaling.low_freq_factor, slowed, between)
    return torch.where(wavelen < context / scaling.high_freq_factor, inv_freq, scaled)
