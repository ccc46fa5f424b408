"""The few-token experts (``kernels/moe_gemv.py``, TRITON_INTERPRET=1 here) against the torch
reference and against the grouped GEMM they stand in for at decode."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import (conftest sets it too)

import pytest  # noqa: E402
import torch  # noqa: E402

from minivllm.kernels.fused_moe import FusedMoeConfig, fused_moe  # noqa: E402
from minivllm.kernels.moe_align import moe_align  # noqa: E402
from minivllm.kernels.moe_gemv import MoeGemvConfig, moe_gemv  # noqa: E402
from minivllm.kernels.reference import fused_moe_reference  # noqa: E402
from tests.kernels.test_moe import crafted_ids, expert_weights  # noqa: E402

# Partial column blocks (I = 24, H = 40 with block_n 16) and several K steps of 16.
TILES = {"gate_up_config": MoeGemvConfig(block_n=16, block_k=16, num_stages=2),
         "down_config": MoeGemvConfig(block_n=16, block_k=16, num_stages=2)}
# One column a program: stage 1's tile is the column's gate and up rows, stage 2's its k rows.
ONE_COLUMN = {"gate_up_config": MoeGemvConfig(block_n=1, block_k=16, num_stages=2),
              "down_config": MoeGemvConfig(block_n=1, block_k=32, num_stages=2)}


def routed(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(tokens * 31 + top_k)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights = torch.rand(tokens, top_k, generator=gen)
    w13, w2 = expert_weights(experts, hidden, inter, dtype, seed=top_k)
    return x, w13, w2, weights, crafted_ids(tokens, experts, top_k)


ROUTINGS = [
    (1, 8, 2),    # decode, one token
    (4, 5, 3),    # expert 0 every token, expert 4 none; k not a power of two (padded rows)
    (3, 4, 4),    # k = E: every expert
    (2, 3, 1),    # k = 1
]


@pytest.mark.parametrize("dtype,tiles,tokens,experts,top_k",
                         [(dtype, TILES, *r) for dtype in (torch.float32, torch.bfloat16) for r in ROUTINGS]
                         + [(torch.float32, ONE_COLUMN, *r) for r in ROUTINGS[:2]])
def test_moe_gemv_is_reference_and_grouped_gemm(dtype, tiles, tokens, experts, top_k) -> None:
    x, w13, w2, weights, ids = routed(tokens, experts, top_k, 40, 24, dtype)
    out = moe_gemv(x, w13, w2, weights, ids, **tiles)
    assert out.dtype == dtype and out.shape == (tokens, 40)
    ref = fused_moe_reference(x, w13, w2, weights, ids)
    grouped = fused_moe(x, w13, w2, weights, moe_align(ids, experts, 16), FusedMoeConfig(block_n=16, block_k=16))
    # The same rounding points as the grouped GEMM; only each dot product's fp32 order
    # differs (bf16: a rounding may land one ulp of 2**-8 apart, as in its own test).
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(out.float(), grouped.float(), rtol=tol, atol=tol)


def test_moe_gemv_default_tiles_and_a_wrong_choice_shows() -> None:
    """The default tiles (wider than these shapes: masked lanes) give the reference, and a
    routing that names another expert gives another output (the ids are read, not assumed)."""
    x, w13, w2, weights, ids = routed(2, 4, 2, 32, 16, torch.float32)
    out = moe_gemv(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    other = ids.clone()
    other[1, 1] = 3 if int(other[1, 1]) != 3 else 2
    assert not torch.allclose(moe_gemv(x, w13, w2, weights, other), out)


def test_moe_gemv_no_tokens() -> None:
    x, w13, w2, weights, ids = routed(1, 4, 2, 32, 16, torch.float32)
    assert moe_gemv(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)


def test_moe_gemv_refuses_bad_arguments() -> None:
    x, w13, w2, weights, ids = routed(2, 4, 2, 32, 16, torch.float32)
    with pytest.raises(TypeError, match="topk_ids"):
        moe_gemv(x, w13, w2, weights, ids.long())
    with pytest.raises(TypeError, match="w13"):
        moe_gemv(x, w13.half(), w2, weights, ids)
    with pytest.raises(ValueError, match="w13"):
        moe_gemv(x, w13[:, :8], w2, weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        moe_gemv(x, w13, w2, weights, ids[:, :1].contiguous())
    with pytest.raises(ValueError, match="topk_weights"):
        moe_gemv(x, w13, w2, weights[:1], ids)
    with pytest.raises(ValueError, match="block_n"):
        MoeGemvConfig(block_n=3)


def test_ops_moe_routes_one_token_through_the_gemv(monkeypatch) -> None:
    """At one bf16 token the router's logits come from the GEMV kernel (not cuBLAS), and the
    layer's output is the reference's."""
    import minivllm.kernels.gemv as gemv_module
    from minivllm.kernels.reference import moe_reference
    from minivllm.ops.dispatch import Ops

    calls = []
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    experts, hidden, inter = 128, 64, 32   # N = 128 routers: 32 programs of 4 columns
    x, w13, w2, _, _ = routed(1, experts, 2, hidden, inter, torch.bfloat16)
    router = (torch.randn(experts, hidden, generator=torch.Generator().manual_seed(3)) / 8).to(torch.bfloat16)
    ops = Ops.build("triton", torch.device("cpu"), torch.bfloat16)
    out = ops.moe(x, router, w13, w2, 2, True)
    assert calls == [(experts, hidden)]
    ref = moe_reference(x, router, w13, w2, 2, True)
    torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2)
