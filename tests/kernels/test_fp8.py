"""FP8 (e4m3) weights: the quantizers of ``kernels/fp8.py`` (round trips, error
bounds, zero blocks, partial blocks, the checkpoint config), and the kernels
``kernels/fp8_gemm.py``, ``kernels/fp8_gemv.py`` and ``kernels/fp8_quant.py``
(TRITON_INTERPRET=1 here) against their references and against the unquantized product."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import (conftest sets it too)

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from minivllm.config import FP8_WEIGHT_BLOCK, Fp8Config  # noqa: E402
from minivllm.kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm, scaled_mm_fp8  # noqa: E402
from minivllm.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv  # noqa: E402
from minivllm.kernels.fp8_quant import quantize_activations  # noqa: E402
from minivllm.kernels.reference import fp8_gemm_reference, fp8_gemv_reference  # noqa: E402
from minivllm.kernels.fp8 import (  # noqa: E402
    FP8_DTYPE, FP8_GROUP, round_to_e4m3, dequantize_fp8_block, dequantize_fp8_per_channel, dequantize_fp8_weight,
    quantize_fp8_block, quantize_fp8_per_channel, quantize_fp8_per_token, quantize_fp8_per_token_group,
)

# e4m3 keeps 3 mantissa bits: a normal value rounds within 2^-4 of itself; below 2^-6 (the
# subnormals, multiples of 2^-9) within 2^-10 in units of the scale.
REL_BOUND = 2.0 ** -4
SUB_BOUND = 2.0 ** -10
N, K = 300, 200  # neither a multiple of 128: partial weight blocks and a partial activation group


def weight(n: int = N, k: int = K, seed: int = 0) -> torch.Tensor:
    """A float32 (n, k) of a trained layer's scale, with blocks of different magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.logspace(-1, 1, n).view(-1, 1)[torch.randperm(n, generator=gen)]
    return torch.randn(n, k, generator=gen) * rows / k ** 0.5


def activations(m: int, k: int = K, dtype: torch.dtype = torch.bfloat16, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, k)).to(dtype)


