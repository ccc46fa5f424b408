"""The one-row all-reduce that the row-parallel GEMV pushes (``kernels/_push_all_reduce.py``):
the producer (``gemv(..., push=)``), both consumers (``rms_norm_gemv(..., reduce=)`` and
``pushed_add_rms_norm``), the path that hands out slots (``SymmMemAllReduce``) and the layers
that use it, on the CPU under TRITON_INTERPRET=1 (conftest).

The ranks run one after the other in this process, as in test_all_reduce_rms_norm.py: each
rank's "symmetric" inbox and signal pad are plain tensors whose addresses go in the pointer
tables, so a producer's stores into a peer's inbox and its counts into the peer's pad really
land there. Every producer of a call runs before the call's consumers (whose wait then
passes), except in the test of the wait itself. Real peers run on two GPUs
(tests_gpu/test_tp_gpu.py).
"""

from __future__ import annotations

import threading

import pytest
import torch

from minivllm.kernels._push_all_reduce import PushChannel
from minivllm.kernels.all_reduce_rms_norm import pushed_add_rms_norm
from minivllm.kernels.gemv import gemv, rms_norm_gemv
from minivllm.kernels.reference import all_reduce_add_rms_norm_reference
from minivllm.layers import all_reduce as ar

DTYPE = torch.float16  # the interpreter truncates bf16 casts where torch rounds: fp16 compares exactly
EPS = 1e-6


def push_counters(path: ar.SymmMemAllReduce) -> list[int]:
    """arrived[0], arrived[1], expected[0], expected[1] of the rank's pad."""
    return path.pad[path.pad_at:].tolist()


def summed(parts: list[torch.Tensor]) -> torch.Tensor:
    """The all-reduce's output: rank order, fp32, rounded once."""
    total = torch.zeros(parts[0].shape, dtype=torch.float32)
    for p in parts:
        total += p.float()
    return total.to(parts[0].dtype)


@pytest.mark.parametrize("world,k,n,gated,bias", [(2, 64, 48, False, False), (3, 32, 40, True, True),
                                                  (2, 96, 56, True, False)])
def test_pushed_rows_reach_every_rank_and_both_consumers_sum_them(world: int, k: int, n: int, gated: bool,
                                                                  bias: bool) -> None:
    """Each rank's GEMV writes its partial sum (rank 0's with the bias) into its slot of every
    rank's inbox: the same bits as the plain GEMV. Then on every rank the normed GEMV over the
    slots equals ``rms_norm_gemv`` of the rank-order sum (bit for bit: one arithmetic), and
    ``pushed_add_rms_norm`` equals the all-reduce + norm reference (the residual exactly).
    The counters: N per peer arrived and expected, in the call's half only; the other half's
    slots are never written."""
    g = torch.Generator().manual_seed(world * 100 + k)
    xs = [torch.randn(1, 2 * k if gated else k, generator=g).to(DTYPE) for _ in range(world)]
    ws = [(0.1 * torch.randn(n, k, generator=g)).to(DTYPE) for _ in range(world)]
    b = torch.randn(n, generator=g).to(DTYPE) if bias else None
    w2 = (0.1 * torch.randn(24, n, generator=g)).to(DTYPE)
    nw = (1 + 0.1 * torch.randn(n, generator=g)).to(DTYPE)
    residual = torch.randn(1, n, generator=g).to(DTYPE)
    paths = ar.ranks_in_one_process(world, DTYPE)
    rows = [path.push_target((1, n), DTYPE) for path in paths]
    for rank, row in enumerate(rows):
        y = gemv(xs[rank], ws[rank], b if rank == 0 else None, out=row.out, gated=gated, push=row.channel)
        assert y.data_ptr() == row.out.data_ptr()
    parts = [gemv(xs[r], ws[r], b if r == 0 else None, gated=gated) for r in range(world)]
    want_y, want_s = rms_norm_gemv(summed(parts), residual, nw, EPS, w2)
    want_out, want_res = all_reduce_add_rms_norm_reference(parts, residual, nw, EPS)
    for rank, (path, row) in enumerate(zip(paths, rows)):
        assert row.channel.half == 0 and torch.equal(row.slots, torch.cat(parts))
        assert push_counters(path) == [n * (world - 1), 0, n * (world - 1), 0]
        assert torch.isnan(path.fused_buffer[path.max_numel:]).all()
        y, s = rms_norm_gemv(row.slots, residual, nw, EPS, w2, reduce=row.channel)
        assert torch.equal(s, want_s) and torch.equal(y, want_y), f"rank {rank}"
        out, res = pushed_add_rms_norm(row.slots, residual, nw, EPS, row.channel)
        torch.testing.assert_close(res, want_res, rtol=0, atol=0)
        torch.testing.assert_close(out, want_out, rtol=1e-3, atol=1e-6)


