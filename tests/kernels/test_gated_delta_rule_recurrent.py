"""The gated delta rule's recurrent kernel against the token-by-token torch reference (under
Triton's interpreter on the CPU): one token per sequence (decode) and varlen chunks, state
updated in place at the step's slots only, save points inside and at the end of a sequence,
fresh starts ignoring what a slot held, grouped q/k heads, value tiles narrower than V,
views of a packed projection, and argument checks."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels.gated_delta_rule_recurrent import gated_delta_rule_recurrent
from minivllm.kernels.linear_attention_reference import gated_delta_rule_recurrent_reference, save_points
from tests.kernels.problems import make_delta_rule_problem

ENTRIES = 9


def _inputs(t: int, hk: int, h: int, kd: int, vd: int, dtype: torch.dtype, seed: int = 0):
    return make_delta_rule_problem(t, hk, h, kd, vd, dtype, seed, ENTRIES, max_decay=2)


def _both(q, k, v, g, beta, state, lens, slots, init, saves=None):
    """(kernel's out and state, reference's out and state) from copies of ``state``."""
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    slots, init = torch.tensor(slots), torch.tensor(init)
    rows, offsets, entries = (torch.tensor(x, dtype=torch.int64) for x in zip(*saves)) if saves else (None,) * 3
    got_state, want_state = state.clone(), state.clone()
    got = gated_delta_rule_recurrent(q, k, v, g, beta, got_state, cu, slots, init, rows, offsets, entries)
    want = gated_delta_rule_recurrent_reference(q, k, v, g, beta, want_state, cu, slots, init,
                                                save_points(rows, offsets, entries))
    return (got, got_state), (want, want_state)


@pytest.mark.parametrize("lens,hk,h,kd,vd,dtype", [
    ([1, 1, 1], 2, 4, 16, 16, torch.float32),                     # decode
    ([5, 1, 3], 1, 2, 32, 96, torch.float32),                     # varlen, two value tiles
    ([1, 1, 1, 1], 2, 2, 16, 32, torch.bfloat16),
])
def test_kernel_is_the_recurrence(lens: list[int], hk: int, h: int, kd: int, vd: int, dtype: torch.dtype) -> None:
    q, k, v, g, beta, state = _inputs(sum(lens), hk, h, kd, vd, dtype)
    slots, init = [5, 0, 2, 4][:len(lens)], [False, True, False, True][:len(lens)]
    (got, got_state), (want, want_state) = _both(q, k, v, g, beta, state, lens, slots, init)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)
    untouched = [e for e in range(ENTRIES) if e not in slots]
    assert torch.equal(got_state[untouched], state[untouched])


def test_save_points_inside_and_at_the_end_of_sequences() -> None:
    """Saves given out of order: after 2 and 5 of sequence 0's 6 tokens, after all 3 of
    sequence 2's; each entry holds the state there, and the slots the final states."""
    lens = [6, 2, 3]
    q, k, v, g, beta, state = _inputs(sum(lens), 1, 2, 16, 16, torch.float32, seed=1)
    saves = [(2, 3, 8), (0, 5, 6), (0, 2, 7)]
    (got, got_state), (want, want_state) = _both(q, k, v, g, beta, state, lens, [0, 1, 2], [False, True, True], saves)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_state, want_state)
    assert not torch.equal(got_state[6], state[6]) and not torch.equal(got_state[7], got_state[6])
    # the save after all of sequence 2's tokens is its final state
    torch.testing.assert_close(got_state[8], got_state[2])


def test_views_of_a_packed_projection() -> None:
    """q, k and v as the layer has them: views into one (T, 2 Hk K + H V) row each."""
    t, hk, h, kd, vd = 4, 2, 4, 16, 8
    q, k, v, g, beta, state = _inputs(t, hk, h, kd, vd, torch.float32)
    packed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)
    qv, kv, vv = packed.split([hk * kd, hk * kd, h * vd], dim=1)
    cu, slots, init = torch.tensor([0, 1, 3, 4]), torch.tensor([3, 1, 0]), torch.tensor([True, False, True])
    want_state, got_state = state.clone(), state.clone()
    want = gated_delta_rule_recurrent(q, k, v, g, beta, want_state, cu, slots, init)
    got = gated_delta_rule_recurrent(qv.reshape(t, hk, kd), kv.reshape(t, hk, kd), vv.reshape(t, h, vd), g, beta,
                                     got_state, cu, slots, init)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_state, want_state)


def test_a_fresh_start_ignores_the_slot_and_a_continued_one_reads_it() -> None:
    q, k, v, g, beta, state = _inputs(1, 1, 1, 16, 16, torch.float32)
    zero = torch.zeros_like(state)
    outs = {}
    for name, s, fresh in (("fresh", state.clone(), True), ("zero", zero.clone(), False),
                           ("continued", state.clone(), False)):
        outs[name] = gated_delta_rule_recurrent(q, k, v, g, beta, s, torch.tensor([0, 1]), torch.tensor([0]),
                                                torch.tensor([not fresh]))
    torch.testing.assert_close(outs["fresh"], outs["zero"])
    assert not torch.allclose(outs["fresh"], outs["continued"])


def test_bad_arguments_are_named() -> None:
    q, k, v, g, beta, state = _inputs(2, 1, 2, 16, 16, torch.float32)
    cu, slots, init = torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.tensor([True, True])
    with pytest.raises(TypeError, match="state must be float32"):
        gated_delta_rule_recurrent(q, k, v, g, beta, state.half(), cu, slots, init)
    with pytest.raises(ValueError, match="state must be"):
        gated_delta_rule_recurrent(q, k, v, g, beta, state[:, :1], cu, slots, init)
    with pytest.raises(ValueError, match="shapes disagree"):
        gated_delta_rule_recurrent(q, k[:1], v, g, beta, state, cu, slots, init)
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        gated_delta_rule_recurrent(q, k, v, g, beta, state, cu[:2], slots, init)


def test_a_padding_row_runs_from_zeros_and_writes_no_state() -> None:
    """Slot -1 (a CUDA graph's padding row): its output is a fresh start's, no entry changes,
    and the row beside it is as without it."""
    q, k, v, g, beta, state = _inputs(2, 1, 2, 16, 16, torch.float32, seed=2)
    cu, init = torch.tensor([0, 1, 2]), torch.tensor([True, True])
    padded_state, alone_state, fresh_state = state.clone(), state.clone(), state.clone()
    padded = gated_delta_rule_recurrent(q, k, v, g, beta, padded_state, cu, torch.tensor([3, -1]), init)
    alone = gated_delta_rule_recurrent(q[:1], k[:1], v[:1], g[:1], beta[:1], alone_state, cu[:2],
                                       torch.tensor([3]), init[:1])
    fresh = gated_delta_rule_recurrent(q[1:], k[1:], v[1:], g[1:], beta[1:], fresh_state, cu[:2],
                                       torch.tensor([5]), torch.tensor([False]))
    assert torch.equal(padded_state, alone_state)
    torch.testing.assert_close(padded[:1], alone)
    torch.testing.assert_close(padded[1:], fresh)
