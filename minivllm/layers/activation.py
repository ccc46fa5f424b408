"""The gated activation of the Qwen3 MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.layers import fuse


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = [gate | up]`` packed along the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., 2I) -> (..., I)
        return silu_and_mul(x)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]``, in x's dtype (each op rounds, as HF's)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul_ref``; one Triton kernel on CUDA (``minivllm/kernels/silu_and_mul.py``)."""
    if fuse.use_kernels(x):
        from minivllm.kernels.silu_and_mul import silu_and_mul as kernel
        return kernel(x)
    return silu_and_mul_ref(x)
