"""The gated delta rule's chunked kernel against the token-by-token torch reference (under
Triton's interpreter on the CPU), with small chunks so that sequences are shorter than, as long
as, and several times a chunk: varlen steps with grouped q/k heads, value tiles narrower than V
and a K that is no power of two; save points inside a chunk, at a chunk boundary and at a
sequence's end; fresh starts ignoring a NaN slot; bf16 inputs; views of a packed projection;
keys repeated along a sequence (the triangular solve's worst case); argument checks."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels.gated_delta_rule_chunked import dot_precision, gated_delta_rule_chunked
from minivllm.kernels.linear_attention_reference import gated_delta_rule_recurrent_reference, save_points
from tests.kernels.problems import make_delta_rule_problem

ENTRIES = 9
CHUNK = 16
F32 = dict(atol=1e-5, rtol=1e-5)


def _inputs(t: int, hk: int, h: int, kd: int, vd: int, dtype: torch.dtype, seed: int = 0):
    return make_delta_rule_problem(t, hk, h, kd, vd, dtype, seed, ENTRIES, max_decay=0.5)


def _both(q, k, v, g, beta, state, lens, slots, init, saves=None, **tiles):
    """(kernel's out and state, reference's out and state) from copies of ``state``."""
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    slots, init = torch.tensor(slots), torch.tensor(init)
    rows, offsets, entries = (torch.tensor(x, dtype=torch.int64) for x in zip(*saves)) if saves else (None,) * 3
    got_state, want_state = state.clone(), state.clone()
    got = gated_delta_rule_chunked(q, k, v, g, beta, got_state, cu, slots, init, rows, offsets, entries, **tiles)
    want = gated_delta_rule_recurrent_reference(q, k, v, g, beta, want_state, cu, slots, init,
                                                save_points(rows, offsets, entries))
    return (got, got_state), (want, want_state)


@pytest.mark.parametrize("lens,hk,h,kd,vd,dtype,tiles", [
    ([5, 16, 45], 2, 4, 16, 16, torch.float32, dict(chunk=CHUNK)),        # < =, ~3x a chunk; H = 2 Hk
    ([3, 1, 21], 1, 2, 24, 40, torch.float32, dict(chunk=CHUNK, block_v=16)),  # 3 value tiles, K 24
    ([70, 2], 1, 1, 16, 32, torch.float32, {}),                            # the default chunk
    ([4, 19], 1, 2, 16, 32, torch.bfloat16, dict(chunk=CHUNK)),
])
def test_kernel_is_the_recurrence(lens: list[int], hk: int, h: int, kd: int, vd: int, dtype: torch.dtype,
                                  tiles: dict[str, int]) -> None:
    q, k, v, g, beta, state = _inputs(sum(lens), hk, h, kd, vd, dtype)
    slots, init = [5, 0, 2][:len(lens)], [False, True, True][:len(lens)]
    (got, got_state), (want, want_state) = _both(q, k, v, g, beta, state, lens, slots, init, **tiles)
    torch.testing.assert_close(got, want, **(F32 if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
    torch.testing.assert_close(got_state, want_state, **F32)
    untouched = [e for e in range(ENTRIES) if e not in slots]
    assert torch.equal(got_state[untouched], state[untouched])


def test_save_points_inside_at_a_boundary_and_at_the_end_of_a_chunk() -> None:
    """Saves given out of order (chunks of 16): sequence 0 (40 tokens) after 5 (inside its
    first chunk), 16 (a chunk boundary) and 27 (inside its second chunk, which then resumes
    there); sequence 2 after all its 9 tokens. Each entry holds the state there."""
    lens = [40, 3, 9]
    q, k, v, g, beta, state = _inputs(sum(lens), 1, 2, 16, 16, torch.float32, seed=1)
    saves = [(2, 9, 8), (0, 27, 6), (0, 5, 7), (0, 16, 4)]
    (got, got_state), (want, want_state) = _both(q, k, v, g, beta, state, lens, [0, 1, 2], [False, True, True],
                                                 saves, chunk=CHUNK)
    torch.testing.assert_close(got, want, **F32)
    torch.testing.assert_close(got_state, want_state, **F32)
    assert len({got_state[e].sum().item() for e in (4, 6, 7)}) == 3
    torch.testing.assert_close(got_state[8], got_state[2])


def test_repeated_keys_stay_exact() -> None:
    """One key (plus noise) over 40 tokens, beta 1, no decay: the triangular system's entries
    come near 1, where a power series of A loses float32's precision."""
    t = 40
    q, k, v, g, beta, state = _inputs(t, 1, 1, 16, 16, torch.float32, seed=2)
    k = k[:1].expand(t, -1, -1) + 1e-2 * k
    (got, got_state), (want, want_state) = _both(q, k, v, torch.zeros_like(g), torch.ones_like(beta), state,
                                                 [t], [0], [True], chunk=CHUNK)
    torch.testing.assert_close(got, want, **F32)
    torch.testing.assert_close(got_state, want_state, **F32)


