"""The causal conv's decode kernel against the torch reference (under Triton's interpreter):
one input per sequence, the conv state shifted in place at the step's slots only, fresh starts
ignoring what a slot held, kernel widths 2..4, strided rows, and argument checks."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels.causal_conv1d_decode import causal_conv1d_decode
from minivllm.kernels.linear_attention_reference import causal_conv1d_reference


@pytest.mark.parametrize("b,c,k,dtype", [(3, 40, 4, torch.float32), (2, 300, 3, torch.float32),
                                         (4, 64, 2, torch.float32), (3, 48, 4, torch.bfloat16)])
def test_decode_conv_is_the_reference(b: int, c: int, k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(b * c + k)
    x = torch.randn(b, 2 * c, generator=gen).to(dtype)[:, :c]          # strided rows
    weight = torch.randn(c, k, generator=gen).to(dtype)
    state = torch.randn(6, c, k - 1, generator=gen).to(dtype)
    slots, init = torch.tensor([4, 0, 5, 2][:b]), torch.tensor([False, True, True, False][:b])
    want_state, got_state = state.clone(), state.clone()
    want = causal_conv1d_reference(x, weight, want_state, torch.arange(b + 1), slots, init)
    got = causal_conv1d_decode(x, weight, got_state, slots, init)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_state, want_state)
    untouched = [e for e in range(6) if e not in slots.tolist()]
    assert torch.equal(got_state[untouched], state[untouched])


def test_bad_arguments_are_named() -> None:
    x, w, s = torch.randn(2, 8), torch.randn(8, 4), torch.zeros(2, 8, 3)
    slots, init = torch.tensor([0, 1]), torch.tensor([True, True])
    with pytest.raises(ValueError, match="weight must be"):
        causal_conv1d_decode(x, torch.randn(8, 9), s, slots, init)
    with pytest.raises(ValueError, match="conv_state must be"):
        causal_conv1d_decode(x, w, torch.zeros(2, 8, 2), slots, init)
    with pytest.raises(TypeError, match="x must have dtype"):
        causal_conv1d_decode(x.long(), w, s, slots, init)
