"""The GEMV kernel (``kernels/gemv.py``, TRITON_INTERPRET=1 here) against ``F.linear``, the
rules of when ``Ops`` takes it, and a model whose layers take it."""

from __future__ import annotations

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import (conftest sets it too)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from minivllm.kernels.gemv import (  # noqa: E402
    FEW_ROWS_CONFIG, MAX_ROWS, ONE_ROW_CONFIG, GemvConfig, default_config, gemv, gemv_takes,
)
from minivllm.ops.dispatch import Ops  # noqa: E402

# One output rounding of the fp32 result (the interpreter truncates bf16 casts: up to one
# ulp, 2**-7 relative, where CUDA rounds to half an ulp).
RTOL = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}
ANY = GemvConfig(block_k=32, min_programs=1)
ANY_ONE_ROW = GemvConfig(block_k=32, min_programs=1, one_row=True)


def small_tiles(monkeypatch, calls: list, block_n: int = 16, block_k: int = 32) -> None:
    """Route ``Ops``' GEMV calls through small tiles (``min_programs`` 1) on the path the
    defaults take for x's row count, recording (rows, kind) per call: "gemv", "gated" or "normed"."""
    from minivllm.kernels import gemv as linear_mod

    real_gemv, real_normed = linear_mod.gemv, linear_mod.rms_norm_gemv
    few = GemvConfig(block_n=block_n, block_k=block_k, min_programs=1)
    one = dataclasses.replace(few, one_row=True)

    def config(x):
        return one if x.shape[0] == 1 else few

    def gemv_(x, w, b, out=None, gated=False, pdl=False):
        calls.append((x.shape[0], "gated" if gated else "gemv"))
        return real_gemv(x, w, b, config(x), out=out, gated=gated, pdl=pdl)

    def normed_(x, residual, norm_weight, eps, w, b, pdl=False, unit_offset=False):
        calls.append((x.shape[0], "normed"))
        return real_normed(x, residual, norm_weight, eps, w, b, config(x), pdl=pdl, unit_offset=unit_offset)

    monkeypatch.setattr(linear_mod, "gemv", gemv_)
    monkeypatch.setattr(linear_mod, "rms_norm_gemv", normed_)
    monkeypatch.setattr(linear_mod, "gemv_takes", lambda x, w, gated=False, norm_weight=None, residual=None: (
        gemv_takes(x, w, config(x), gated=gated, norm_weight=norm_weight, residual=residual)))


