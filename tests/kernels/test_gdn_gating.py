"""The Gated DeltaNet's gates (``kernels/gdn_gating.py``) against the torch reference under the
interpreter: strided (T, H) slices of a packed projection, softplus on both sides of its
threshold, heads that are not a power of two, 16-bit b.

Planted and seen to fail: softplus without its linear branch above 20 (exp overflows float32
near 89, and g becomes -inf): ``test_large_arguments_stay_finite``; beta from a instead of b,
or g without the ``-exp(A_log)`` factor: ``test_matches_reference``."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels.gdn_gating import gdn_gating
from minivllm.kernels.linear_attention_reference import gdn_gating_reference


def _problem(t: int, h: int, dtype: torch.dtype, scale: float = 3.0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(t * 31 + h)
    packed = (torch.randn(t, 3 * h + 5, generator=gen) * scale).to(dtype)   # [.. | b | a | ..] rows
    b, a = packed[:, 2:2 + h], packed[:, 2 + h:2 + 2 * h]
    a_log = torch.randn(h, generator=gen) * 0.5
    dt_bias = torch.randn(h, generator=gen)
    return a, b, a_log.to(dtype), dt_bias.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h", [(1, 32), (37, 6), (16, 16)])
def test_matches_reference(t: int, h: int, dtype: torch.dtype) -> None:
    a, b, a_log, dt_bias = _problem(t, h, dtype)
    g, beta = gdn_gating(a, b, a_log, dt_bias)
    g_ref, beta_ref = gdn_gating_reference(a, b, a_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(beta, beta_ref, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=0)


def test_large_arguments_stay_finite() -> None:
    """a + dt_bias up to 120: softplus is the argument itself there, as torch's."""
    a, b, a_log, dt_bias = _problem(8, 4, torch.float32, scale=40.0)
    g, _ = gdn_gating(a, b, a_log, dt_bias)
    g_ref, _ = gdn_gating_reference(a, b, a_log, dt_bias)
    assert (a + dt_bias).max() > 60 and torch.isfinite(g).all()
    torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_named() -> None:
    a, b, a_log, dt_bias = _problem(4, 4, torch.float32)
    with pytest.raises(ValueError, match="a_log"):
        gdn_gating(a, b, a_log[:3], dt_bias)
    with pytest.raises(TypeError, match="b must have dtype"):
        gdn_gating(a, b.to(torch.int32), a_log, dt_bias)
