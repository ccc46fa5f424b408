"""Question: is the per-pair experts' stage 2 faster when a program loads each choice's act
row once a K step for all its columns, instead of once a weight row?

The product's stage 2 (``kernels/moe_gemv.py``, ``_down_kernel``) streams a 2D tile of
TOP_K x BLOCK_N weight rows, each with its own act row pointer: a program of n columns loads
each act row n times (from L1/L2), as many act bytes as weight bytes at bf16 and twice as many
at FP8; the sweep chose one column a program. Here the weight tile is (TOP_K, BLOCK_N,
BLOCK_K) and the act tile (TOP_K, BLOCK_K), broadcast over the columns: act bytes fall by
BLOCK_N, and a program can take more columns. Same rounding points as the product (each
choice's fp32 sum scaled by its weight and rounded, the k summed in fp32).

    PYTHONPATH=. python3 lab/moe_down_act_once.py          # GPU: check each tiling, then graph us
    TRITON_INTERPRET=1 PYTHONPATH=. python3 lab/moe_down_act_once.py --check   # CPU: check only
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from ab import alternating_medians
from minivllm.kernels._launch import takes_pdl
from minivllm.kernels.fp8 import FP8_DTYPE, FP8_GROUP
from minivllm.kernels.moe_gemv import DOWN_CONFIG, _down_kernel


@triton.jit
def _down_act_once_kernel(
    act_ptr, w2_ptr, ws_ptr, ids_ptr, weights_ptr, out_ptr, H, I,
    TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, FP8: tl.constexpr, BLOCK_SCALES: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    """Token t's k choices for BLOCK_N columns: a (TOP_K_POW2, BLOCK_N, BLOCK_K) weight tile,
    a (TOP_K_POW2, BLOCK_K) act tile. Block scales need BLOCK_K <= GROUP (one scale a row a
    step)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    choice = tl.arange(0, TOP_K_POW2)
    choice_ok = choice < TOP_K
    pair = token * TOP_K + tl.minimum(choice, TOP_K - 1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)                         # (C,)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = choice_ok[:, None] & (cols < H)[None, :]                        # (C, N)
    w_rows = w2_ptr + expert[:, None] * H * I + cols.to(tl.int64)[None, :] * I
    k_blocks = tl.cdiv(I, GROUP)
    s_rows = ws_ptr + expert[:, None] * tl.cdiv(H, GROUP) * k_blocks + (cols // GROUP)[None, :] * k_blocks
    acc = tl.zeros((TOP_K_POW2, BLOCK_N, BLOCK_K), tl.float32)
    for k0 in tl.range(0, I, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < I
        w = tl.load(w_rows[:, :, None] + k[None, None, :], mask=ok[:, :, None] & k_ok[None, None, :],
                    other=0.0).to(tl.float32)
        if BLOCK_SCALES:
            w = w * tl.load(s_rows + k0 // GROUP, mask=ok, other=0.0)[:, :, None]
        a = tl.load(act_ptr + pair[:, None] * I + k[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)
        acc += w * a[:, None, :]
    y = tl.sum(acc, axis=2)                                              # (C, N)
    if FP8 and not BLOCK_SCALES:
        y *= tl.load(ws_ptr + expert[:, None] * H + cols[None, :], mask=ok, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    dtype = out_ptr.dtype.element_ty
    scaled = (y * tl.load(weights_ptr + pair)[:, None]).to(dtype).to(tl.float32)
    total = tl.sum(tl.where(choice_ok[:, None], scaled, 0.0), axis=0)
    tl.store(out_ptr + token * H + cols, total.to(dtype), mask=cols < H)


def down(kernel, act, w2, ws, ids, weights, tile, pdl=False):
    """Stage 2 alone through ``kernel`` (the product's or this one), tile (n, k, warps, stages)."""
    tokens, top_k = ids.shape
    hidden, inter = w2.shape[1], w2.shape[2]
    block_n, block_k, warps, stages = tile
    out = torch.empty(tokens, hidden, dtype=act.dtype, device=act.device)
    use_pdl = takes_pdl(pdl, act)
    launch = {"launch_pdl": True} if use_pdl else {}
    kernel[(tokens, triton.cdiv(hidden, block_n))](
        act, w2, w2 if ws is None else ws, ids, weights, out, hidden, inter, TOP_K=top_k,
        TOP_K_POW2=triton.next_power_of_2(top_k), FP8=ws is not None, BLOCK_SCALES=ws is not None,
        GROUP=FP8_GROUP, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, PDL=use_pdl,
        num_warps=warps, num_stages=stages, **launch)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="a tiny MoE on the CPU, checked only")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    experts, top_k, hidden, inter = (8, 3, 256, 256) if args.check else (128, 8, 2048, 768)
    gen = torch.Generator(device).manual_seed(0)
    copies = 1 if args.check else 3                        # each call streams from memory, not L2
    product = (DOWN_CONFIG.block_n, DOWN_CONFIG.block_k, DOWN_CONFIG.num_warps, DOWN_CONFIG.num_stages)
    tiles = [(1, 128, 4, 3), (2, 128, 4, 3), (4, 128, 4, 3), (8, 128, 4, 3), (4, 128, 8, 3), (8, 128, 8, 3),
             (16, 128, 8, 3), (4, 64, 4, 4), (8, 64, 4, 4)]
    if args.check:
        tiles = [(1, 128, 4, 3), (4, 64, 4, 3)]
    for fmt in ("bf16", "fp8"):
        w2s, scales = [], []
        for _ in range(copies):
            w = torch.randn(experts, hidden, inter, generator=gen, device=device) / inter ** 0.5
            if fmt == "fp8":
                s = torch.rand(experts, hidden // FP8_GROUP, inter // FP8_GROUP, generator=gen, device=device) * 0.02
                w2s.append((w / 0.01).clamp(-448, 448).to(FP8_DTYPE))
                scales.append(s + 0.005)
            else:
                w2s.append(w.to(dtype))
                scales.append(None)
        for tokens in (1, 4):
            ids = torch.stack([torch.randperm(experts, generator=gen, device=device)[:top_k]
                               for _ in range(tokens)]).to(torch.int32)
            weights = torch.rand(tokens, top_k, generator=gen, device=device)
            act = torch.randn(tokens * top_k, inter, generator=gen, device=device).to(dtype)
            ref = down(_down_kernel, act, w2s[0], scales[0], ids, weights, product)
            variants = {f"product {product[0]}x{product[1]} w{product[2]}":
                        lambda i: down(_down_kernel, act, w2s[i % copies], scales[i % copies], ids, weights,
                                       product, pdl=True)}
            for tile in tiles:
                out = down(_down_act_once_kernel, act, w2s[0], scales[0], ids, weights, tile)
                torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
                same = "bit-identical" if torch.equal(out, ref) else f"max diff {(out - ref).abs().max().item():.1e}"
                print(f"{fmt} {tokens} token(s), act once {tile}: {same} to the product's stage 2")
                variants[f"act once {tile[0]}x{tile[1]} w{tile[2]} s{tile[3]}"] = (
                    lambda i, t=tile: down(_down_act_once_kernel, act, w2s[i % copies], scales[i % copies], ids,
                                           weights, t, pdl=True))
            if args.check or device != "cuda":
                continue
            us = alternating_medians(variants, calls=6)
            mb = tokens * top_k * hidden * inter * w2s[0].element_size() / 1e6
            for name, t in sorted(us.items(), key=lambda kv: kv[1]):
                print(f"  {fmt} {tokens} token(s) {name:28s} {t:6.2f} us ({mb * 1e3 / t:6.0f} GB/s of weights)", flush=True)


if __name__ == "__main__":
    main()
