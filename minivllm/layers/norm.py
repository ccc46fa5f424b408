"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from minivllm.layers import fuse
from minivllm.layers.all_reduce import all_reduce_add_rms_norm, defers_to_norm, pushed_row
from minivllm.layers.linear import LinearBase, default_weight_loader, set_weight_loader


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm_ref``; one Triton kernel on CUDA (``minivllm/kernels/rms_norm.py``)."""
    if fuse.use_kernels(x):
        from minivllm.kernels.rms_norm import rms_norm as kernel
        return kernel(x, weight, eps)  # type: ignore[return-value]
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm_ref``; one Triton kernel on CUDA."""
    if fuse.use_kernels(x):
        from minivllm.kernels.rms_norm import rms_norm as kernel
        return kernel(x, weight, eps, residual=residual)  # type: ignore[return-value]
    return add_rms_norm_ref(x, residual, weight, eps)


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    The statistics are computed in float32 and the normalised value is cast
    back to the input dtype *before* the weight multiply, as Hugging Face's
    Qwen3RMSNorm does, so bf16 results round the same way.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, reduces_input: bool = False) -> None:
        super().__init__()
        self.eps = eps
        # With a residual, ``x`` may be ranks' partial sums left by a row-parallel layer
        # built with ``reduce_in_next_norm``: then the fused kernel sums them here.
        self.reduces_input = reduces_input
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, *, warm: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x`` (..., hidden); with ``residual``, normalise ``x + residual``.

        Args:
            x: the input, (..., hidden_size).
            residual: the residual stream; when given, ``x + residual`` becomes
                the new residual stream and is returned with the normalised value.
            warm: the weight of the layer this norm feeds, where the fused all-reduce
                reduces ``x`` (it may ask L2 for some of it: ``all_reduce.warm_l2_bytes``).

        Returns:
            ``norm(x)``, or ``(norm(x + residual), x + residual)``.
        """
        if residual is None:
            return self._norm(x)
        if self.reduces_input and defers_to_norm(x):
            return all_reduce_add_rms_norm(x, residual, self.weight, self.eps, warm)
        return add_rms_norm(x, residual, self.weight, self.eps)

    def into(self, linear: LinearBase, x: torch.Tensor,
             residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(linear(norm(x + residual)), x + residual)``; residual None: ``(linear(norm(x)), x)``.

        One GEMV kernel where the layer takes the norm in (``linear.takes_normed``: a decode
        step at batch 1 on CUDA), so the norm costs no launch of its own; else this module,
        then the layer. Where ``x`` holds ranks' partial sums for this norm to reduce
        (``reduces_input``), the GEMV kernel sums them too if the layer before pushed them
        (``all_reduce.pushed_row``: batch 1), else the fused all-reduce + norm kernel keeps it.
        """
        reduces_here = residual is not None and self.reduces_input and defers_to_norm(x)
        if linear.takes_normed(x, self.weight, residual):
            pushed = pushed_row(x) if reduces_here else None
            if not reduces_here or pushed is not None:  # a pushed row: the GEMV sums the ranks' slots
                return linear.normed(x, residual, self.weight, self.eps, pushed=pushed)
        if residual is None:
            return linear(self(x)), x
        h, residual = self(x, residual, warm=linear.weight)
        return linear(h), residual
