"""The gated delta rule's decode kernel against the token-by-token torch reference (under
Triton's interpreter on the CPU): state updated in place at the step's slots only, fresh starts
ignoring what a slot held, grouped q/k heads, value tiles narrower than V, and argument checks."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels.gated_delta_rule_decode import gated_delta_rule_decode
from minivllm.kernels.linear_attention_reference import gated_delta_rule_recurrent_reference


def _inputs(b: int, hk: int, h: int, kd: int, vd: int, entries: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, hk, kd, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(b, h, vd, generator=gen).to(dtype)
    g = -torch.rand(b, h, generator=gen) * 2                   # log decay <= 0
    beta = torch.rand(b, h, generator=gen).to(dtype)
    state = torch.randn(entries, h, kd, vd, generator=gen)     # garbage in the slots nobody resets
    return q, k, v, g, beta, state


@pytest.mark.parametrize("b,hk,h,kd,vd,dtype", [(3, 2, 4, 16, 16, torch.float32), (2, 1, 2, 32, 96, torch.float32),
                                                 (4, 2, 2, 16, 32, torch.bfloat16)])
def test_decode_kernel_is_the_recurrence(b: int, hk: int, h: int, kd: int, vd: int, dtype: torch.dtype) -> None:
    q, k, v, g, beta, state = _inputs(b, hk, h, kd, vd, entries=7, dtype=dtype)
    slots = torch.tensor([5, 0, 2, 4][:b])
    fresh = torch.tensor([True, False, True, False][:b])
    want_state, got_state = state.clone(), state.clone()
    want = gated_delta_rule_recurrent_reference(q, k, v, g, beta, want_state, torch.arange(b + 1), slots, fresh)
    got = gated_delta_rule_decode(q, k, v, g, beta, got_state, slots, fresh)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)
    untouched = [e for e in range(7) if e not in slots.tolist()]
    assert torch.equal(got_state[untouched], state[untouched])


def test_views_of_a_packed_projection() -> None:
    """q, k and v as the layer has them: views into one (B, 2 Hk K + H V) row each."""
    b, hk, h, kd, vd = 3, 2, 4, 16, 8
    q, k, v, g, beta, state = _inputs(b, hk, h, kd, vd, entries=4, dtype=torch.float32)
    packed = torch.cat([q.reshape(b, -1), k.reshape(b, -1), v.reshape(b, -1)], dim=1)
    qv, kv, vv = packed.split([hk * kd, hk * kd, h * vd], dim=1)
    slots, init = torch.tensor([3, 1, 0]), torch.tensor([True, False, True])
    want_state, got_state = state.clone(), state.clone()
    want = gated_delta_rule_decode(q, k, v, g, beta, want_state, slots, init)
    got = gated_delta_rule_decode(qv.reshape(b, hk, kd), kv.reshape(b, hk, kd), vv.reshape(b, h, vd), g, beta,
                                  got_state, slots, init)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_state, want_state)


def test_a_fresh_start_ignores_the_slot_and_a_continued_one_reads_it() -> None:
    q, k, v, g, beta, state = _inputs(1, 1, 1, 16, 16, entries=1, dtype=torch.float32)
    zero = torch.zeros_like(state)
    outs = {}
    for name, s, fresh in (("fresh", state.clone(), True), ("zero", zero.clone(), False),
                           ("continued", state.clone(), False)):
        outs[name] = gated_delta_rule_decode(q, k, v, g, beta, s, torch.tensor([0]), torch.tensor([not fresh]))
    torch.testing.assert_close(outs["fresh"], outs["zero"])
    assert not torch.allclose(outs["fresh"], outs["continued"])


def test_bad_arguments_are_named() -> None:
    q, k, v, g, beta, state = _inputs(2, 1, 2, 16, 16, entries=2, dtype=torch.float32)
    slots, init = torch.tensor([0, 1]), torch.tensor([True, True])
    with pytest.raises(TypeError, match="state must be float32"):
        gated_delta_rule_decode(q, k, v, g, beta, state.half(), slots, init)
    with pytest.raises(ValueError, match="state must be"):
        gated_delta_rule_decode(q, k, v, g, beta, state[:, :1], slots, init)
    with pytest.raises(ValueError, match="shapes disagree"):
        gated_delta_rule_decode(q, k[:1], v, g, beta, state, slots, init)