def test_calls_alternate_halves_and_the_consumer_finds_the_half_from_the_slot(monkeypatch) -> None:
    """Through the path, four calls, two ranks: ``push_target`` hands out the halves in turn
    (using one up, as a fused call does), each rank's slot is one row into the half (never
    where the fused kernel takes a row as written in place), ``pushed`` finds the call's half
    from the slot alone, and ``add_rms_norm`` sums a pushed row without touching the halves.
    A fused call between pushed ones takes the next half. Counters grow by N per call and
    half; every call's result equals the reference."""
    import minivllm.kernels.all_reduce_rms_norm as kernel_mod

    real = kernel_mod.all_reduce_add_rms_norm
    # One process runs the ranks in turn: the fused call's barrier could not complete here.
    monkeypatch.setattr(kernel_mod, "all_reduce_add_rms_norm",
                        lambda *a, **kw: real(*a, **{**kw, "sync": False}))
    world, n = 2, 32
    paths = ar.ranks_in_one_process(world, DTYPE)
    g = torch.Generator().manual_seed(7)
    nw, residual = torch.ones(n, dtype=DTYPE), torch.randn(1, n, generator=g).to(DTYPE)
    for call, kind in enumerate(["push", "push", "fused", "push", "push"]):
        parts = [torch.randn(1, n, generator=g).to(DTYPE) for _ in range(world)]
        want_out, want_res = all_reduce_add_rms_norm_reference(parts, residual, nw, EPS)
        half = call % 2
        if kind == "push":
            rows = [path.push_target((1, n), DTYPE) for path in paths]
            for rank, row in enumerate(rows):
                assert row.channel.half == half and row.out.data_ptr() != paths[rank].fused_slot((1, n), DTYPE).data_ptr()
                gemv(parts[rank], torch.eye(n, dtype=DTYPE), out=row.out, push=row.channel)  # pushes x itself
            for rank, (path, row) in enumerate(zip(paths, rows)):
                found = path.pushed(row.out)
                assert found.channel.half == half and found.out.data_ptr() == row.out.data_ptr()
                assert path.pushed(row.out.clone()) is None
                out, res = path.add_rms_norm(row.out, residual, nw, EPS)
                assert path._half == (half + 1) % 2  # the producer moved it on; the consumer did not
                torch.testing.assert_close(res, want_res, rtol=0, atol=0)
                torch.testing.assert_close(out, want_out, rtol=1e-3, atol=1e-6)
        else:
            slots = [path.fused_slot((1, n), DTYPE) for path in paths]
            for rank, slot in enumerate(slots):
                slot.copy_(parts[rank])
                assert paths[rank].pushed(slot) is None  # the half's first row: a fused call's
            for path, slot in zip(paths, slots):
                _, res = path.add_rms_norm(slot, residual, nw, EPS)
                torch.testing.assert_close(res, want_res, rtol=0, atol=0)
    for path in paths:
        assert path._half == 1  # five calls
        assert push_counters(path) == [2 * n, 2 * n, 2 * n, 2 * n]  # pushed calls 0, 1, 3, 4: halves 0, 1, 1, 0


