"""Qwen3.5's norm kernels against their torch references, on the CPU under the interpreter:
the zero-centred RMSNorm (plain and after the residual add), the DeltaNet's gated output norm,
and the fused zero-centred q/k norm + partial RoPE + K/V store.

Which planted bug each test catches (each was planted and seen to fail):
- the norm scaled by ``w`` instead of ``1 + w``: ``test_rms_norm_1p_matches_reference``;
- the 1p norm rounded before the weight multiply (the plain norm's rounding):
  ``test_rms_norm_1p_rounds_once``;
- ``sigmoid`` for ``silu`` in the gated norm, or the product not rounded where torch rounds
  ``weight * n``: ``test_rms_norm_gated_matches_reference``, ``test_rms_norm_gated_rounds_like_the_reference``;
- RoPE over all D dims, or partners paired across the whole head:
  ``test_qk_norm_1p_rope_store_matches_reference``, ``..._is_bit_identical_on_exact_sums``;
- a -1 slot written, or the FP8 scale dropped: ``..._matches_reference``, ``..._fp8_cache``.

Tolerances: fp32 differs from the reference by the sum of squares' order (and, in the norms,
the rsqrt's last bit); the interpreter rounds fp32 -> bf16 toward zero where torch rounds to
nearest: a few bf16 ulps.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels.qk_norm_1p_rope_store import qk_norm_1p_rope_store
from minivllm.kernels.reference import (
    add_rms_norm_1p_ref, qk_norm_1p_rope_store_reference, rms_norm_1p_ref, rms_norm_gated_ref,
)
from minivllm.kernels.rms_norm import rms_norm_1p
from minivllm.kernels.rms_norm_gated import rms_norm_gated
from tests.kernels.problems import make_qk_norm_1p_problem

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_close(got: torch.Tensor, want: torch.Tensor, roundings: int = 1) -> None:
    """Within the dtype's tolerance, times the 16-bit roundings to the model dtype on the way
    (each may put a bf16 ulp between the interpreter and torch)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOL[want.dtype] * (1 if want.dtype == torch.float32 else roundings)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- rms_norm_1p

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 256, 5120])  # a masked tail, a head, Qwen3.5-27B's hidden
def test_rms_norm_1p_matches_reference(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = (30 * torch.randn(7, hidden, generator=gen)).to(dtype)
    r = (300 * torch.randn(7, hidden, generator=gen)).to(dtype)
    w = (0.3 * torch.randn(hidden, generator=gen)).to(dtype)   # zero-centred: around 0
    assert_close(rms_norm_1p(x, w, 1e-6), rms_norm_1p_ref(x, w, 1e-6))
    got, res = rms_norm_1p(x, w, 1e-6, residual=r)
    want, want_res = add_rms_norm_1p_ref(x, r, w, 1e-6)
    if dtype != torch.bfloat16:  # the sum rounded once to the model dtype, as torch's add
        assert torch.equal(res, want_res)
    assert_close(res, want_res)
    assert_close(got, want)


def test_rms_norm_1p_takes_strided_heads_and_an_fp32_weight() -> None:
    """Rows that are a view (heads of a packed projection); an fp32 weight on bf16 rows gives
    bf16 (the reference rounds to x's dtype, not to the promoted one)."""
    gen = torch.Generator().manual_seed(3)
    packed = torch.randn(5, 3 * 64, generator=gen).to(torch.bfloat16)
    heads = packed[:, 64:].view(5, 2, 64)
    w32 = 0.3 * torch.randn(64, generator=gen)
    assert_close(rms_norm_1p(heads, w32, 1e-6), rms_norm_1p_ref(heads, w32, 1e-6))
    assert rms_norm_1p(heads[:0], w32, 1e-6).shape == (0, 2, 64)


def test_rms_norm_1p_rounds_once() -> None:
    """fp16 (the interpreter rounds fp16 as CUDA does): bit-identical to the reference, while
    the plain norm's rounding (normalised value rounded before the weight) differs on these
    values."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 64, generator=gen).half()
    w = (0.3 * torch.randn(64, generator=gen)).half()
    want = rms_norm_1p_ref(x, w, 1e-6)
    assert torch.equal(rms_norm_1p(x, w, 1e-6), want)
    x32 = x.float()
    two_roundings = ((x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).half().float()
                     * (1 + w.float())).half()
    assert not torch.equal(two_roundings, want)


# ----------------------------------------------------------------------------- rms_norm_gated

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 3, 128), (7, 96), (2, 20, 64)],
                         ids=["heads", "rows-masked-tail", "two-head-chunks"])
def test_rms_norm_gated_matches_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """x dense (the delta rule's output); the gate a strided view (the z slice of the input
    projection, its heads V apart in a wider row)."""
    gen = torch.Generator().manual_seed(sum(shape))
    v = shape[-1]
    x = (4 * torch.randn(*shape, generator=gen)).to(dtype)
    wide = (3 * torch.randn(*shape[:-1], 3 * v, generator=gen)).to(dtype)
    gate = wide[..., v:2 * v]
    w = (1 + 0.2 * torch.randn(v, generator=gen)).to(dtype)
    # Three roundings to the model dtype: the norm, weight * n, the gated product.
    assert_close(rms_norm_gated(x, gate, w, 1e-6), rms_norm_gated_ref(x, gate, w, 1e-6), roundings=3)


def test_rms_norm_gated_rounds_like_the_reference() -> None:
    """fp16: the norm rounded, ``weight * n`` rounded (fp16 weight) or not (fp32 weight), then
    the fp32 gate product rounded once. At most a few outputs one fp16 ulp apart (torch's
    vectorised exp), where a kernel that skipped the product's rounding, or took the fp32
    weight's product as rounded, is off on many."""
    gen = torch.Generator().manual_seed(4)
    x, gate = torch.randn(2, 16, 128, generator=gen).half(), (3 * torch.randn(2, 16, 128, generator=gen)).half()
    w32 = 1 + 0.3 * torch.randn(128, generator=gen)
    for w in (w32.half(), w32):
        want = rms_norm_gated_ref(x, gate, w, 1e-6)
        got = rms_norm_gated(x, gate, w, 1e-6)
        assert got.dtype == torch.float16
        assert (got != want).float().mean() < 0.005
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -10).all()


