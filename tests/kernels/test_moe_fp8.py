"""FP8 experts (TRITON_INTERPRET=1 here): the grouped GEMM of ``kernels/fused_moe.py`` (W8A8,
activations quantized in the kernel) and the few-token GEMVs of ``kernels/moe_gemv.py``
(weight-only) against their dequantize-then-compute references, in both scale modes, and
against the unquantized 16-bit experts."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import (conftest sets it too)

import pytest  # noqa: E402
import torch  # noqa: E402

from minivllm.config import FP8_WEIGHT_BLOCK  # noqa: E402
from minivllm.kernels.fp8 import quantize_fp8_block, quantize_fp8_per_channel  # noqa: E402
from minivllm.kernels.fused_moe import fused_moe  # noqa: E402
from minivllm.kernels.moe_align import moe_align  # noqa: E402
from minivllm.kernels.moe_gemv import MoeGemvConfig, moe_gemv  # noqa: E402
from minivllm.kernels.reference import (  # noqa: E402
    fused_moe_fp8_reference, fused_moe_reference, moe_gemv_fp8_reference,
)
from tests.kernels.test_moe import crafted_ids, expert_weights  # noqa: E402

MODES = ("block", "channel")
DTYPES = (torch.bfloat16, torch.float16)
# K steps of 64 inside each 128-column scale group, and of two whole groups.
GEMV_TILES = [{"gate_up_config": MoeGemvConfig(block_n=32, block_k=64, num_stages=2),
               "down_config": MoeGemvConfig(block_n=32, block_k=64, num_stages=2)},
              {"gate_up_config": MoeGemvConfig(block_n=32, block_k=256, num_stages=2),
               "down_config": MoeGemvConfig(block_n=32, block_k=256, num_stages=2)}]


def quantized_experts(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_fp8, scale)`` of stacked experts w (E, N, K), each quantized as one linear layer is:
    scale (E, cdiv(N, 128), cdiv(K, 128)) for "block", (E, N) for "channel"."""
    pairs = [quantize_fp8_block(m, FP8_WEIGHT_BLOCK) if mode == "block" else quantize_fp8_per_channel(m) for m in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def uneven(w: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """w (E, N, K) times a factor in [1/2, 2] per expert and 128x128 block and one in
    [0.7, 1.4] per row, so that every block and channel has its own scale and a scale read
    from the wrong place shows."""
    experts, n, k = w.shape
    blocks = 2.0 ** (2 * torch.rand(experts, -(-n // 128), -(-k // 128), generator=gen) - 1)
    rows = 2.0 ** (torch.rand(experts, n, 1, generator=gen) - 0.5)
    return w * blocks.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k] * rows


def routed(tokens: int, experts: int, top_k: int, hidden: int, inter: int, mode: str,
           dtype: torch.dtype = torch.bfloat16):
    """x (columns of magnitudes 0.3 to 3) in ``dtype``, the experts in ``dtype`` and their fp8 values,
    routing weights and crafted ids (expert 0 receives every token, the last none when E > k)."""
    gen = torch.Generator().manual_seed(tokens * 31 + top_k)
    x = (torch.randn(tokens, hidden, generator=gen) * torch.logspace(-0.5, 0.5, hidden)).to(dtype)
    weights = torch.rand(tokens, top_k, generator=gen)
    w13, w2 = (uneven(w, gen).to(dtype) for w in expert_weights(experts, hidden, inter, torch.float32, top_k))
    (q13, s13), (q2, s2) = quantized_experts(w13, mode), quantized_experts(w2, mode)
    return x, (w13, w2), (q13, q2, s13, s2), weights, crafted_ids(tokens, experts, top_k)


def grouped(x, q13, q2, s13, s2, weights, ids) -> torch.Tensor:
    return fused_moe(x, q13, q2, weights, moe_align(ids, q13.shape[0]), w13_scale=s13, w2_scale=s2)


def relative_error(y: torch.Tensor, exact: torch.Tensor) -> float:
    return float((y.float() - exact.float()).norm() / exact.float().norm())


def assert_near(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Kernel against reference: the fp32 sums in another order, and the routing weight applied
    before the down rounding rather than after. fp16: a value at a rounding point may land one
    ulp (2^-11) apart, and then, in W8A8, an act value on the neighbouring e4m3 value:
    measured 4e-4 in norm, the check that pins the scales. bf16: the interpreter truncates
    fp32 -> bf16 casts (torch rounds to nearest), a bias of up to one ulp (2^-8) at each of
    the five rounding points: measured 1.3-3.3% in norm, 2% of the largest output, so the
    bf16 bound catches only gross errors."""
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    tol = 5e-2 if dtype == torch.bfloat16 else 2e-3
    assert relative_error(out, ref) < tol
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * float(ref.float().abs().max()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [
    (17, 4, 2, 256, 128),   # two row blocks for expert 0 (every token), none for expert 3
    (3, 4, 1, 200, 256),    # k = 1 (all to expert 0); H a partial group, W2 a partial row block; I two groups
])
def test_fused_moe_fp8_is_reference(dtype, mode, tokens, experts, top_k, hidden, inter) -> None:
    x, _, (q13, q2, s13, s2), weights, ids = routed(tokens, experts, top_k, hidden, inter, mode, dtype)
    assert bool((ids == 0).any(dim=1).all()) and (top_k == 1 or not bool((ids == experts - 1).any()))
    out = grouped(x, q13, q2, s13, s2, weights, ids)
    assert_near(out, fused_moe_fp8_reference(x, q13, q2, weights, ids, s13, s2, mode), dtype)


# fp16 (the check that pins the scales) with both tiles; bf16 with the second.
@pytest.mark.parametrize("dtype,mode,tiles", [(torch.float16, m, t) for m in MODES for t in (0, 1)]
                         + [(torch.bfloat16, m, 1) for m in MODES])
def test_moe_gemv_fp8_is_reference(dtype, mode, tiles) -> None:
    """Four tokens over four experts: expert 0 receives every token, expert 3 none."""
    x, _, (q13, q2, s13, s2), weights, ids = routed(4, 4, 2, 256, 128, mode, dtype)
    out = moe_gemv(x, q13, q2, weights, ids, **GEMV_TILES[tiles], w13_scale=s13, w2_scale=s2)
    assert_near(out, moe_gemv_fp8_reference(x, q13, q2, weights, ids, s13, s2, mode), dtype)


@pytest.mark.parametrize("mode", MODES)
def test_fp8_experts_against_the_16_bit_experts(mode) -> None:
    """The relative (Frobenius) error against the bf16 experts the fp8 ones were quantized
    from. Weight-only: e4m3's rounding of each weight in both stages, measured 0.045-0.057 on
    these shapes, bound 0.07; W8A8 adds the rounding of x and act, measured 0.062-0.074,
    bound 0.09."""
    x, (w13, w2), (q13, q2, s13, s2), weights, ids = routed(17, 4, 2, 256, 128, mode)
    exact = fused_moe_reference(x, w13, w2, weights, ids)
    assert relative_error(grouped(x, q13, q2, s13, s2, weights, ids), exact) < 0.09
    few = slice(0, 4)
    gemv = moe_gemv(x[few], q13, q2, weights[few], ids[few].contiguous(), **GEMV_TILES[1],
                    w13_scale=s13, w2_scale=s2)
    assert relative_error(gemv, exact[few]) < 0.07


def _bad_args(mode: str) -> list[tuple[dict, type[Exception], str]]:
    x, (w13, w2), (q13, q2, s13, s2), _, _ = routed(2, 4, 2, 256, 128, mode)
    _, _, (_, _, _, o2), _, _ = routed(2, 4, 2, 256, 128, "channel" if mode == "block" else "block")
    _, _, (n13, n2, ns13, ns2), _, _ = routed(2, 4, 2, 256, 64, "block")   # I = 64
    return [
        (dict(w13_scale=None), ValueError, "w13_scale"),                  # fp8 weights need both scales
        (dict(w2_scale=None), ValueError, "w2_scale"),
        (dict(w13=w13, w2=w2), ValueError, "w13_scale"),                  # 16-bit weights take none
        (dict(w13_scale=s13.bfloat16()), TypeError, "w13_scale"),
        (dict(w2_scale=s2[:, :-1].contiguous()), ValueError, "w2_scale"),
        (dict(w2_scale=o2), ValueError, "w2_scale"),                      # the other mode's scale
        (dict(w13_scale=s13.transpose(0, 1).contiguous().transpose(0, 1)), ValueError, "w13_scale"),
        (dict(x=x.float()), TypeError, "x"),
        (dict(w2=w2), TypeError, "w2"),                                   # fp8 w13 with a bf16 w2
        (dict(w13=n13, w2=n2, w13_scale=ns13, w2_scale=ns2), ValueError, "multiple of 128"),
    ]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", ["fused_moe", "moe_gemv"])
def test_argument_errors(path: str, mode: str) -> None:
    x, _, (q13, q2, s13, s2), weights, ids = routed(2, 4, 2, 256, 128, mode)
    good = dict(x=x, w13=q13, w2=q2, w13_scale=s13, w2_scale=s2)

    def call(x, w13, w2, w13_scale, w2_scale):
        if path == "fused_moe":
            return fused_moe(x, w13, w2, weights, moe_align(ids, 4), w13_scale=w13_scale, w2_scale=w2_scale)
        return moe_gemv(x, w13, w2, weights, ids, **GEMV_TILES[1], w13_scale=w13_scale, w2_scale=w2_scale)

    for change, error, name in _bad_args(mode):
        with pytest.raises(error, match=name):
            call(**{**good, **change})
    assert call(**good).shape == (2, 256)