def test_a_consumer_waits_for_the_peers_rows() -> None:
    """Rank 0's normed GEMV starts before rank 1 has pushed (rank 1's slot still NaN): it
    must not finish until the row and its count arrive; then it returns the sum's result.
    Rank 1's push is written here by torch (the interpreter runs one kernel at a time: its
    program ids are process-wide), the slot first, then the count, as the kernel orders them.
    (The wait has no event to watch from outside the kernel: it is given time to finish
    wrongly.)"""
    world, n = 2, 32
    paths = ar.ranks_in_one_process(world, DTYPE)
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(1, n, generator=g).to(DTYPE) for _ in range(world)]
    residual, nw = torch.randn(1, n, generator=g).to(DTYPE), torch.ones(n, dtype=DTYPE)
    w2 = (0.1 * torch.randn(16, n, generator=g)).to(DTYPE)
    rows = [path.push_target((1, n), DTYPE) for path in paths]
    gemv(parts[0], torch.eye(n, dtype=DTYPE), out=rows[0].out, push=rows[0].channel)
    result: list[tuple[torch.Tensor, torch.Tensor]] = []
    done = threading.Event()

    def consume() -> None:
        result.append(rms_norm_gemv(rows[0].slots, residual, nw, EPS, w2, reduce=rows[0].channel))
        done.set()

    threading.Thread(target=consume, daemon=True).start()
    assert not done.wait(1.5), "the consumer finished before its peer pushed"
    rows[0].slots[1].copy_(parts[1][0])
    paths[0].pad[paths[0].pad_at] += n  # arrived[0]
    assert done.wait(120), "the consumer did not see the peer's push"
    want = rms_norm_gemv(summed(parts), residual, nw, EPS, w2)
    assert torch.equal(result[0][0], want[0]) and torch.equal(result[0][1], want[1])


def test_push_refuses_what_it_cannot_take() -> None:
    """The path offers no push slot for more than one row, a row wider than the norm takes
    or a half holds, another dtype, or with the push off; the kernels name bad arguments."""
    from minivllm.kernels.rms_norm import MAX_HIDDEN

    path = ar.ranks_in_one_process(2, DTYPE, max_numel=96)[0]
    for shape, dtype in [((2, 32), DTYPE), ((1, MAX_HIDDEN * 2), DTYPE), ((1, 32), torch.bfloat16), ((1, 48), DTYPE)]:
        assert path.push_target(shape, dtype) is None, (shape, dtype)
    path.pushes = False
    assert path.push_target((1, 32), DTYPE) is None
    path.pushes = True
    row = path.push_target((1, 32), DTYPE)
    assert row is not None and path._half == 1
    x, w = torch.zeros(2, 8, dtype=DTYPE), torch.zeros(32, 8, dtype=DTYPE)
    with pytest.raises(ValueError, match="one row into its inbox slot"):
        gemv(x, w, out=torch.zeros(2, 32, dtype=DTYPE), push=row.channel)
    with pytest.raises(ValueError, match="one row into its inbox slot"):
        gemv(x[:1], w, push=row.channel)
    with pytest.raises(ValueError, match="slots and a residual"):
        rms_norm_gemv(row.slots, None, torch.ones(32, dtype=DTYPE), EPS, torch.zeros(8, 32, dtype=DTYPE),
                      reduce=row.channel)
    with pytest.raises(ValueError, match="slots must be a contiguous"):
        pushed_add_rms_norm(row.out, torch.zeros(1, 32, dtype=DTYPE), torch.ones(32, dtype=DTYPE), EPS, row.channel)
    with pytest.raises(ValueError, match="half 0 or 1"):
        PushChannel(path.buf_ptrs, path.pad_ptrs, path.pad_at, 2, 0, 0, 2)
    with pytest.raises(ValueError, match="pad_ptrs"):
        PushChannel(path.buf_ptrs, path.pad_ptrs[:1], path.pad_at, 0, 0, 0, 2)


