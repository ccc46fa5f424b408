"""Question: at one token, is a sparse layer faster when the per-pair GEMV's stage 1 routes
for itself, with no top-k kernel between the router and the experts?

The product runs router GEMV -> ``moe_topk`` -> stage 1 -> stage 2 (``kernels/moe_gemv.py``),
each a node of the step's dependent chain. Here every stage-1 program reads its token's E
router logits (512 bytes at Qwen3-30B-A3B), takes the same softmax and top-k as
``moe_topk`` (its ``route_row``: the same ids, and the weights to rounding), streams
its expert's rows, and the programs of the first column block write the pair's id and
weight for stage 2 (the product's ``_down_kernel``, unchanged). One launch fewer a layer;
each program does a top-k of E values before its first weight load.

    PYTHONPATH=. python3 lab/moe_routing_in_stage1.py            # GPU: check, then graph us A/B
    TRITON_INTERPRET=1 PYTHONPATH=. python3 lab/moe_routing_in_stage1.py --check   # CPU: check only
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ab import alternating_medians
from minivllm.kernels._launch import next_pow2, takes_pdl
from minivllm.kernels.fp8 import FP8_GROUP
from minivllm.kernels.fused_moe import _scale_ptrs
from minivllm.kernels.moe_gemv import DOWN_CONFIG, GATE_UP_CONFIG, _down_kernel, _rows_dot, moe_gemv
from minivllm.kernels.moe_topk import moe_topk, route_row
from minivllm.kernels.silu_and_mul import gated_silu


@triton.jit
def _gate_up_routed_kernel(
    x_ptr, logits_ptr, w13_ptr, ids_ptr, weights_ptr, act_ptr,
    stride_x, stride_l, I, H,
    E: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, NORM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
):
    """``moe_gemv``'s stage 1 (16-bit experts) that routes its pair itself: ``moe_topk``'s
    softmax and top-k of the token's logits, then choice j's expert."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    pair = tl.program_id(0)
    token = (pair // TOP_K).to(tl.int64)
    choice = pair % TOP_K
    experts = tl.arange(0, BLOCK_E)
    valid = experts < E
    logits = tl.load(logits_ptr + token * stride_l + experts, mask=valid, other=-float("inf")).to(tl.float32)
    p, rank = route_row(logits, experts, valid, TOP_K, NORM, BLOCK_E)
    mine = rank == choice
    expert = tl.sum(tl.where(mine, experts, 0), axis=0).to(tl.int64)
    if tl.program_id(1) == 0:
        tl.store(ids_ptr + pair, expert.to(tl.int32))
        tl.store(weights_ptr + pair, tl.sum(tl.where(mine, p, 0.0), axis=0))
    r = tl.arange(0, 2 * BLOCK_N)
    cols = tl.program_id(1) * BLOCK_N + r // 2
    row_ok = cols < I
    w_row = (r % 2) * I + cols
    y = _rows_dot(w13_ptr + expert * 2 * I * H + w_row.to(tl.int64)[:, None] * H,
                  _scale_ptrs(w13_ptr, expert, 2 * I, w_row, H, False, 128),
                  x_ptr + token * stride_x, H, row_ok, False, False, BLOCK_K, 128, NUM_STAGES)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    gate, up = tl.split(tl.reshape(y, (BLOCK_N, 2)))
    dtype = act_ptr.dtype.element_ty
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(act_ptr + pair.to(tl.int64) * I + cols, gated_silu(gate.to(dtype), up.to(dtype), dtype),
             mask=cols < I)


def routed_experts(x, logits, w13, w2, top_k, norm, pdl=False):
    """(out, weights, ids): the 16-bit experts of ``moe_gemv`` routed inside stage 1."""
    tokens, hidden = x.shape
    experts, inter = w13.shape[0], w2.shape[2]
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    act = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    use_pdl = takes_pdl(pdl, x)
    launch = {"launch_pdl": True} if use_pdl else {}
    g, d = GATE_UP_CONFIG, DOWN_CONFIG
    _gate_up_routed_kernel[(tokens * top_k, triton.cdiv(inter, g.block_n))](
        x, logits, w13, ids, weights, act, x.stride(0), logits.stride(0), inter, hidden,
        E=experts, BLOCK_E=next_pow2(experts), TOP_K=top_k, NORM=norm, BLOCK_N=g.block_n, BLOCK_K=g.block_k,
        NUM_STAGES=g.num_stages, PDL=use_pdl, num_warps=g.num_warps, num_stages=g.num_stages, **launch)
    _down_kernel[(tokens, triton.cdiv(hidden, d.block_n))](
        act, w2, w2, ids, weights, out, hidden, inter, TOP_K=top_k, TOP_K_POW2=triton.next_power_of_2(top_k),
        FP8=False, BLOCK_SCALES=False, GROUP=FP8_GROUP, BLOCK_N=d.block_n, BLOCK_K=d.block_k,
        NUM_STAGES=d.num_stages, PDL=use_pdl, num_warps=d.num_warps, num_stages=d.num_stages, **launch)
    return out, weights, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="a tiny MoE on the CPU, checked only")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    experts, top_k, hidden, inter = (8, 3, 64, 32) if args.check else (128, 8, 2048, 768)
    gen = torch.Generator(device).manual_seed(0)
    copies = 1 if args.check else 2                       # 2 x 1.2 GB: each call streams from memory
    w13 = [torch.randn(experts, 2 * inter, hidden, generator=gen, device=device).to(dtype) / hidden ** 0.5
           for _ in range(copies)]
    w2 = [torch.randn(experts, hidden, inter, generator=gen, device=device).to(dtype) / inter ** 0.5
          for _ in range(copies)]
    router = torch.randn(experts, hidden, generator=gen, device=device).to(dtype) / hidden ** 0.5
    for tokens in (1, 3):
        x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
        logits = F.linear(x, router)
        w_ref, ids_ref = moe_topk(logits, top_k, True)
        ref = moe_gemv(x, w13[0], w2[0], w_ref, ids_ref)
        out, weights, ids = routed_experts(x, logits, w13[0], w2[0], top_k, True)
        # The same ids; the weights to an ulp or so: the softmax's sums reduce in another order
        # when the kernel has another number of warps (on the GPU; the interpreter is exact).
        assert torch.equal(ids, ids_ref), (ids, ids_ref)
        torch.testing.assert_close(weights, w_ref, rtol=1e-6, atol=0)
        assert torch.equal(out, moe_gemv(x, w13[0], w2[0], weights, ids)), "stage 2 of the routed pairs"
        worst = (weights - w_ref).abs().max().item()
        print(f"{tokens} token(s): the same ids as moe_topk, weights within {worst:.1e}, and the "
              f"output moe_gemv gives for them")
        if args.check or device != "cuda":
            continue
        def a(i):
            w, d = moe_topk(logits, top_k, True, pdl=True)
            return moe_gemv(x, w13[i % copies], w2[i % copies], w, d, pdl=True)

        def b(i):
            return routed_experts(x, logits, w13[i % copies], w2[i % copies], top_k, True, pdl=True)[0]
        us = alternating_medians({"apart": a, "in stage 1": b}, calls=4)
        print(f"  moe_topk + moe_gemv {us['apart']:.1f} us, routed in stage 1 {us['in stage 1']:.1f} us "
              f"(medians of 3, alternating; router logits given)", flush=True)


if __name__ == "__main__":
    main()