def test_views_of_a_packed_projection() -> None:
    """q, k and v as the layer has them: views into one (T, 2 Hk K + H V) row each."""
    t, hk, h, kd, vd = 20, 2, 4, 16, 16
    q, k, v, g, beta, state = _inputs(t, hk, h, kd, vd, torch.float32)
    packed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)
    qv, kv, vv = packed.split([hk * kd, hk * kd, h * vd], dim=1)
    cu, slots, init = torch.tensor([0, 3, 20]), torch.tensor([3, 1]), torch.tensor([True, False])
    want_state, got_state = state.clone(), state.clone()
    want = gated_delta_rule_chunked(q, k, v, g, beta, want_state, cu, slots, init, chunk=CHUNK)
    got = gated_delta_rule_chunked(qv.reshape(t, hk, kd), kv.reshape(t, hk, kd), vv.reshape(t, h, vd), g, beta,
                                   got_state, cu, slots, init, chunk=CHUNK)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_state, want_state)


def test_a_fresh_start_ignores_a_nan_slot_and_a_continued_one_reads_it() -> None:
    q, k, v, g, beta, state = _inputs(20, 1, 1, 16, 16, torch.float32)
    cu, slots = torch.tensor([0, 20]), torch.tensor([0])
    nan, zero = torch.full_like(state, float("nan")), torch.zeros_like(state)
    outs = {}
    for name, s, fresh in (("fresh", nan, True), ("zero", zero, False), ("continued", state.clone(), False)):
        outs[name] = gated_delta_rule_chunked(q, k, v, g, beta, s, cu, slots, torch.tensor([not fresh]), chunk=CHUNK)
    torch.testing.assert_close(outs["fresh"], outs["zero"])
    torch.testing.assert_close(nan[0], zero[0])
    assert not torch.allclose(outs["fresh"], outs["continued"])


def test_bad_arguments_are_named() -> None:
    q, k, v, g, beta, state = _inputs(2, 1, 2, 16, 16, torch.float32)
    cu, slots, init = torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.tensor([True, True])
    with pytest.raises(ValueError, match="chunk must be a power of two >= 16"):
        gated_delta_rule_chunked(q, k, v, g, beta, state, cu, slots, init, chunk=24)
    with pytest.raises(ValueError, match="block_v must be a power of two >= 16"):
        gated_delta_rule_chunked(q, k, v, g, beta, state, cu, slots, init, block_v=8)
    with pytest.raises(TypeError, match="state must be float32"):
        gated_delta_rule_chunked(q, k, v, g, beta, state.half(), cu, slots, init)
    with pytest.raises(ValueError, match="shapes disagree"):
        gated_delta_rule_chunked(q, k[:1], v, g, beta, state, cu, slots, init)
    with pytest.raises(ValueError, match="precision must be one of"):
        gated_delta_rule_chunked(q, k, v, g, beta, state, cu, slots, init, precision="fp16")


def test_products_are_tf32_for_16_bit_inputs_and_float32_accurate_for_float32() -> None:
    """The interpreter multiplies in float32 whatever the precision: the rule is checked here,
    its accuracy on the GPU (tests_gpu/test_qwen3_5_gpu.py)."""
    assert dot_precision(torch.float32) == "tf32x3"
    assert dot_precision(torch.bfloat16) == dot_precision(torch.float16) == "tf32"


def test_a_padding_row_runs_from_zeros_and_writes_no_state() -> None:
    """Slot -1 (a CUDA graph's padding sequence): its rows' output is a fresh start's, no entry
    changes, and the sequence beside it is as without it."""
    q, k, v, g, beta, state = _inputs(21, 1, 2, 16, 16, torch.float32, seed=2)
    cu, init = torch.tensor([0, 5, 21]), torch.tensor([True, True])
    padded_state, alone_state, fresh_state = state.clone(), state.clone(), state.clone()
    padded = gated_delta_rule_chunked(q, k, v, g, beta, padded_state, cu, torch.tensor([3, -1]), init, chunk=CHUNK)
    alone = gated_delta_rule_chunked(q[:5], k[:5], v[:5], g[:5], beta[:5], alone_state, cu[:2], torch.tensor([3]),
                                     init[:1], chunk=CHUNK)
    fresh = gated_delta_rule_chunked(q[5:], k[5:], v[5:], g[5:], beta[5:], fresh_state, torch.tensor([0, 16]),
                                     torch.tensor([6]), torch.tensor([False]), chunk=CHUNK)
    assert torch.equal(padded_state, alone_state)
    torch.testing.assert_close(padded[:5], alone, **F32)
    torch.testing.assert_close(padded[5:], fresh, **F32)
