"""RMSNorm's weight and epsilon; the model runs the norm through ``Ops`` (``ops/dispatch.py``)."""

from __future__ import annotations

import torch
from torch import nn

from minivllm.layers.weights import default_weight_loader, set_weight_loader


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    The weight holder: the decoder calls ``Ops.rms_norm`` / ``Ops.add_rms_norm`` with this
    module's weight and epsilon (statistics in float32, the normalised value cast back to the
    input dtype before the weight multiply, as Hugging Face's Qwen3RMSNorm does).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)


class RMSNorm1p(nn.Module):
    """The zero-centred RMSNorm ``(1 + weight) * x / sqrt(mean(x^2) + eps)`` (Qwen3.5's layer,
    final and q/k norms): the weight holder for ``Ops.rms_norm_1p`` / ``Ops.add_rms_norm_1p``.

    Kept apart from ``RMSNorm`` rather than folded into its weight as ``1 + w`` at load: the
    sum is taken in float32 at every call, as transformers does; a 16-bit ``1 + w`` would
    round it away. A weight of 0 is the unit scale (its dummy fill, ``fill_value``).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.weight.fill_value = 0.0  # type: ignore[attr-defined]  # load_format="dummy": the unit scale
        set_weight_loader(self.weight, default_weight_loader)
