"""The causal conv's kernel against the torch reference (under Triton's interpreter): one
input per sequence (decode) and varlen chunks shorter and longer than the kernel, the conv
state rewritten in place at the step's slots only, save points (inside a sequence, before its
(K - 1)-th token, at its end), fresh starts ignoring what a slot held, strided rows, and
argument checks."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels.causal_conv1d import causal_conv1d
from minivllm.kernels.linear_attention_reference import causal_conv1d_reference, save_points

ENTRIES = 9


@pytest.mark.parametrize("lens,c,k,dtype,saves", [
    ([1, 1, 1], 40, 4, torch.float32, None),                              # decode
    ([1, 1], 300, 3, torch.float32, None),                                # two channel tiles
    ([1, 1, 1, 1], 64, 2, torch.float32, None),
    ([5, 2, 1], 48, 4, torch.float32, [(0, 1, 6), (0, 4, 7), (1, 2, 8)]),  # varlen, saves
    ([3, 6], 16, 4, torch.bfloat16, [(1, 5, 8)]),
])
def test_conv_is_the_reference(lens: list[int], c: int, k: int, dtype: torch.dtype, saves) -> None:
    gen = torch.Generator().manual_seed(sum(lens) * c + k)
    t = sum(lens)
    x = torch.randn(t, 2 * c, generator=gen).to(dtype)[:, :c]          # strided rows
    weight = torch.randn(c, k, generator=gen).to(dtype)
    state = torch.randn(ENTRIES, c, k - 1, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    slots, init = torch.tensor([4, 0, 5, 2][:len(lens)]), torch.tensor([False, True, True, False][:len(lens)])
    rows, offsets, entries = (torch.tensor(a, dtype=torch.int64) for a in zip(*saves)) if saves else (None,) * 3
    want_state, got_state = state.clone(), state.clone()
    want = causal_conv1d_reference(x, weight, want_state, cu, slots, init, save_points(rows, offsets, entries))
    got = causal_conv1d(x, weight, got_state, cu, slots, init, rows, offsets, entries)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_state, want_state)
    written = slots.tolist() + ([] if entries is None else entries.tolist())
    untouched = [e for e in range(ENTRIES) if e not in written]
    assert torch.equal(got_state[untouched], state[untouched])


def test_bad_arguments_are_named() -> None:
    x, w, s = torch.randn(2, 8), torch.randn(8, 4), torch.zeros(2, 8, 3)
    cu, slots, init = torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.tensor([True, True])
    with pytest.raises(ValueError, match="weight must be"):
        causal_conv1d(x, torch.randn(8, 9), s, cu, slots, init)
    with pytest.raises(ValueError, match="conv_state must be"):
        causal_conv1d(x, w, torch.zeros(2, 8, 2), cu, slots, init)
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        causal_conv1d(x, w, s, cu[:2], slots, init)
    with pytest.raises(TypeError, match="x must have dtype"):
        causal_conv1d(x.long(), w, s, cu, slots, init)


def test_a_padding_row_runs_from_zeros_and_writes_no_state() -> None:
    """Slot -1 (a CUDA graph's padding row): its output is a fresh start's, no entry changes,
    and the row beside it is as without it."""
    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(2, 16, generator=gen), torch.randn(16, 4, generator=gen)
    state = torch.randn(ENTRIES, 16, 3, generator=gen)
    cu, init = torch.tensor([0, 1, 2]), torch.tensor([True, True])
    padded_state, alone_state, fresh_state = state.clone(), state.clone(), state.clone()
    padded = causal_conv1d(x, weight, padded_state, cu, torch.tensor([3, -1]), init)
    alone = causal_conv1d(x[:1], weight, alone_state, cu[:2], torch.tensor([3]), init[:1])
    fresh = causal_conv1d(x[1:], weight, fresh_state, cu[:2], torch.tensor([5]), torch.tensor([False]))
    assert torch.equal(padded_state, alone_state)
    torch.testing.assert_close(padded[:1], alone)
    torch.testing.assert_close(padded[1:], fresh)