def operands(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


def expect_linear(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.dtype == x.dtype and y.shape == ref.shape
    torch.testing.assert_close(y.float(), ref, rtol=RTOL[x.dtype], atol=RTOL[x.dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,bias", [
    (1, 64, 96, False),     # even N and K
    (3, 50, 130, True),     # a partial last column block and K step, bias
    (16, 32, 64, False),    # the most rows it takes
    (7, 16, 8, True),       # K shorter than one step
])
def test_gemv_is_f_linear(dtype, m, n, k, bias) -> None:
    x, w, b = operands(m, n, k, dtype, bias)
    expect_linear(gemv(x, w, b, ANY), x, w, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,bias", [(64, 96, False), (50, 130, True)])
def test_one_row_path_is_f_linear(dtype, n, k, bias) -> None:
    """Batch 1 on CUDA cores (``one_row``); a second row takes the tensor-core path."""
    one = GemvConfig(block_k=32, min_programs=1, one_row=True)
    x, w, b = operands(2, n, k, dtype, bias, seed=k)
    expect_linear(gemv(x[:1], w, b, one), x[:1], w, b)
    expect_linear(gemv(x, w, b, one), x, w, b)


def test_rows_do_not_change_each_others_results() -> None:
    """Each output is one dot product in a fixed order, whatever M: row i of a batch equals
    the same row alone, bit for bit (a batch-1 decode and a batch-8 one agree)."""
    x, w, _ = operands(8, 48, 100, torch.bfloat16, False, seed=3)
    batch = gemv(x, w, config=ANY)
    for i in range(x.shape[0]):
        assert torch.equal(gemv(x[i:i + 1], w, config=ANY), batch[i:i + 1])


def test_default_tiles_depend_on_the_row_count(monkeypatch) -> None:
    """No config: one row takes the measured CUDA-core tiles, 2-16 rows the tensor-core
    ones; both are F.linear (K not a multiple of either step, a partial column block), and
    each takes a weight only where it gives at least 32 programs."""
    import minivllm.kernels.gemv as gemv_mod

    assert default_config(1) is ONE_ROW_CONFIG and ONE_ROW_CONFIG.one_row
    assert all(default_config(m) is FEW_ROWS_CONFIG for m in (2, 7, MAX_ROWS))
    # One row by W's shape: the first matching entry of the table, else the general tiles.
    table = gemv_mod.ONE_ROW_BY_SHAPE
    assert all(c.one_row for _, _, c in table)
    assert default_config(1, 1024, 2048) is table[0][2] and default_config(1, 1024, 3072) is table[0][2]
    assert default_config(1, 3072, 4096) is table[1][2]
    assert default_config(1, 4096, 1024) is table[2][2] and default_config(1, 6144, 1024) is table[2][2]
    assert default_config(1, 12288, 4096) is table[3][2] and default_config(1, 4096, 6144) is table[3][2]
    assert default_config(1, 24576, 4096) is ONE_ROW_CONFIG and default_config(1, 4096, 12288) is ONE_ROW_CONFIG
    assert default_config(4, 1024, 2048) is FEW_ROWS_CONFIG
    launches = []
    real = gemv_mod._gemv_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((kw["ONE_ROW"], kw["BLOCK_N"], kw["BLOCK_K"], kw["num_stages"]))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(gemv_mod, "_gemv_kernel", Spy())
    for m in (1, 2):
        x, w, b = operands(m, 40, 600, torch.bfloat16, True, seed=m)
        expect_linear(gemv(x, w, b), x, w, b)
    one = default_config(1, 40, 600)
    assert launches == [(True, one.block_n, one.block_k, one.num_stages), (False, 32, 256, 4)]
    x1, x2 = torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(2, 8, dtype=torch.bfloat16)
    wide = ONE_ROW_CONFIG
    assert gemv_takes(x1, torch.zeros(16 * 32, 8, dtype=torch.bfloat16), wide)    # 32 programs of 16 columns
    assert not gemv_takes(x1, torch.zeros(16 * 31, 8, dtype=torch.bfloat16), wide)
    assert gemv_takes(x2, torch.zeros(32 * 32, 8, dtype=torch.bfloat16))          # 32 programs of 32 columns
    assert not gemv_takes(x2, torch.zeros(32 * 31, 8, dtype=torch.bfloat16))


def test_out_receives_the_result() -> None:
    """``out`` (a view into a larger buffer, as the all-reduce's symmetric buffer) is
    written and returned; a wrong shape, dtype or layout is refused by name."""
    x, w, b = operands(3, 48, 64, torch.bfloat16, True)
    buf = torch.full((200,), float("nan"), dtype=torch.bfloat16)
    out = buf[8:8 + 3 * 48].view(3, 48)
    assert gemv(x, w, b, ANY, out=out) is out
    expect_linear(out, x, w, b)
    assert torch.isnan(buf[:8]).all() and torch.isnan(buf[8 + 3 * 48:]).all()
    with pytest.raises(ValueError, match="out"):
        gemv(x, w, b, ANY, out=torch.empty(3, 47, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out"):
        gemv(x, w, b, ANY, out=torch.empty(48, 3, dtype=torch.bfloat16).t())
    with pytest.raises(TypeError, match="out"):
        gemv(x, w, b, ANY, out=torch.empty(3, 48))


@pytest.mark.parametrize("m,one_row", [(1, True), (1, False), (5, False)])
@pytest.mark.parametrize("k", [64, 100])
def test_gated_input_is_the_silu_and_mul_kernel_s_output(m: int, one_row: bool, k: int) -> None:
    """``gated``: x = [gate | up] and the input silu(gate) * up, computed inside: the same bits
    as the SiLU-and-mul kernel followed by the plain GEMV (each path, K a whole number of
    steps and with a tail, the padding rows of the tensor-core path included)."""
    from minivllm.kernels.silu_and_mul import silu_and_mul

    gen = torch.Generator().manual_seed(k + m)
    x = (2 * torch.randn(m, 2 * k, generator=gen)).to(torch.bfloat16)
    _, w, b = operands(m, 48, k, torch.bfloat16, True, seed=k)
    config = GemvConfig(block_k=32, min_programs=1, one_row=one_row)
    y = gemv(x, w, b, config, gated=True)
    assert torch.equal(y, gemv(silu_and_mul(x), w, b, config))
    expect_linear(y, silu_and_mul(x), w, b)
    assert gemv_takes(x, w, config, gated=True) and not gemv_takes(x, w, config)
    assert not gemv_takes(x[:, :k], w, config, gated=True)
    with pytest.raises(ValueError, match="odd width"):
        gemv(x[:, :2 * k - 1], w, config=config, gated=True)
    with pytest.raises(ValueError, match="weight"):
        gemv(x[:, :k], w, config=config, gated=True)


@pytest.mark.parametrize("k,norm_block", [(64, 2048), (100, 2048), (100, 32), (96, 32)])
@pytest.mark.parametrize("residual,bias", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("unit_offset", [False, True], ids=["norm", "norm_1p"])
def test_normed_input_is_the_rms_norm_kernel_s_output(monkeypatch, k: int, norm_block: int, residual: bool,
                                                      bias: bool, unit_offset: bool) -> None:
    """``rms_norm_gemv``: the residual add + RMSNorm inside the one-row GEMV gives the RMSNorm
    kernel's new residual bit for bit and, here (the interpreter sums in numpy's order), the
    same bits as that kernel followed by the plain GEMV: K a whole number of steps or not (the
    first W tile is loaded before the statistics pass, the rest in the loop), the statistics
    pass in one step or several, with and without residual and bias; ``unit_offset``: the
    zero-centred norm's (``rms_norm_1p``)."""
    import minivllm.kernels.gemv as gemv_mod
    from minivllm.kernels.gemv import rms_norm_gemv
    from minivllm.kernels.rms_norm import rms_norm as plain_norm
    from minivllm.kernels.rms_norm import rms_norm_1p

    rms_norm = rms_norm_1p if unit_offset else plain_norm

    monkeypatch.setattr(gemv_mod, "NORM_BLOCK_MAX", norm_block)
    gen = torch.Generator().manual_seed(k)
    x = (3 * torch.randn(1, k, generator=gen)).to(torch.bfloat16)
    r = torch.randn(1, k, generator=gen).to(torch.bfloat16) if residual else None
    nw = (1 + 0.2 * torch.randn(k, generator=gen)).to(torch.bfloat16)
    _, w, b = operands(1, 48, k, torch.bfloat16, bias, seed=k)
    y, s = rms_norm_gemv(x, r, nw, 1e-6, w, b, ANY_ONE_ROW, unit_offset=unit_offset)
    h, s_ref = rms_norm(x, nw, 1e-6, residual=r) if residual else (rms_norm(x, nw, 1e-6), x)
    assert torch.equal(s, s_ref) and (s is x) == (not residual)
    assert torch.equal(y, gemv(h, w, b, ANY_ONE_ROW))
    expect_linear(y, h, w, b)


def test_normed_input_takes_one_row_on_the_one_row_path_only() -> None:
    from minivllm.kernels.gemv import rms_norm_gemv

    x, w, _ = operands(1, 48, 64, torch.bfloat16, False)
    nw = torch.ones(64, dtype=torch.bfloat16)
    assert gemv_takes(x, w, ANY_ONE_ROW, norm_weight=nw) and gemv_takes(x, w, ANY_ONE_ROW, norm_weight=nw, residual=x)
    assert gemv_takes(x, w, ANY_ONE_ROW)
    for args, kwargs in [((x, w, ANY), {}),                                   # tensor-core path
                         ((torch.cat([x, x]), w, ANY_ONE_ROW), {}),           # two rows
                         ((x, w, ANY_ONE_ROW), {"gated": True}),
                         ((x, w, ANY_ONE_ROW), {"norm_weight": nw.float()}),  # norm weight of another dtype
                         ((x, w, ANY_ONE_ROW), {"norm_weight": nw[:32]}),
                         ((x, w, ANY_ONE_ROW), {"residual": x.half()}),        # residual unlike x
                         ((x, w, ANY_ONE_ROW), {"residual": torch.zeros(64, 2, dtype=x.dtype).t()[:1]})]:
        kwargs = {"norm_weight": nw, **kwargs}
        assert not gemv_takes(*args, **kwargs), (args[0].shape, args[2], kwargs)
    with pytest.raises(ValueError, match="one row on the one-row path"):
        rms_norm_gemv(torch.cat([x, x]), None, nw, 1e-6, w, config=ANY_ONE_ROW)
    with pytest.raises(ValueError, match="one row on the one-row path"):
        rms_norm_gemv(x, None, nw, 1e-6, w, config=ANY)
    with pytest.raises(ValueError, match="norm_weight"):
        rms_norm_gemv(x, None, nw[:32], 1e-6, w, config=ANY_ONE_ROW)
    with pytest.raises(TypeError, match="norm_weight"):
        rms_norm_gemv(x, None, nw.float(), 1e-6, w, config=ANY_ONE_ROW)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_gemv(x, x[:, :32], nw, 1e-6, w, config=ANY_ONE_ROW)
    with pytest.raises(TypeError, match="residual"):
        rms_norm_gemv(x, x.half(), nw, 1e-6, w, config=ANY_ONE_ROW)


TRITON_OPS = Ops(triton=True, use_gemv=True, pdl=False)


def test_norm_goes_into_the_gemv_at_one_row_when_nothing_is_left_to_sum(monkeypatch) -> None:
    """``Ops.norm_gemv``: at one row one ``rms_norm_gemv`` call (residual None: s is x itself);
    more rows, or a partial sum still to be summed over ranks (a communicator and a
    residual): the norm, then the GEMV. The same
    results each way, and as the torch references give."""
    from minivllm.kernels.reference import add_rms_norm_ref
    from minivllm.ops.communicator import Communicator

    calls: list[tuple[int, str]] = []
    small_tiles(monkeypatch, calls)
    torch.manual_seed(0)
    nw = (1.0 + 0.2 * torch.randn(64)).to(torch.bfloat16)
    w = (0.1 * torch.randn(96, 64)).to(torch.bfloat16)
    x, r = torch.randn(1, 64).to(torch.bfloat16), torch.randn(1, 64).to(torch.bfloat16)
    want_h, want_s = add_rms_norm_ref(x, r, nw, 1e-6)
    want_y = F.linear(want_h, w)
    y, s = TRITON_OPS.norm_gemv(x, r, nw, 1e-6, w, None)
    assert calls == [(1, "normed")]
    # (the interpreter truncates bf16 casts where torch rounds: one ulp apart at most)
    torch.testing.assert_close(s.float(), want_s.float(), rtol=2 ** -7, atol=0)
    torch.testing.assert_close(y.float(), want_y.float(), rtol=2 ** -6, atol=2 ** -6)
    _, s0 = TRITON_OPS.norm_gemv(x, None, nw, 1e-6, w, None)
    assert calls[-1] == (1, "normed") and s0 is x

    class OneRankSum(Communicator):  # "sums" one rank's partial: itself
        def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
            reduced.append(t.shape[0])
            return t

    reduced: list[int] = []
    tp_ops = Ops(triton=True, use_gemv=True, pdl=False, comm=OneRankSum(0, 2))
    y2, s2 = tp_ops.norm_gemv(x, r, nw, 1e-6, w, None)
    assert reduced == [1] and calls[-1] == (1, "gemv")
    torch.testing.assert_close(s2.float(), want_s.float(), rtol=2 ** -7, atol=0)
    _, s3 = tp_ops.norm_gemv(x, None, nw, 1e-6, w, None)  # the embedding: whole already
    assert reduced == [1] and calls[-1] == (1, "normed") and s3 is x
    three = torch.cat([x, x, x])
    TRITON_OPS.norm_gemv(three, three.clone(), nw, 1e-6, w, None)
    assert calls[-1] == (3, "gemv")


@pytest.mark.parametrize("block_n", [8, 4])
def test_narrow_column_blocks_serve_one_row_only(block_n: int) -> None:
    """Below 16 columns a program (more programs for a narrow W) is the one-row path's: it
    gives F.linear, and a config of it refuses more rows, as do non-one-row configs."""
    config = GemvConfig(block_n=block_n, block_k=32, min_programs=1, one_row=True)
    x, w, b = operands(1, 50, 100, torch.bfloat16, True, seed=block_n)
    expect_linear(gemv(x, w, b, config), x, w, b)
    two = torch.cat([x, x])
    assert gemv_takes(x, w, config) and not gemv_takes(two, w, config)
    with pytest.raises(ValueError, match="one row only"):
        gemv(two, w, b, config)
    with pytest.raises(ValueError, match="block_n"):
        GemvConfig(block_n=block_n)
    with pytest.raises(ValueError, match="block_n"):
        GemvConfig(block_n=12, one_row=True)


def test_pdl_is_a_launch_argument_harmless_off_hopper(monkeypatch) -> None:
    """``pdl=True`` asks for programmatic dependent launch; off a Hopper GPU (here: the CPU) the
    launch stays plain, so the kernel gets PDL off and gives the same bits. The default is
    off, and the default tiles do not depend on it."""
    import minivllm.kernels.gemv as gemv_mod
    from minivllm.kernels._launch import pdl_supported
    from minivllm.kernels.gemv import rms_norm_gemv

    assert not pdl_supported(torch.device("cpu"))
    launches = []
    real = gemv_mod._gemv_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((kw["PDL"], "launch_pdl" in kw))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(gemv_mod, "_gemv_kernel", Spy())
    nw = torch.ones(64, dtype=torch.bfloat16)
    for m, config in ((1, ANY_ONE_ROW), (3, ANY)):
        x, w, b = operands(m, 48, 64, torch.bfloat16, True, seed=m)
        assert torch.equal(gemv(x, w, b, config, pdl=True), gemv(x, w, b, config))
    x, w, b = operands(1, 48, 64, torch.bfloat16, True)
    for got, want in zip(rms_norm_gemv(x, x, nw, 1e-6, w, b, ANY_ONE_ROW, pdl=True),
                         rms_norm_gemv(x, x, nw, 1e-6, w, b, ANY_ONE_ROW)):
        assert torch.equal(got, want)
    assert launches == [(False, False)] * 6
    assert default_config(1) is ONE_ROW_CONFIG and default_config(2) is FEW_ROWS_CONFIG


def test_strided_rows_of_x() -> None:
    base, w, _ = operands(4, 32, 64, torch.float16, False)
    wide = torch.zeros(4, 96, dtype=torch.float16)
    wide[:, 16:80] = base
    x = wide[:, 16:80]  # row stride 96
    expect_linear(gemv(x, w, config=ANY), base, w, None)


def test_takes_only_decode_sized_16_bit_inputs_on_wide_weights() -> None:
    x, w, _ = operands(MAX_ROWS, 64, 32, torch.bfloat16, False)
    wide = GemvConfig(block_n=16, min_programs=4)
    assert gemv_takes(x, w, wide)
    assert not gemv_takes(torch.cat([x, x[:1]]), w, wide)                      # 17 rows
    assert not gemv_takes(x.float(), w.float(), wide)                           # fp32: cuBLAS
    assert not gemv_takes(x, w.t().contiguous().t(), wide)                      # W not contiguous
    assert not gemv_takes(x, w, GemvConfig(block_n=16, min_programs=5))         # 4 programs < 5
    assert not gemv_takes(x[None], w, wide)                                     # (1, M, K)
    assert not gemv_takes(x[:0], w, wide)                                       # no rows


@pytest.mark.parametrize("change,error,field", [
    (dict(x=torch.zeros(2, 8)), TypeError, "x"),
    (dict(weight=torch.zeros(16, 8, dtype=torch.float16)), TypeError, "weight"),
    (dict(x=torch.zeros(17, 8, dtype=torch.bfloat16)), ValueError, "x"),
    (dict(weight=torch.zeros(16, 9, dtype=torch.bfloat16)), ValueError, "weight"),
    (dict(bias=torch.zeros(15, dtype=torch.bfloat16)), ValueError, "bias"),
])
def test_gemv_rejects_bad_arguments(change, error, field) -> None:
    args = dict(x=torch.zeros(2, 8, dtype=torch.bfloat16), weight=torch.zeros(16, 8, dtype=torch.bfloat16),
                bias=None)
    with pytest.raises(error, match=field):
        gemv(**{**args, **change}, config=ANY)


def test_ops_take_the_kernel_for_few_rows_only(monkeypatch) -> None:
    """``Ops.gemv`` calls the kernel (with the bias) where it takes the shape, cuBLAS where it
    does not; ``few_rows`` sends at most 16 rows to the small-batch forward, only with the
    GEMV on; ``gated`` applies SiLU-and-mul either way."""
    from minivllm.kernels.reference import silu_and_mul_ref

    calls: list[tuple[int, str]] = []
    small_tiles(monkeypatch, calls)
    torch.manual_seed(0)
    w, b = (0.1 * torch.randn(32, 48)).to(torch.bfloat16), torch.randn(32).to(torch.bfloat16)
    for rows in (1, 16):
        x = torch.randn(rows, 48).to(torch.bfloat16)
        expect_linear(TRITON_OPS.gemv(x, w, b), x, w, b)
        g = torch.randn(rows, 96).to(torch.bfloat16)
        got = TRITON_OPS.gemv(g, w, None, gated=True)
        torch.testing.assert_close(got.float(), F.linear(silu_and_mul_ref(g), w).float(), rtol=2 ** -6, atol=2 ** -6)
    assert calls == [(1, "gemv"), (1, "gated"), (16, "gemv"), (16, "gated")]
    x17 = torch.randn(17, 48).to(torch.bfloat16)
    expect_linear(TRITON_OPS.gemv(x17, w, b), x17, w, b)                 # more rows than it takes: cuBLAS
    assert len(calls) == 4
    assert TRITON_OPS.few_rows(16) and not TRITON_OPS.few_rows(17)
    assert not Ops(triton=True, use_gemv=False, pdl=False).few_rows(1)


def test_executor_kernels_option_reaches_every_layer(monkeypatch) -> None:
    """``kernels="triton"`` in bf16 runs every decoder GEMM of the trained fixture on the GEMV
    kernel (three sequences, 6 tokens: plain GEMVs and the gated down; one row: each norm
    inside the GEMV after it) and gives the torch references' logits within bf16 rounding."""
    from minivllm.testing import make_model_executor, make_plan

    fixture = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "tiny-qwen3")
    calls: list[tuple[int, str]] = []
    small_tiles(monkeypatch, calls, block_n=64, block_k=128)  # few programs: the interpreter runs them one by one
    three = make_plan([([5, 9, 11], 0, (0,), True), ([7, 3], 0, (1,), True), ([42], 0, (2,), True)], 16)
    one = make_plan([([42], 0, (0,), True)], 16)
    executors = {k: make_model_executor(fixture, block_size=16, num_blocks=4, max_num_seqs=4,
                                        max_num_batched_tokens=64, device="cpu", dtype="bfloat16", kernels=k)
                 for k in ("torch", "triton")}
    assert executors["triton"].ops.use_gemv and not executors["torch"].ops.use_gemv
    for plan, per_layer in ((three, [(6, "gemv"), (6, "gemv"), (6, "gemv"), (6, "gated")]),
                            (one, [(1, "normed"), (1, "gemv"), (1, "normed"), (1, "gated")])):
        logits = {}
        for k, ex in executors.items():
            calls.clear()
            logits[k] = ex.compute_logits(plan).float()
            if k == "torch":
                assert calls == []
        # 3 layers x (qkv, o, gate_up, down); down takes [gate | up] (gated)
        assert calls == per_layer * 3
        rel = (logits["triton"] - logits["torch"]).norm() / logits["torch"].norm()
        assert rel < 2e-2, rel


def test_kernels_option_refuses_triton_where_it_cannot_run(monkeypatch) -> None:
    """Triton on the CPU only under its interpreter; a float32 model keeps cuBLAS for its GEMMs."""
    from minivllm.testing import make_model_executor

    fixture = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "tiny-qwen3")
    opts = dict(block_size=16, num_blocks=4, max_num_seqs=4, max_num_batched_tokens=64, device="cpu",
                kernels="triton")
    assert not make_model_executor(fixture, dtype="float32", **opts).ops.use_gemv
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA device"):
        make_model_executor(fixture, dtype="bfloat16", **opts)
