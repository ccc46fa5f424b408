"""The state kernels' per-sequence arguments (causal conv, recurrent and chunked delta rule,
under Triton's interpreter): they take them as the step's metadata holds them, int32 row
offsets and a bool ``has_initial_state`` read in place (no cast launched per layer), with the
int64 offsets' results; other index dtypes are refused by name. Save points given with their
per-sequence ranges (``save_bounds``, as a CUDA graph's static buffers hold them, unused
entries after them) give what the same points in any order give."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels.causal_conv1d import causal_conv1d
from minivllm.kernels.gated_delta_rule_chunked import gated_delta_rule_chunked
from minivllm.kernels.gated_delta_rule_recurrent import gated_delta_rule_recurrent
from tests.kernels.problems import make_delta_rule_problem

LENS = [3, 1, 18]
SLOTS = [4, 0, 2]
INIT = [True, False, True]


def _runs():
    """(name, fn(cu, slots, init) -> (out, state written)) per kernel, on one shared problem."""
    q, k, v, g, beta, state = make_delta_rule_problem(sum(LENS), 1, 2, 16, 16, torch.float32, 0, 5, 0.5)
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(sum(LENS), 24, generator=gen), torch.randn(24, 4, generator=gen)
    conv_state = torch.randn(5, 24, 3, generator=gen)

    def rule(kernel):
        def run(cu, slots, init, *saves, **bounds):
            s = state.clone()
            return kernel(q, k, v, g, beta, s, cu, slots, init, *saves, **bounds), s
        return run

    def conv(cu, slots, init, *saves, **bounds):
        s = conv_state.clone()
        return causal_conv1d(x, w, s, cu, slots, init, *saves, **bounds), s

    return [("conv", conv), ("recurrent", rule(gated_delta_rule_recurrent)),
            ("chunked", rule(lambda *a, **kw: gated_delta_rule_chunked(*a, **kw, chunk=16)))]


@pytest.mark.parametrize("name,run", _runs(), ids=lambda x: x if isinstance(x, str) else "")
def test_int32_offsets_and_a_bool_init_as_the_metadata_holds_them(name, run) -> None:
    cu64 = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()])
    slots, init = torch.tensor(SLOTS), torch.tensor(INIT)
    want, want_state = run(cu64, slots, init)
    got, got_state = run(cu64.to(torch.int32), slots, init)
    assert torch.equal(got, want) and torch.equal(got_state, want_state)
    # has_initial_state is read, not ignored: all fresh differs
    other, _ = run(cu64, slots, torch.zeros(3, dtype=torch.bool))
    assert not torch.equal(other, want)
    with pytest.raises(TypeError, match="slots must have dtype"):
        run(cu64, slots.to(torch.int32), init)
    with pytest.raises(TypeError, match="has_initial_state must have dtype"):
        run(cu64, slots, init.to(torch.int8))
    with pytest.raises(TypeError, match="cu_seqlens must have dtype"):
        run(cu64.float(), slots, init)


@pytest.mark.parametrize("name,run", _runs(), ids=lambda x: x if isinstance(x, str) else "")
def test_bounded_save_points_visit_each_sequence_s_own_only(name, run) -> None:
    """Entries 1 and 3 saved (sequence 0 after 2 tokens, sequence 2 after 10); with bounds, two
    unused entries after them name entry 4 (sequence 0's slot): visited, they would overwrite it."""
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()])
    slots, init = torch.tensor(SLOTS), torch.tensor(INIT)
    t = torch.tensor
    want, want_state = run(cu, slots, init, t([2, 0]), t([10, 2]), t([3, 1]))
    got, got_state = run(cu, slots, init, t([0, 2, -1, -1]), t([2, 10, 1, 1]), t([1, 3, 4, 4]),
                         save_bounds=t([0, 1, 1, 2]))
    assert torch.equal(got, want) and torch.equal(got_state, want_state)
    plain, plain_state = run(cu, slots, init)
    assert not torch.equal(plain_state[1], want_state[1]) and not torch.equal(plain_state[3], want_state[3])
    with pytest.raises(ValueError, match="save_bounds must be int64"):
        run(cu, slots, init, t([2, 0]), t([10, 2]), t([3, 1]), save_bounds=t([0, 1, 2]))