def quantized(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8_block(w, FP8_WEIGHT_BLOCK) if mode == "block" else quantize_fp8_per_channel(w)


def assert_within_rounding(w: torch.Tensor, deq: torch.Tensor, scale: torch.Tensor, extra: float = 0.0) -> None:
    """|deq - w| <= (2^-4 + extra) |w| + 2^-10 scale, elementwise (``scale`` spread like w)."""
    err = (deq - w.float()).abs()
    bound = (REL_BOUND + extra) * w.float().abs() + SUB_BOUND * scale + 1e-30
    assert torch.all(err <= bound * (1 + 2.0 ** -20)), f"worst excess {float((err - bound).max())}"


def assert_sum_order_close(y: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor) -> None:
    """y and ref round the same terms summed in another order: within one ulp of y's dtype
    (the interpreter truncates fp32 -> bf16) plus 2^-16 of the sum of |terms|."""
    assert y.shape == ref.shape and y.dtype == ref.dtype
    err = (y.float() - ref.float()).abs()
    bound = torch.finfo(y.dtype).eps * ref.float().abs() + 2.0 ** -16 * magnitude + 1e-30
    assert torch.all(err <= bound), f"worst excess {float((err - bound).max())}"


# --- quantizers -----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(N, K), (128, 256), (1, 5), (129, 127)])
def test_block_round_trip_within_rounding(shape) -> None:
    w = weight(*shape)
    q, s = quantize_fp8_block(w, FP8_WEIGHT_BLOCK)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    spread = s.repeat_interleave(128, 0)[:shape[0]].repeat_interleave(128, 1)[:, :shape[1]]
    assert_within_rounding(w, dequantize_fp8_block(q, s, FP8_WEIGHT_BLOCK), spread)
    # Each block's largest magnitude maps to 448, partial edge blocks included.
    nb, kb = s.shape
    for i in range(nb):
        for j in range(kb):
            block = q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float().abs()
            assert block.max() == 448.0


def test_grid_values_are_kept_exactly() -> None:
    """A block whose amax is 448 * 2^-3 has the scale 2^-3: e4m3 values times 2^-3 come back
    bit for bit (subnormals and the largest value included)."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
    grid = grid[torch.isfinite(grid.float())].float()                 # 254 values, +-0 included
    w = torch.cat([grid, grid.new_full((2,), 448.0)]).view(2, 128) * 2.0 ** -3
    q, s = quantize_fp8_block(w, FP8_WEIGHT_BLOCK)
    assert s.item() == 2.0 ** -3
    assert torch.equal(q.float() * 2.0 ** -3, w)


def test_zero_blocks_get_a_finite_scale() -> None:
    w = weight(256, 256)
    w[:128, 128:] = 0
    for t in (w, torch.zeros(3, 7)):
        q, s = quantize_fp8_block(t, FP8_WEIGHT_BLOCK)
        assert torch.all(torch.isfinite(s)) and torch.all(s > 0)
        assert torch.all(torch.isfinite(dequantize_fp8_block(q, s, FP8_WEIGHT_BLOCK)))
    q, s = quantize_fp8_block(w, FP8_WEIGHT_BLOCK)
    assert torch.all(q[:128, 128:].float() == 0)
    assert torch.all(dequantize_fp8_block(q, s, FP8_WEIGHT_BLOCK)[:128, 128:] == 0)
    q, s = quantize_fp8_per_channel(torch.zeros(4, 9))
    assert torch.all(torch.isfinite(s)) and torch.all(dequantize_fp8_per_channel(q, s) == 0)


def test_per_channel_and_per_token_round_trips() -> None:
    w = weight()
    q, s = quantize_fp8_per_channel(w)
    assert s.shape == (N,) and s.dtype == torch.float32
    assert_within_rounding(w, dequantize_fp8_per_channel(q, s), s[:, None].expand(N, K))
    assert torch.all(q.float().abs().amax(dim=1) == 448.0)
    x = activations(5)
    q, s = quantize_fp8_per_token_group(x)
    assert s.shape == (5, 2)
    assert_within_rounding(x, dequantize_fp8_block(q, s, (1, 128)), s.repeat_interleave(128, 1)[:, :K])
    q, s = quantize_fp8_per_token(x)
    assert s.shape == (5, 1)
    assert_within_rounding(x, q.float() * s, s.expand(5, K))


def test_bfloat16_scales_dequantize_what_was_stored() -> None:
    """Values are quantized against the bf16-rounded scale: the round trip keeps its bound, up
    to the 2^-9 by which an amax element may saturate."""
    w = weight()
    q, s = quantize_fp8_block(w, FP8_WEIGHT_BLOCK, scale_dtype=torch.bfloat16)
    assert s.dtype == torch.bfloat16
    spread = s.float().repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    assert_within_rounding(w, dequantize_fp8_block(q, s, FP8_WEIGHT_BLOCK), spread, extra=2.0 ** -9)


@pytest.mark.parametrize("call, error", [
    (lambda: quantize_fp8_block(torch.ones(4, 4, dtype=torch.int32), FP8_WEIGHT_BLOCK), TypeError),
    (lambda: quantize_fp8_block(torch.ones(4), FP8_WEIGHT_BLOCK), ValueError),
    (lambda: quantize_fp8_block(torch.ones(4, 4), (0, 128)), ValueError),
    (lambda: quantize_fp8_block(torch.ones(4, 4), FP8_WEIGHT_BLOCK, scale_dtype=torch.float16), TypeError),
    (lambda: dequantize_fp8_block(torch.ones(4, 4), torch.ones(1, 1), FP8_WEIGHT_BLOCK), TypeError),
    (lambda: dequantize_fp8_block(torch.ones(4, 4).to(FP8_DTYPE), torch.ones(2, 1), FP8_WEIGHT_BLOCK), ValueError),
    (lambda: dequantize_fp8_per_channel(torch.ones(4, 4).to(FP8_DTYPE), torch.ones(3)), ValueError),
    (lambda: dequantize_fp8_weight(torch.ones(4, 4).to(FP8_DTYPE), torch.ones(4), "tensor"), ValueError),
])
def test_quantizer_argument_errors(call, error) -> None:
    with pytest.raises(error):
        call()


QWEN3_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
             "modules_to_not_convert": ["lm_head", "model.layers.0.input_layernorm", "model.layers.0.mlp.gate",
                                        "model.layers.0.post_attention_layernorm"],
             "weight_block_size": [128, 128]}


def test_config_reads_the_published_format() -> None:
    c = Fp8Config.from_hf(QWEN3_FP8)
    assert c.weight_block_size == (128, 128) and c.scale_mode == "block"
    assert not c.converts("lm_head") and not c.converts("model.layers.0.mlp.gate")
    assert c.converts("model.layers.0.mlp.gate_proj") and c.converts("model.layers.0.mlp.experts.3.up_proj")
    assert c.converts("model.layers.1.mlp.gate")
    channel = Fp8Config.from_hf({"quant_method": "fp8", "weight_block_size": None})
    assert channel.scale_mode == "channel" and channel.modules_to_not_convert == ()


@pytest.mark.parametrize("change, field", [
    ({"activation_scheme": "static"}, "activation_scheme"),
    ({"fmt": "e5m2"}, "fmt"),
    ({"quant_method": "gptq"}, "quant_method"),
    ({"weight_block_size": [64, 64]}, "weight_block_size"),
    ({"weight_block_size": [128]}, "weight_block_size"),
    ({"scale_fmt": "ue8m0"}, "scale_fmt"),
    ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
])
def test_config_refuses_what_is_not_served(change, field) -> None:
    with pytest.raises(ValueError, match=field):
        Fp8Config.from_hf({**QWEN3_FP8, **change})
    missing = {k: v for k, v in QWEN3_FP8.items() if k != "weight_block_size"}
    with pytest.raises(ValueError, match="weight_block_size"):
        Fp8Config.from_hf(missing)


def test_the_checkpoint_block_is_the_kernels_block() -> None:
    """Checkpoints and the loader scale weights in ``config.FP8_WEIGHT_BLOCK`` tiles; the kernels'
    "block" mode reads FP8_GROUP x FP8_GROUP ones: one may not change without the other."""
    assert FP8_WEIGHT_BLOCK == (FP8_GROUP, FP8_GROUP)


# --- kernels ---------------------------------------------------------------------------------


@triton.jit
def _grid_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, round_to_e4m3(v).to(tl.float8e4nv), mask=offs < n)


def test_round_to_e4m3_rounds_as_torch() -> None:
    """Every e4m3 value, every midpoint between neighbours (ties) and the fp32 values beside
    them, and random values: the kernels' rounding under the interpreter equals torch's."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[torch.isfinite(grid)].sort().values
    mid = (grid[1:] + grid[:-1]) / 2
    v = torch.cat([grid, mid, torch.nextafter(mid, grid[1:]), torch.nextafter(mid, grid[:-1]),
                   torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 50]).clamp(-448, 448)
    out = torch.empty(v.shape, dtype=FP8_DTYPE)
    _grid_kernel[(triton.cdiv(v.numel(), 1024),)](v, out, v.numel(), BLOCK=1024)
    assert torch.equal(out.float(), v.to(FP8_DTYPE).float())


@pytest.mark.parametrize("mode", ["block", "channel"])
def test_gemm_quantizes_x_as_torch_does(mode: str) -> None:
    """With W = I every output is one dequantized activation: rows whose scale is a power of two
    (amax 28, scale 2^-4) and values at e4m3 ties and carries (7.9 -> 8, 125.4 -> 128 before the
    scale) give the reference's bits exactly."""
    grid = torch.arange(1, 127, dtype=torch.uint8).view(FP8_DTYPE).float()   # the 126 positive values
    ties = (grid[1:] + grid[:-1]) / 2                                          # 125 midpoints
    row = torch.cat([ties, torch.tensor([7.9, 125.4, -125.4, 336.0, 448.0]), grid]) / 16   # 256 columns
    x = torch.stack([row, row.flip(0), -row]).half()
    eye = torch.eye(256).to(FP8_DTYPE)
    scale = torch.ones(2, 2) if mode == "block" else torch.ones(256)
    y = fp8_gemm(x, eye, scale, mode)
    assert torch.equal(y, fp8_gemm_reference(x, eye, scale, mode))


@pytest.mark.parametrize("mode", ["block", "channel"])
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemm_matches_reference(mode: str, rows: int, dtype: torch.dtype) -> None:
    w_fp8, scale = quantized(weight(), mode)
    x = activations(rows, dtype=dtype)
    y = fp8_gemm(x, w_fp8, scale, mode)
    ref = fp8_gemm_reference(x, w_fp8, scale, mode)
    assert_sum_order_close(y, ref, x.float().abs() @ dequantize_fp8_weight(w_fp8, scale, mode).abs().T)


@pytest.mark.parametrize("config", [Fp8GemmConfig(block_m=16, block_n=16), Fp8GemmConfig(block_m=32, block_n=128)])
def test_gemm_tiles_do_not_change_the_result_beyond_sum_order(config: Fp8GemmConfig) -> None:
    """Several row and column blocks; x a column slice of a wider tensor (row stride != K)."""
    w_fp8, scale = quantized(weight(), "block")
    x = activations(40, K + 56)[:, 56:]
    ref = fp8_gemm_reference(x, w_fp8, scale, "block")
    assert_sum_order_close(fp8_gemm(x, w_fp8, scale, "block", config), ref,
                           x.float().abs() @ dequantize_fp8_block(w_fp8, scale, FP8_WEIGHT_BLOCK).abs().T)


@pytest.mark.parametrize("mode, bound", [("block", 0.06), ("channel", 0.06)])
def test_gemm_error_against_the_unquantized_product(mode: str, bound: float) -> None:
    """Both operands in e4m3: about 2^-5 relative rounding each, so the product is a few per
    cent off bf16's (measured 0.035-0.04 on these shapes)."""
    w = weight()
    x = activations(33)
    exact = x.float() @ w.T
    y = fp8_gemm(x, *quantized(w, mode), mode)
    assert float((y.float() - exact).norm() / exact.norm()) < bound


def test_gemm_empty_and_zero_rows() -> None:
    w_fp8, scale = quantized(weight(), "block")
    assert fp8_gemm(activations(0), w_fp8, scale, "block").shape == (0, N)
    x = activations(3)
    x[1] = 0
    for mode in ("block", "channel"):
        y = fp8_gemm(x, *quantized(weight(), mode), mode)
        assert torch.all(y[1] == 0) and torch.all(torch.isfinite(y))


def test_scaled_mm_matches_the_reference_per_channel() -> None:
    """torch._scaled_mm runs row-wise scales on the CPU (torch 2.13); block scales only on CUDA."""
    w_fp8, scale = quantized(weight(), "channel")
    x = activations(5)
    ref = fp8_gemm_reference(x, w_fp8, scale, "channel")
    assert_sum_order_close(scaled_mm_fp8(x, w_fp8, scale, "channel"), ref,
                           x.float().abs() @ dequantize_fp8_per_channel(w_fp8, scale).abs().T)
    with pytest.raises(NotImplementedError, match="CUDA"):
        scaled_mm_fp8(x, *quantized(weight(), "block"), "block")


@pytest.mark.parametrize("mode", ["block", "channel"])
@pytest.mark.parametrize("shape, config", [
    ((N, K), None),                                        # the mode's default tiles
    ((N, K), Fp8GemvConfig(block_n=4, block_k=64)),        # several K steps, partial N and K tiles
    ((256, 384), Fp8GemvConfig(block_n=32, block_k=128)),  # even N and K: the unmasked loads
    ((N, K), Fp8GemvConfig(block_n=8, block_k=256)),       # two scale groups a step, the last one partial
])
def test_gemv_matches_reference(mode: str, shape: tuple[int, int], config: Fp8GemvConfig | None) -> None:
    w_fp8, scale = quantized(weight(*shape), mode)
    x = activations(1, shape[1])
    y = fp8_gemv(x, w_fp8, scale, mode, config, pdl=True)   # pdl is harmless off a GPU
    ref = fp8_gemv_reference(x, w_fp8, scale, mode)
    assert_sum_order_close(y, ref, x.float().abs() @ dequantize_fp8_weight(w_fp8, scale, mode).abs().T)


@pytest.mark.parametrize("mode", ["block", "channel"])
def test_gemv_error_against_the_unquantized_product(mode: str) -> None:
    """Only W in e4m3 (x stays 16-bit): about 2.5% off bf16's product here; bound 0.05."""
    w = weight()
    x = activations(1)
    exact = x.float() @ w.T
    y = fp8_gemv(x, *quantized(w, mode), mode)
    assert float((y.float() - exact).norm() / exact.norm()) < 0.05


def _bad_args(mode: str) -> list[tuple[dict, type[Exception]]]:
    w_fp8, scale = quantized(weight(), mode)
    other = quantized(weight(), "channel" if mode == "block" else "block")[1]
    x = activations(1)
    return [
        (dict(x=x.float()), TypeError),
        (dict(weight=w_fp8.float().bfloat16()), TypeError),
        (dict(weight_scale=scale.bfloat16()), TypeError),
        (dict(weight_scale=other), ValueError),                          # the other mode's scale
        (dict(x=activations(1, K + 1)), ValueError),                     # K mismatch
        (dict(weight=w_fp8.t().contiguous().t()), ValueError),           # not contiguous
        (dict(mode="tensor"), ValueError),
        (dict(x=x[0]), ValueError),                                      # 1-D x
    ]


@pytest.mark.parametrize("mode", ["block", "channel"])
@pytest.mark.parametrize("kernel", [fp8_gemm, fp8_gemv])
def test_argument_errors(kernel, mode: str) -> None:
    w_fp8, scale = quantized(weight(), mode)
    good = dict(x=activations(1), weight=w_fp8, weight_scale=scale, mode=mode)
    for change, error in _bad_args(mode):
        with pytest.raises(error):
            kernel(**{**good, **change})
    with pytest.raises(ValueError, match="one row"):
        fp8_gemv(activations(2), w_fp8, scale, mode)
    with pytest.raises(ValueError, match="block_m"):
        Fp8GemmConfig(block_m=8)
    with pytest.raises(ValueError, match="block_k"):
        Fp8GemvConfig(block_k=8)


@pytest.mark.parametrize("mode", ["block", "channel"])
@pytest.mark.parametrize("residual", [True, False])
def test_gemv_fuses_the_input_norm_and_the_gated_activation(mode, residual) -> None:
    """At one row the FP8 GEMV computes its input as the 16-bit one does: RMSNorm(x +
    residual) with the RMSNorm kernel's new residual bit for bit and, here (the interpreter
    sums in numpy's order), the same bits as that kernel followed by the plain FP8 GEMV;
    ``gated``, the SiLU-and-mul kernel's output bit for bit as the input."""
    from minivllm.kernels.fp8_gemv import rms_norm_fp8_gemv
    from minivllm.kernels.rms_norm import rms_norm
    from minivllm.kernels.silu_and_mul import silu_and_mul

    w_fp8, scale = quantized(weight(), mode)
    gen = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(1, K, generator=gen)).to(torch.bfloat16)
    r = torch.randn(1, K, generator=gen).to(torch.bfloat16) if residual else None
    nw = (1 + 0.2 * torch.randn(K, generator=gen)).to(torch.bfloat16)
    y, s = rms_norm_fp8_gemv(x, r, nw, 1e-6, w_fp8, scale, mode)
    h, s_ref = rms_norm(x, nw, 1e-6, residual=r) if residual else (rms_norm(x, nw, 1e-6), x)
    assert torch.equal(s, s_ref) and (s is x) == (not residual)
    assert torch.equal(y, fp8_gemv(h, w_fp8, scale, mode))
    gate_up = activations(1, 2 * K, seed=4)
    assert torch.equal(fp8_gemv(gate_up, w_fp8, scale, mode, gated=True),
                       fp8_gemv(silu_and_mul(gate_up), w_fp8, scale, mode))
    with pytest.raises(ValueError, match="gated x must be"):
        fp8_gemv(gate_up[:, 1:], w_fp8, scale, mode, gated=True)
    with pytest.raises(ValueError, match="residual must be like x"):
        rms_norm_fp8_gemv(x, x[:, :32], nw, 1e-6, w_fp8, scale, mode)


# --- activations quantized once (kernels/fp8_quant.py) ---------------------------------------


@pytest.mark.parametrize("mode", ["block", "channel"])
@pytest.mark.parametrize("m, k", [(37, K), (3, 128), (1, 384)])
def test_activation_quantization_is_the_reference_bit_for_bit(mode, m, k) -> None:
    x = activations(m, k)
    x[0, :5] = 0.0                                     # zeros and an all-zero group at the floor
    x[-1, : min(k, 128)] = 0.0
    q, s = quantize_activations(x, mode)
    ref_q, ref_s = quantize_fp8_per_token_group(x) if mode == "block" else quantize_fp8_per_token(x)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and s.shape == ref_s.shape
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)


def test_activation_quantization_refuses_bad_input() -> None:
    with pytest.raises(TypeError, match="x must have dtype"):
        quantize_activations(activations(2).float(), "block")
    with pytest.raises(ValueError, match="mode"):
        quantize_activations(activations(2), "tensor")
    with pytest.raises(ValueError, match="2-D"):
        quantize_activations(activations(2)[0], "block")
    with pytest.raises(ValueError, match="contiguous last dimension"):
        quantize_activations(activations(4).t(), "block")
