"""RMSNorm's weight and epsilon; the model runs it through ``Ops`` (``layers/ops.py``)."""

from __future__ import annotations

import torch
from torch import nn

from minivllm.kernels.reference import add_rms_norm_ref, rms_norm_ref
from minivllm.layers.linear import default_weight_loader, set_weight_loader


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    The statistics are computed in float32 and the normalised value is cast back to the
    input dtype *before* the weight multiply, as Hugging Face's Qwen3RMSNorm does, so bf16
    results round the same way. ``forward`` is the torch reference; the decoder calls
    ``Ops.rms_norm`` / ``Ops.add_rms_norm`` with this module's weight.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return rms_norm_ref(x, self.weight, self.eps)
        return add_rms_norm_ref(x, residual, self.weight, self.eps)
