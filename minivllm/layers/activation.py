"""The gated activation of the Qwen3 MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.layers.fuse import fused


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = [gate | up]`` packed along the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., 2I) -> (..., I)
        return silu_and_mul(x)


@fused
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` (one fused kernel on CUDA)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
