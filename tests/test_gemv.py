"""The GEMV kernel (``kernels/gemv.py``, TRITON_INTERPRET=1 here) against ``F.linear``, the
rules of when the linear layers take it, and a model whose layers take it."""

from __future__ import annotations

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import (conftest sets it too)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from minivllm.kernels.gemv import (  # noqa: E402
    FEW_ROWS_CONFIG, MAX_ROWS, ONE_ROW_CONFIG, GemvConfig, default_config, gemv, gemv_takes, tma_allowed,
)
from minivllm.layers import linear as linear_mod  # noqa: E402
from minivllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear, use_gemv  # noqa: E402

# One output rounding of the fp32 result (the interpreter truncates bf16 casts: up to one
# ulp, 2**-7 relative, where CUDA rounds to half an ulp).
RTOL = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}
ANY = GemvConfig(block_k=32, min_programs=1)
ANY_ONE_ROW = GemvConfig(block_k=32, min_programs=1, one_row=True)


def small_tiles(monkeypatch, calls: list, block_n: int = 16, block_k: int = 32) -> None:
    """Route the linear layers' kernels through small tiles (``min_programs`` 1) on the path the
    defaults take for x's row count, recording (rows, kind) per call: "gemv", "gated" or "normed"."""
    real_gemv, real_normed = linear_mod.gemv, linear_mod.rms_norm_gemv
    few = GemvConfig(block_n=block_n, block_k=block_k, min_programs=1)
    one = dataclasses.replace(few, one_row=True)

    def config(x):
        return one if x.shape[0] == 1 else few

    def gemv_(x, w, b, out=None, gated=False):
        calls.append((x.shape[0], "gated" if gated else "gemv"))
        return real_gemv(x, w, b, config(x), out=out, gated=gated)

    def normed_(x, residual, norm_weight, eps, w, b):
        calls.append((x.shape[0], "normed"))
        return real_normed(x, residual, norm_weight, eps, w, b, config(x))

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


@pytest.mark.parametrize("n,k", [(64, 96), (50, 136), (40, 24)])
def test_tma_path_is_the_pointer_path(n, k) -> None:
    """W tiles by tensor-memory copy (boxes zero-filled past N and K): the same bits as
    pointer loads, a partial last block and a K tail included."""
    x, w, b = operands(5, n, k, torch.bfloat16, True, seed=n)
    tma = GemvConfig(block_k=32, min_programs=1, tma=True)
    assert tma_allowed(w)
    expect_linear(gemv(x, w, b, tma), x, w, b)
    assert torch.equal(gemv(x, w, b, tma), gemv(x, w, b, ANY))


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