def test_rms_norm_gated_rejects_bad_arguments() -> None:
    x, w = torch.randn(3, 2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="gate"):
        rms_norm_gated(x, x[:, :1], w, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_gated(x, x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm_gated(x, torch.randn(3, 8, 2).transpose(1, 2), w, 1e-6)
    with pytest.raises(TypeError, match="gate"):
        rms_norm_gated(x, x.long(), w, 1e-6)
    assert rms_norm_gated(x[:0], x[:0], w, 1e-6).shape == (0, 2, 8)


# ----------------------------------------------------------------------------- qk_norm_1p_rope_store

# (T, H, Hkv, D, R): Qwen3.5's head (D 256, R 64), R = D, R/2 not a power of two, one token,
# q heads in two chunks of 8 (the second masked).
QK_CASES = [(3, 4, 2, 256, 64), (5, 2, 1, 32, 32), (7, 3, 1, 32, 24), (1, 2, 2, 16, 8), (2, 10, 2, 256, 64)]
QK_GRID = [(c, torch.bfloat16) for c in QK_CASES] + [(c, torch.float32) for c in QK_CASES]


def qk_id(v: object) -> str:
    return f"t{v[0]}-h{v[1]}/{v[2]}-d{v[3]}-r{v[4]}" if isinstance(v, tuple) else str(v)[6:]


@pytest.mark.parametrize("case,dtype", QK_GRID, ids=qk_id)
def test_qk_norm_1p_rope_store_matches_reference(case: tuple[int, ...], dtype: torch.dtype) -> None:
    t, h, hkv, d, r = case
    args, ref_args = make_qk_norm_1p_problem(t, h, hkv, d, r, dtype, torch.Generator().manual_seed(t * 100 + d))
    q = qk_norm_1p_rope_store(*args)
    q_ref = qk_norm_1p_rope_store_reference(*ref_args)
    assert q.shape == (t, h, d) and q.dtype == dtype and q.is_contiguous()
    k_cache, v_cache, k_ref, v_ref = args[8], args[9], ref_args[8], ref_args[9]
    assert torch.equal(v_cache, v_ref), "v must be copied unchanged, and only at valid slots"
    atol, rtol = {torch.float32: (2e-6, 2e-6), torch.bfloat16: (6e-2, 2e-2)}[dtype]
    torch.testing.assert_close(q, q_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(k_cache, k_ref, atol=atol, rtol=rtol)
    slots = args[10]
    untouched = torch.ones(k_cache.shape[:2], dtype=torch.bool)
    untouched.view(-1)[slots[slots >= 0]] = False
    assert torch.equal(k_cache[untouched], k_ref[untouched])


@pytest.mark.parametrize("case", QK_CASES[:3], ids=qk_id)
def test_qk_norm_1p_rope_store_is_bit_identical_on_exact_sums(case: tuple[int, ...]) -> None:
    """fp32, sums of squares exact in any order: every rounding is the reference's, so the
    pass-through dims, the rotated ones and the cache are equal bits; int32 indices."""
    args, ref_args = make_qk_norm_1p_problem(*case, torch.float32, torch.Generator().manual_seed(11),
                                             exact_sums=True)
    args[3], args[10] = args[3].int(), args[10].int()
    assert torch.equal(qk_norm_1p_rope_store(*args), qk_norm_1p_rope_store_reference(*ref_args))
    assert torch.equal(args[8], ref_args[8]) and torch.equal(args[9], ref_args[9])


def test_qk_norm_1p_rope_store_fp8_cache() -> None:
    """An e4m3 cache: k and v quantized by their scales, bit for bit (fp32, exact sums)."""
    args, ref_args = make_qk_norm_1p_problem(5, 2, 2, 64, 16, torch.float32, torch.Generator().manual_seed(2),
                                             exact_sums=True, kv_dtype=torch.float8_e4m3fn)
    assert torch.equal(qk_norm_1p_rope_store(*args), qk_norm_1p_rope_store_reference(*ref_args))
    for got, want in ((args[8], ref_args[8]), (args[9], ref_args[9])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ValueError, match="k_scale"):
        qk_norm_1p_rope_store(*args[:11])


def test_qk_norm_1p_rope_store_empty_batch_and_bad_arguments() -> None:
    args, _ = make_qk_norm_1p_problem(0, 4, 2, 16, 8, torch.float32, torch.Generator().manual_seed(0))
    assert qk_norm_1p_rope_store(*args).shape == (0, 4, 16)
    args, _ = make_qk_norm_1p_problem(3, 4, 2, 16, 8, torch.float32, torch.Generator().manual_seed(0))
    names = ["q", "k", "v", "positions", "q_weight", "k_weight", "eps", "cos_sin_cache", "k_cache", "v_cache",
             "slot_mapping"]

    def call(**changes: object) -> None:
        qk_norm_1p_rope_store(**{**dict(zip(names, args)), **changes})  # type: ignore[arg-type]

    q, k, table = args[0], args[1], args[7]
    with pytest.raises(TypeError, match="k"):
        call(k=k.half())
    with pytest.raises(TypeError, match="cos_sin_cache"):
        call(cos_sin_cache=table.double())
    with pytest.raises(ValueError, match="cos_sin_cache"):
        call(cos_sin_cache=torch.cat([table, table[:, :1]], dim=1))           # odd R
    with pytest.raises(ValueError, match="cos_sin_cache"):
        call(cos_sin_cache=torch.cat([table] * 3, dim=1))                     # R > D
    with pytest.raises(ValueError, match="v must be"):
        call(v=k[:, :1])
    with pytest.raises(ValueError, match="q must be"):
        call(q=q[..., :8])
    with pytest.raises(ValueError, match="contiguous last dimension"):
        call(q=q.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="slot_mapping"):
        call(slot_mapping=args[10][:2])
    with pytest.raises(ValueError, match="q_weight"):
        call(q_weight=args[4][:8])


# ----------------------------------------------------------------------------- routing

def test_ops_route_the_norms_to_the_kernels(monkeypatch) -> None:
    """``Ops`` with Triton on calls the kernels (and, with the torch references on, not them);
    the outputs agree. (The hybrid model's Triton test would pass on the references too.)"""
    from minivllm.kernels import qk_norm_1p_rope_store as qk_mod, rms_norm as norm_mod, rms_norm_gated as gated_mod
    from minivllm.ops.dispatch import Ops

    calls: list[str] = []
    for mod, name in ((norm_mod, "rms_norm_1p"), (gated_mod, "rms_norm_gated"), (qk_mod, "qk_norm_1p_rope_store")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    gen = torch.Generator().manual_seed(6)
    x, r, w = torch.randn(3, 32, generator=gen), torch.randn(3, 32, generator=gen), torch.randn(32, generator=gen)
    outs = {}
    for kernels in ("torch", "triton"):
        ops = Ops.build(kernels, torch.device("cpu"), torch.float32)
        args, _ = make_qk_norm_1p_problem(3, 2, 1, 32, 8, torch.float32, torch.Generator().manual_seed(1))
        outs[kernels] = [ops.rms_norm_1p(x, w, 1e-6), *ops.add_rms_norm_1p(x, r, w, 1e-6),
                         ops.rms_norm_gated(x.view(3, 2, 16), r.view(3, 2, 16), w[:16], 1e-6),
                         ops.qk_norm_1p_rope_store(*args), args[8]]
        assert calls == ([] if kernels == "torch" else
                         ["rms_norm_1p", "rms_norm_1p", "rms_norm_gated", "qk_norm_1p_rope_store"])
    for got, want in zip(outs["triton"], outs["torch"]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
