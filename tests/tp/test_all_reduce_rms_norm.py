"""The fused all-reduce + residual add + RMSNorm kernel (``kernels/all_reduce_rms_norm.py``)
against its torch reference, on the CPU under TRITON_INTERPRET=1 (conftest).

The ranks run one after the other in this process: "symmetric buffers" are plain
tensors whose addresses go in the pointer tables, and a later rank's buffer is filled
before an earlier rank runs (what that rank's first phase would have written). The
barrier runs only where it can complete in that order: with SYNC on, every flag a rank
waits for is set beforehand, and the flags and counters each rank leaves behind are
checked against the protocol (write the call's epoch into the peer's flag to signal,
wait until one's own flag holds it or a later epoch; each program counts its calls).
The kernel with real peers runs on two GPUs (tests_gpu/test_tp_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

import threading

from minivllm.kernels.all_reduce_rms_norm import MAX_PROGRAMS, all_reduce_add_rms_norm, signal_pad_numel
from minivllm.kernels.reference import all_reduce_add_rms_norm_reference


# The norm's mean is summed in another order than torch's: an ulp of the statistic apart.
NORM_TOLERANCE = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float16: dict(rtol=1e-3, atol=1e-6),
                  torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def ptr_table(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


def flag(pad: torch.Tensor, pid: int, src: int, world: int) -> torch.Tensor:
    return pad[pid * world + src]


def counter(pad: torch.Tensor, pid: int, world: int) -> torch.Tensor:
    return pad[MAX_PROGRAMS * world + pid]


@pytest.mark.parametrize("dtype,world,rows,hidden,offset,in_place", [
    (dtype, *case) for dtype in (torch.float32, torch.float16, torch.bfloat16)
    for case in [(2, 3, 64, 0, False), (3, 5, 48, 256, False), (2, 4, 64, 320, True)]
] + [(torch.float16, 2, 300, 32, 0, False)])  # more rows than programs, once: 5-7 s a dtype
def test_every_rank_gets_the_reference(dtype: torch.dtype, world: int, rows: int, hidden: int, offset: int,
                                       in_place: bool) -> None:
    """Every rank returns the same bits (the sum is taken in rank order everywhere). The
    new residual equals the reference bit for bit in float32 and float16 (same fp32 sum,
    same roundings), the output within an ulp of the norm's statistic; bf16 within one
    bf16 step, as the interpreter truncates fp32 -> bf16 casts where CUDA rounds
    (tests/kernels/test_attention.py). 300 rows exceed the grid (programs loop over rows). The rows
    go at ``offset`` in every buffer and nowhere else; ``in_place``: each rank's x is its
    buffer there already (a GEMM wrote it), not copied."""
    g = torch.Generator().manual_seed(rows * 10 + world)
    parts = [torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(world)]
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    want_out, want_res = all_reduce_add_rms_norm_reference(parts, residual, weight, 1e-6)
    n = rows * hidden
    bufs = [torch.full((offset + n + 7,), float("nan"), dtype=dtype) for _ in range(world)]
    for r in range(1, world):  # later ranks "already copied" their partial sums
        bufs[r][offset:offset + n] = parts[r].reshape(-1)
    if in_place:
        bufs[0][offset:offset + n] = parts[0].reshape(-1)
    pads = [torch.zeros(signal_pad_numel(world), dtype=torch.int32) for _ in range(world)]
    exact = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=0, atol=0)
    close = NORM_TOLERANCE[dtype]
    first = None
    for rank in range(world):
        x = bufs[rank][offset:offset + n].view(rows, hidden) if in_place else parts[rank]
        out, res = all_reduce_add_rms_norm(x, residual, weight, 1e-6, ptr_table(bufs), ptr_table(pads),
                                           rank, world, sync=False, buf_offset=offset, in_place=in_place)
        torch.testing.assert_close(res, want_res, **exact)
        torch.testing.assert_close(out, want_out, **close)
        if first is None:
            first = (out, res)
        assert torch.equal(out, first[0]) and torch.equal(res, first[1]), f"rank {rank} disagrees with rank 0"
        assert torch.equal(bufs[rank][offset:offset + n], parts[rank].reshape(-1))  # its copy for the peers
        assert torch.isnan(bufs[rank][:offset]).all() and torch.isnan(bufs[rank][offset + n:]).all()
    assert all(int(p.count_nonzero()) == 0 for p in pads)  # no barrier without sync


def test_in_place_skips_the_copy() -> None:
    """``in_place`` trusts that x is the buffer: the kernel does not write it (a NaN left in
    the buffer where x differs stays), and reads its own term from x."""
    parts = [torch.randn(2, 32) for _ in range(2)]
    residual, weight = torch.randn(2, 32), torch.ones(32)
    bufs = [torch.full((64,), float("nan")), parts[1].reshape(-1).clone()]
    pads = [torch.zeros(signal_pad_numel(2), dtype=torch.int32) for _ in range(2)]
    want = all_reduce_add_rms_norm_reference(parts, residual, weight, 1e-6)
    got = all_reduce_add_rms_norm(parts[0], residual, weight, 1e-6, ptr_table(bufs), ptr_table(pads), 0, 2,
                                  buf_offset=0, in_place=True, sync=False)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    assert torch.isnan(bufs[0]).all()
    # pdl=True (let the next kernel start early) is the plain launch off a GPU
    again = all_reduce_add_rms_norm(parts[0], residual, weight, 1e-6, ptr_table(bufs), ptr_table(pads), 0, 2,
                                    buf_offset=0, in_place=False, pdl=True, sync=False)
    assert torch.equal(bufs[0], parts[0].reshape(-1))  # copied when not in place
    assert torch.equal(again[0], got[0]) and torch.equal(again[1], got[1])


def test_barrier_flags_follow_the_protocol() -> None:
    """Two ranks, two programs each, three calls, each call run rank 0 then rank 1 with
    the barrier on. Before each call rank 1 has already signalled rank 0 with the call's
    epoch; rank 0's wait passes on it, it signals rank 1 with the same epoch, whose wait
    then passes. Afterwards every flag and counter holds the epoch."""
    world, rows, hidden = 2, 2, 32
    parts = [torch.randn(rows, hidden) for _ in range(world)]
    residual, weight = torch.randn(rows, hidden), torch.ones(hidden)
    bufs = [torch.zeros(rows * hidden) for _ in range(world)]
    bufs[1].copy_(parts[1].reshape(-1))
    pads = [torch.zeros(signal_pad_numel(world), dtype=torch.int32) for _ in range(world)]
    want = all_reduce_add_rms_norm_reference(parts, residual, weight, 1e-6)
    for epoch in (1, 2, 3):
        for pid in range(rows):
            flag(pads[0], pid, 1, world).fill_(epoch)  # rank 1's signals, sent earlier
        for rank in range(world):
            got = all_reduce_add_rms_norm(parts[rank], residual, weight, 1e-6, ptr_table(bufs), ptr_table(pads),
                                          rank, world, buf_offset=0, in_place=False)
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
            torch.testing.assert_close(got[0], want[0], **NORM_TOLERANCE[torch.float32])
        for pid in range(rows):
            assert int(flag(pads[1], pid, 0, world)) == epoch  # rank 0 signalled rank 1
            assert int(flag(pads[0], pid, 1, world)) == epoch
            assert int(counter(pads[0], pid, world)) == epoch and int(counter(pads[1], pid, world)) == epoch
        # Nothing else touched: per pad, the rows flags and the rows counters.
        assert int(pads[0].count_nonzero()) == 2 * rows and int(pads[1].count_nonzero()) == 2 * rows


def test_a_peer_one_call_ahead_passes_the_barrier() -> None:
    """With one barrier a peer may signal call k+1 before this rank has seen call k's
    signal (module doc): a flag already holding a later epoch lets the wait pass. (Waiting
    for the exact epoch would spin for ever: the call runs in a thread with a deadline.)"""
    world, rows, hidden = 2, 2, 32
    parts = [torch.randn(rows, hidden) for _ in range(world)]
    bufs = [torch.zeros(rows * hidden), parts[1].reshape(-1).clone()]
    pads = [torch.zeros(signal_pad_numel(world), dtype=torch.int32) for _ in range(world)]
    for pid in range(rows):
        flag(pads[0], pid, 1, world).fill_(2)  # rank 1 already at its second call; rank 0 makes its first
    done = threading.Event()

    def call() -> None:
        all_reduce_add_rms_norm(parts[0], torch.zeros(rows, hidden), torch.ones(hidden), 1e-6, ptr_table(bufs),
                                ptr_table(pads), 0, world, buf_offset=0, in_place=False)
        done.set()

    threading.Thread(target=call, daemon=True).start()
    assert done.wait(120), "the barrier waited for its own epoch although the peer was one call ahead"
    assert [int(counter(pads[0], pid, world)) for pid in range(rows)] == [1, 1]


def test_bad_arguments_are_named() -> None:
    x = torch.zeros(2, 8)
    ptrs = torch.zeros(2, dtype=torch.int64)
    kw = dict(buf_offset=0, in_place=False)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        all_reduce_add_rms_norm(x, x, torch.ones(8), 1e-6, ptrs, ptrs, 2, 2, **kw)
    with pytest.raises(TypeError, match="buf_ptrs"):
        all_reduce_add_rms_norm(x, x, torch.ones(8), 1e-6, ptrs.int(), ptrs, 0, 2, **kw)
    with pytest.raises(ValueError, match="weight"):
        all_reduce_add_rms_norm(x, x, torch.ones(4), 1e-6, ptrs, ptrs, 0, 2, **kw)
    with pytest.raises(ValueError, match="contiguous"):
        all_reduce_add_rms_norm(x.t(), x.t(), torch.ones(2), 1e-6, ptrs, ptrs, 0, 2, **kw)
    with pytest.raises(ValueError, match="buf_offset"):
        all_reduce_add_rms_norm(x, x, torch.ones(8), 1e-6, ptrs, ptrs, 0, 2, buf_offset=-1, in_place=False)
    with pytest.raises(TypeError, match="buf_offset"):  # the caller always names its half
        all_reduce_add_rms_norm(x, x, torch.ones(8), 1e-6, ptrs, ptrs, 0, 2, in_place=False)


def fake_symm(half: int = 1 << 16) -> object:
    """A ``SymmMemAllReduce`` with its buffer and tables faked on the CPU (no symmetric memory)."""
    from minivllm.ops import communicator as ar

    path = object.__new__(ar.SymmMemAllReduce)
    path.dtype, path.max_numel, path.half = torch.bfloat16, half, 0
    path.fused_buffer = torch.zeros(2 * half, dtype=torch.bfloat16)
    path.buf_ptrs = path.pad_ptrs = None
    path.rank, path.world_size = 0, 2
    return path


def test_the_path_alternates_halves_and_knows_a_gemm_wrote_in_place(monkeypatch) -> None:
    """``SymmMemAllReduce``'s fused calls (the kernel recorded): consecutive calls use the
    two halves in turn, ``partial_slot`` offers the half the next call uses, and x written
    there is passed as in place (no copy); shapes the kernel cannot take (3-D, wider than
    the norm kernel, another dtype, more than a half) are not offered, and the communicator
    leaves them to a plain all-reduce (None)."""
    import minivllm.kernels.all_reduce_rms_norm as kernel_mod
    from minivllm.kernels.rms_norm import MAX_HIDDEN
    from minivllm.ops.communicator import Communicator

    calls = []
    monkeypatch.setattr(kernel_mod, "all_reduce_add_rms_norm",
                        lambda x, *args, buf_offset, in_place, pdl: calls.append((buf_offset, in_place)) or (x, x))
    half = 1 << 16
    path = fake_symm(half)
    weight = torch.ones(8, dtype=torch.bfloat16)
    for i in range(4):
        slot = path.partial_slot((4, 8), torch.bfloat16)
        assert slot.data_ptr() == path.fused_buffer[(i % 2) * half:].data_ptr()
        x = slot if i < 2 else torch.zeros(4, 8, dtype=torch.bfloat16)
        path.add_rms_norm(x, x, weight, 1e-6, pdl=False)
    assert calls == [(0, True), (half, True), (0, False), (half, False)]
    comm = Communicator(0, 2, path)
    assert comm.partial_slot((8, 8), torch.bfloat16) is not None
    for shape, dtype in [((2, 4, 8), torch.bfloat16), ((1, MAX_HIDDEN * 2), torch.bfloat16),
                         ((4, 8), torch.float16), ((half // 8 + 2, 8), torch.bfloat16)]:
        assert path.partial_slot(shape, dtype) is None, (shape, dtype)
        x = torch.zeros(shape, dtype=dtype)
        assert comm.add_rms_norm(x, x, weight, 1e-6, False) is None, (shape, dtype)
    x = torch.zeros(8, 4, dtype=torch.bfloat16).t()
    assert comm.add_rms_norm(x, x, weight, 1e-6, False) is None  # not contiguous
    assert len(calls) == 4


def test_a_forward_refuses_halves_out_of_step(monkeypatch) -> None:
    """Every model forward starts by checking that the fused path is on its first half
    (an even number of fused calls a forward); on the second it raises instead of racing.
    The check runs in the decoder's forward (the tiny fixture model, one step)."""
    import os

    from minivllm.ops.communicator import Communicator
    from minivllm.testing import make_model_executor, make_plan

    path = fake_symm()
    comm = Communicator(0, 2, path)
    path.half = 1
    with pytest.raises(RuntimeError, match="out of step"):
        comm.begin_forward()
    path.half = 0
    comm.begin_forward()

    calls = []
    fixture = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "tiny-qwen3")
    ex = make_model_executor(fixture, block_size=16, num_blocks=4, max_num_seqs=4, max_num_batched_tokens=64,
                             device="cpu", kernels="torch")
    monkeypatch.setattr(type(ex.model.ops), "begin_forward", lambda self: calls.append(1))
    ex.compute_logits(make_plan([([5, 9, 11], 0, (0,), True)], 16))
    assert calls == [1]