@pytest.mark.parametrize("one_row,tma", [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("k", [24, 64, 100])
def test_prefetch_gives_the_same_bits(one_row: bool, tma: bool, k: int) -> None:
    """``prefetch`` (the first W tile loaded before the wait for the previous kernel, with
    programmatic dependent launch on a GPU) sums in the same order: the same bits, for K
    inside one step (only the prefetched tile), a whole number of steps, and a tail."""
    x, w, b = operands(1 if one_row else 5, 48, k, torch.bfloat16, True, seed=k)
    plain = GemvConfig(block_k=32, min_programs=1, one_row=one_row, tma=tma)
    fetched = GemvConfig(block_k=32, min_programs=1, one_row=one_row, tma=tma, prefetch=True)
    y = gemv(x, w, b, fetched)
    expect_linear(y, x, w, b)
    assert torch.equal(y, gemv(x, w, b, plain))


@pytest.mark.parametrize("m,one_row,tma", [(1, True, False), (1, False, False), (5, False, False), (5, False, True)])
@pytest.mark.parametrize("k", [64, 100])
def test_gated_input_is_the_silu_and_mul_kernel_s_output(m: int, one_row: bool, tma: bool, k: int) -> None:
    """``gated``: x = [gate | up] and the input silu(gate) * up, computed inside: the same bits
    as the SiLU-and-mul kernel followed by the plain GEMV (each path, K a whole number of
    steps and with a tail, the padding rows of the tensor-core path included)."""
    from minivllm.kernels.silu_and_mul import silu_and_mul

    gen = torch.Generator().manual_seed(k + m)
    x = (2 * torch.randn(m, 2 * k, generator=gen)).to(torch.bfloat16)
    _, w, b = operands(m, 48, k, torch.bfloat16, True, seed=k)
    config = GemvConfig(block_k=32, min_programs=1, one_row=one_row, tma=tma)
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
@pytest.mark.parametrize("residual,bias,prefetch", [(True, True, False), (False, False, False), (True, False, True)])
def test_normed_input_is_the_rms_norm_kernel_s_output(monkeypatch, k: int, norm_block: int, residual: bool,
                                                      bias: bool, prefetch: bool) -> None:
    """``rms_norm_gemv``: the residual add + RMSNorm inside the one-row GEMV gives the RMSNorm
    kernel's new residual bit for bit and, here (the interpreter sums in numpy's order), the
    same bits as that kernel followed by the plain GEMV: K a whole number of steps or not, the
    statistics pass in one step or several, with and without residual, bias and prefetch."""
    import minivllm.kernels.gemv as gemv_mod
    from minivllm.kernels.gemv import rms_norm_gemv
    from minivllm.kernels.rms_norm import rms_norm

    monkeypatch.setattr(gemv_mod, "NORM_BLOCK_MAX", norm_block)
    gen = torch.Generator().manual_seed(k)
    x = (3 * torch.randn(1, k, generator=gen)).to(torch.bfloat16)
    r = torch.randn(1, k, generator=gen).to(torch.bfloat16) if residual else None
    nw = (1 + 0.2 * torch.randn(k, generator=gen)).to(torch.bfloat16)
    _, w, b = operands(1, 48, k, torch.bfloat16, bias, seed=k)
    config = dataclasses.replace(ANY_ONE_ROW, prefetch=prefetch)
    y, s = rms_norm_gemv(x, r, nw, 1e-6, w, b, config)
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


def test_row_parallel_layers_never_take_the_norm() -> None:
    """A norm before a row-parallel layer would come before its sum over ranks: refused."""
    down = RowParallelLinear(64, 48).to(torch.bfloat16)
    use_gemv(down)
    x = torch.randn(1, 64).to(torch.bfloat16)
    assert not down.takes_normed(x, torch.ones(64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="takes_normed"):
        down.normed(x, None, torch.ones(64, dtype=torch.bfloat16), 1e-6)


def test_norm_goes_into_the_projection_unless_it_reduces_ranks(monkeypatch) -> None:
    """``RMSNorm.into``: at one row with the kernel on, one ``rms_norm_gemv`` call; where x holds
    ranks' partial sums for the norm to reduce (``defers_to_norm``), the fused all-reduce +
    norm, then the layer; off, the norm module then the layer. The same results each way."""
    from minivllm.layers import norm as norm_mod
    from minivllm.layers.norm import RMSNorm

    calls: list[tuple[int, str]] = []
    small_tiles(monkeypatch, calls)
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6, reduces_input=True).to(torch.bfloat16)
    torch.nn.init.normal_(norm.weight, 1.0, 0.2)
    qkv = MergedColumnParallelLinear(64, [48, 48]).to(torch.bfloat16)
    torch.nn.init.normal_(qkv.weight, std=0.1)
    x, r = torch.randn(1, 64).to(torch.bfloat16), torch.randn(1, 64).to(torch.bfloat16)
    plain_y, plain_s = norm.into(qkv, x, r)                     # kernel off: norm, then cuBLAS
    assert calls == [] and torch.equal(plain_s, x + r)
    use_gemv(qkv)
    y, s = norm.into(qkv, x, r)
    assert calls == [(1, "normed")]
    # (the interpreter truncates bf16 casts where torch rounds: one ulp apart at most)
    torch.testing.assert_close(s.float(), plain_s.float(), rtol=2 ** -7, atol=0)
    torch.testing.assert_close(y.float(), plain_y.float(), rtol=2 ** -6, atol=2 ** -6)
    y0, s0 = norm.into(qkv, x, None)
    assert calls[-1] == (1, "normed") and s0 is x
    strided = torch.zeros(64, 2, dtype=x.dtype).t()[:1]
    strided.copy_(r)
    _, s1 = norm.into(qkv, x, strided)                          # a residual the kernel does not take
    assert calls[-1] == (1, "gemv") and torch.equal(s1, plain_s)
    reduced: list[int] = []
    monkeypatch.setattr(norm_mod, "defers_to_norm", lambda t: True)
    monkeypatch.setattr(norm_mod, "all_reduce_add_rms_norm", lambda t, res, w, eps, warm: (
        reduced.append(warm), norm_mod.add_rms_norm(t, res, w, eps))[1])
    y2, s2 = norm.into(qkv, x, r)
    assert len(reduced) == 1 and reduced[0] is qkv.weight  # handed the next weight (to warm L2 with)
    assert calls[-1] == (1, "gemv") and torch.equal(s2, plain_s)


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


def test_pdl_default_the_variable_and_gpu_only(monkeypatch) -> None:
    """PDL: on where ``MINIVLLM_PDL`` is unset and the process's default is on (set by the
    engine: one rank), off with ``0`` or the default off (TP), on with ``1`` whatever the
    default; a value other than 0 / 1 is named. It never changes the default tiles, and the
    launch stays plain off Hopper GPUs (here: the CPU)."""
    from minivllm.kernels._launch import PDL_ENV, pdl, pdl_requested, set_pdl_default

    monkeypatch.delenv(PDL_ENV, raising=False)
    try:
        set_pdl_default(True)
        assert pdl_requested() and default_config(1) is ONE_ROW_CONFIG and ONE_ROW_CONFIG.prefetch is None
        set_pdl_default(False)
        assert not pdl_requested()
        monkeypatch.setenv(PDL_ENV, "1")
        pdl_requested.cache_clear()
        assert pdl_requested()  # the variable wins over the default
        assert not pdl(torch.zeros(1))
        x, w, b = operands(1, 16 * 32, 64, torch.bfloat16, False)
        expect_linear(gemv(x, w), x, w, None)  # PDL asked for, launched plainly
        set_pdl_default(True)
        monkeypatch.setenv(PDL_ENV, "0")
        pdl_requested.cache_clear()
        assert not pdl_requested()
        monkeypatch.setenv(PDL_ENV, "yes")
        pdl_requested.cache_clear()
        with pytest.raises(ValueError, match="MINIVLLM_PDL must be 0 or 1"):
            pdl_requested()
        with pytest.raises(TypeError, match="bool"):
            set_pdl_default(1)
        with pytest.raises(ValueError, match="prefetch must be None or a bool"):
            GemvConfig(prefetch=1)
    finally:
        monkeypatch.delenv(PDL_ENV, raising=False)
        set_pdl_default(True)


def test_l2_prefetch_is_opt_in_and_bounded(monkeypatch) -> None:
    """PDL's L2 prefetch asks for ``MINIVLLM_PDL_L2_MB`` of W (none unless set), at least 64
    columns and at most all K; a value that is not a size is refused by name."""
    from minivllm.kernels.gemv import L2_PREFETCH_ENV, l2_prefetch_columns

    monkeypatch.delenv(L2_PREFETCH_ENV, raising=False)
    assert l2_prefetch_columns(4096, 4096, 2) == 0
    monkeypatch.setenv(L2_PREFETCH_ENV, "24")
    assert l2_prefetch_columns(4096, 4096, 2) == 3072          # 24 MB in columns of 4096 x 2 bytes
    assert l2_prefetch_columns(1024, 1024, 2) == 1024          # the whole of a small W
    assert l2_prefetch_columns(151936, 4096, 2) == 82
    assert l2_prefetch_columns(10 ** 6, 4096, 2) == 64         # at least 64 columns
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv(L2_PREFETCH_ENV, bad)
        with pytest.raises(ValueError, match=L2_PREFETCH_ENV):
            l2_prefetch_columns(64, 64, 2)


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


def test_layers_take_the_kernel_for_few_rows_only(monkeypatch) -> None:
    """A switched layer calls the kernel at <= 16 rows and cuBLAS above; a row-parallel
    layer passes no bias to it (its bias is added after the reduction)."""
    calls: list[tuple[int, bool]] = []
    real = linear_mod.gemv
    monkeypatch.setattr(linear_mod, "gemv", lambda x, w, b, out=None, gated=False: (
        calls.append((x.shape[0], b is not None)), real(x, w, b, ANY, out=out, gated=gated))[1])
    monkeypatch.setattr(linear_mod, "gemv_takes", lambda x, w, gated=False, norm_weight=None, residual=None: (
        gemv_takes(x, w, ANY, gated=gated, norm_weight=norm_weight, residual=residual)))
    torch.manual_seed(0)
    gate_up = MergedColumnParallelLinear(32, [48, 48], bias=False).to(torch.bfloat16)
    down = RowParallelLinear(48, 32, bias=True).to(torch.bfloat16)
    for layer in (gate_up, down):
        torch.nn.init.normal_(layer.weight, std=0.1)
    torch.nn.init.normal_(down.bias)
    model = torch.nn.Sequential(gate_up, down)
    assert use_gemv(model) == 2
    for rows in (1, 16, 17):
        x = torch.randn(rows, 32).to(torch.bfloat16)
        h = gate_up(x)
        expect_linear(h, x, gate_up.weight, None)
        expect_linear(down(h[:, :48].contiguous()), h[:, :48], down.weight, down.bias)
    assert calls == [(1, False), (1, False), (16, False), (16, False)]
    use_gemv(model, False)
    gate_up(torch.randn(1, 32).to(torch.bfloat16))
    assert len(calls) == 4


def test_executor_config_switches_the_model_s_layers(monkeypatch) -> None:
    """``ExecutorConfig(gemv=True)`` reaches every linear layer: a step of three sequences
    (6 tokens) of the trained fixture in bf16 runs its GEMMs in the kernel and gives the
    cuBLAS path's logits within bf16 rounding."""
    from model_utils import make_model_executor, make_plan

    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tiny-qwen3")
    calls: list[tuple[int, str]] = []
    small_tiles(monkeypatch, calls, block_n=64, block_k=128)  # few programs: the interpreter runs them one by one
    three = make_plan([([5, 9, 11], 0, (0,), True), ([7, 3], 0, (1,), True), ([42], 0, (2,), True)], 16)
    one = make_plan([([42], 0, (0,), True)], 16)
    executors = {on: make_model_executor(fixture, block_size=16, num_blocks=4, max_num_seqs=4,
                                         max_num_batched_tokens=64, device="cpu", dtype="bfloat16",
                                         attention_backend="torch", gemv=on) for on in (False, True)}
    for plan, per_layer in ((three, [(6, "gemv"), (6, "gemv"), (6, "gemv"), (6, "gated")]),
                            # one row: each norm inside the projection after it
                            (one, [(1, "normed"), (1, "gemv"), (1, "normed"), (1, "gated")])):
        logits = {}
        for on, ex in executors.items():
            calls.clear()
            logits[on] = ex.compute_logits(plan).float()
        # 3 layers x (qkv, o, gate_up, down); down takes [gate | up] (gated)
        assert calls == per_layer * 3
        rel = (logits[True] - logits[False]).norm() / logits[False].norm()
        assert rel < 2e-2, rel


def test_gemv_option_refuses_models_it_cannot_serve(monkeypatch) -> None:
    from model_utils import make_model_executor

    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tiny-qwen3")
    opts = dict(block_size=16, num_blocks=4, max_num_seqs=4, max_num_batched_tokens=64, device="cpu",
                attention_backend="torch", gemv=True)
    with pytest.raises(ValueError, match="bfloat16 / float16"):
        make_model_executor(fixture, dtype="float32", **opts)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA device"):
        make_model_executor(fixture, dtype="bfloat16", **opts)