@pytest.mark.parametrize("consumer_takes_norm", [True, False])
def test_layers_push_at_one_row_and_the_next_norm_collects(monkeypatch, consumer_takes_norm: bool) -> None:
    """Two ranks' ``o_proj`` (a row-parallel layer with a bias, leaving its sum to the norm)
    then ``post_attention_layernorm.into(gate_up_proj)``, one row, the ranks' halves of each
    step run in turn with each rank's path installed. The layer's GEMV pushes (its output is
    the rank's slot; rank 0's holds the bias), and the norm hands the row to the next GEMV
    (``consumer_takes_norm``) or, where that GEMV cannot take the norm, to the fused norm
    kernel. Either way every rank's result is the unsharded layers' within fp16 rounding, and
    the new residual is the same on both ranks."""
    from minivllm.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
    from minivllm.layers.norm import RMSNorm, add_rms_norm_ref

    world, k, n, m = 2, 64, 128, 256  # wide enough for the GEMV (32 programs)
    g = torch.Generator().manual_seed(11)
    x_full = torch.randn(1, k, generator=g).to(DTYPE)
    w_o, b_o = (0.1 * torch.randn(n, k, generator=g)).to(DTYPE), torch.randn(n, generator=g).to(DTYPE)
    w_gu = (0.1 * torch.randn(m, n, generator=g)).to(DTYPE)
    nw, residual = (1 + 0.1 * torch.randn(n, generator=g)).to(DTYPE), torch.randn(1, n, generator=g).to(DTYPE)
    paths = ar.ranks_in_one_process(world, DTYPE)
    if not consumer_takes_norm:
        monkeypatch.setattr(LinearBase, "takes_normed", lambda *a, **kw: False)
    import minivllm.kernels.all_reduce_rms_norm as kernel_mod
    import minivllm.layers.linear as linear_mod

    routes: list[str] = []
    for mod, name, route in [(linear_mod, "rms_norm_gemv", "gemv"), (kernel_mod, "pushed_add_rms_norm", "norm")]:
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _route=route, **kw: (
            routes.append(_route + (" reducing" if kw.get("reduce") else "")), _real(*a, **kw))[1])
    o_projs, gate_ups, norms = [], [], []
    for rank in range(world):
        o = RowParallelLinear(k, n, bias=True, tp_rank=rank, tp_size=world, reduce_in_next_norm=True)
        o.weight.data = w_o[:, rank * k // world:(rank + 1) * k // world].contiguous()
        o.bias.data = b_o.clone()
        gu = ColumnParallelLinear(n, m, tp_rank=rank, tp_size=world)
        gu.weight.data = w_gu[rank * m // world:(rank + 1) * m // world].contiguous()
        o.use_gemv = gu.use_gemv = True
        norm = RMSNorm(n, EPS, reduces_input=True)
        norm.weight.data = nw.clone()
        o_projs.append(o), gate_ups.append(gu), norms.append(norm)
    partials = []
    try:
        for rank in range(world):
            monkeypatch.setattr(ar, "_installed", paths[rank])
            y = o_projs[rank](x_full[:, rank * k // world:(rank + 1) * k // world])
            assert paths[rank].pushed(y) is not None, "the layer did not push"
            partials.append(y)  # the slot itself: the norm finds the pushed row by its address
        results = []
        for rank in range(world):
            monkeypatch.setattr(ar, "_installed", paths[rank])
            results.append(norms[rank].into(gate_ups[rank], partials[rank], residual))
    finally:
        monkeypatch.setattr(ar, "_installed", None)
    want_h, want_res = add_rms_norm_ref(torch.nn.functional.linear(x_full.float(), w_o.float(), b_o.float()).to(DTYPE),
                                        residual, nw, EPS)
    want_gu = torch.nn.functional.linear(want_h.float(), w_gu.float()).to(DTYPE)
    assert routes == (["gemv reducing"] if consumer_takes_norm else ["norm"]) * world
    for rank, (gu_out, res) in enumerate(results):
        torch.testing.assert_close(res, want_res, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(gu_out, want_gu[:, rank * m // world:(rank + 1) * m // world], rtol=1e-2, atol=1e-2)
        assert torch.equal(res, results[0][1])
        assert push_counters(paths[rank]) == [n, 0, n, 0]


def test_the_option_is_a_checked_bool() -> None:
    from minivllm.config import ExecutorConfig

    assert ExecutorConfig().push_all_reduce is False  # until it has run on two GPUs
    with pytest.raises(ValueError, match="push_all_reduce"):
        ExecutorConfig(push_all_reduce=1)
