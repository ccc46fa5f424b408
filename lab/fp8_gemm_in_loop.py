"""The FP8 GEMM with x quantized inside its K loop, against the product's road (x quantized
once first, ``kernels/fp8_quant.py``, then the e4m3 x e4m3 kernel of ``kernels/fp8_gemm.py``).

    PYTHONPATH=. python3 lab/fp8_gemm_in_loop.py [--models 0.6b,8b] [--rows 16,64,256,2048] [--rounds 3]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 lab/fp8_gemm_in_loop.py --smoke

The in-loop road is one launch: every column program loads its 16-bit x rows and quantizes
each 128-column group itself before the dot, by the product's rule (``fp8.e4m3_scales``,
``fp8.quantize_e4m3``), so the same values; no (M, K) e4m3 buffer and no second launch, but
the quantization runs cdiv(N, BLOCK_N) times over, a few ALU ops per element beside the
tensor-core dot::

    for each 128-column group g of K:
        xt   = x[rows, g]                        (BLOCK_M, 128) bf16 -> fp32
        xs   = amax over each row / 448          (BLOCK_M,)   block mode: this group's
        xq   = e4m3(xt * (1 / xs))               (BLOCK_M, 128)
        acc += (xq @ W[cols, g]^T) * xs[:, None] * s[cols // 128, g][None, :]

    channel mode: a first pass over the program's x rows for each row's amax over all of K,
    then the loop accumulates xq @ W^T unscaled and the epilogue scales once.

The linear shapes of one layer of each model (``benchmarks.gemv.decode_gemms``), both scale
modes, each road with the product's tiles for the row count (``fp8_gemm.default_config``):
checked against each other (bit for bit where the GPU sums both in one order), then timed in
a CUDA graph (``benchmarks.gpu_timing.graph_us``) over enough weight copies that L2 holds
none, the two roads alternating over rounds; the median of the rounds is printed.
``--smoke``: tiny shapes on the CPU under the Triton interpreter, checked, untimed.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from minivllm.config import FP8_WEIGHT_BLOCK
from minivllm.kernels.fp8 import (
    FP8_GROUP, ScaleMode, e4m3_scales, exact_cast, quantize_e4m3, quantize_fp8_block, quantize_fp8_per_channel,
)
from minivllm.kernels._gemm_tiles import wt_tile, x_tile
from minivllm.kernels.fp8_gemm import Fp8GemmConfig, check_args, default_config, fp8_gemm

L2_FLUSH_BYTES = 256 << 20   # weight bytes cycled per timing: more than an H200's 50 MB L2
SMOKE_GEMMS = [("smoke qkv", 128, 64), ("smoke down", 64, 320)]
SMOKE_ROWS = (1, 16, 64)


@triton.jit
def _in_loop_kernel(
    x_ptr,                  # (M, K) bf16/fp16, last dim contiguous
    w_ptr,                  # (N, K) float8e4nv contiguous
    ws_ptr,                 # BLOCK_SCALES: (cdiv(N, GROUP), cdiv(K, GROUP)) float32; else (N,) float32
    y_ptr,                  # (M, N) contiguous, x's dtype
    M, N, K,
    stride_xm,
    BLOCK_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
    EXACT_CAST: tl.constexpr,    # CPU interpreter: round to e4m3 before the cast (fp8.to_e4m3)
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm              # (BLOCK_M, 1)
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * K                      # (1, BLOCK_N): W^T tiles
    offs_k = tl.arange(0, GROUP)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if BLOCK_SCALES:
        ws_rows = ws_ptr + (cols // GROUP) * tl.cdiv(K, GROUP)           # (BLOCK_N,)
        for k0 in range(0, K, GROUP):
            x = x_tile(x_rows, k0 + offs_k, row_ok, K).to(tl.float32)
            xs, inv = e4m3_scales(tl.max(tl.abs(x), axis=1))
            xq = quantize_e4m3(x, inv[:, None], EXACT_CAST)
            d = tl.dot(xq, wt_tile(w_cols, k0 + offs_k, col_ok, K))
            ws = tl.load(ws_rows + k0 // GROUP, mask=col_ok, other=0.0)
            acc += d * xs[:, None] * ws[None, :]
    else:
        amax = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, GROUP):
            amax = tl.maximum(amax, tl.max(tl.abs(x_tile(x_rows, k0 + offs_k, row_ok, K).to(tl.float32)), axis=1))
        xs, inv = e4m3_scales(amax)
        for k0 in range(0, K, GROUP):
            xq = quantize_e4m3(x_tile(x_rows, k0 + offs_k, row_ok, K).to(tl.float32), inv[:, None], EXACT_CAST)
            acc = tl.dot(xq, wt_tile(w_cols, k0 + offs_k, col_ok, K), acc)
        acc = acc * xs[:, None] * tl.load(ws_ptr + cols, mask=col_ok, other=0.0)[None, :]
    out = y_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fp8_gemm_in_loop(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, mode: ScaleMode,
                     config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """What ``fp8_gemm`` returns (its arguments and checks), with x quantized in the K loop."""
    check_args(x, weight, weight_scale, mode)
    config = config or default_config(x.shape[0])
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    _in_loop_kernel[(triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n))](
        x, weight, weight_scale, y, m, n, k, x.stride(0),
        BLOCK_SCALES=mode == "block", BLOCK_M=config.block_m, BLOCK_N=config.block_n, GROUP=FP8_GROUP,
        EXACT_CAST=exact_cast(x), num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y


ROADS = {"in loop": fp8_gemm_in_loop, "quantized first": fp8_gemm}


def weights(n: int, k: int, mode: ScaleMode, copies: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``copies`` random (N, K) weights of N(0, 1 / K), quantized in ``mode``."""
    gen = torch.Generator(device=device).manual_seed(n * 7 + k)
    out = []
    for _ in range(copies):
        w = torch.randn(n, k, generator=gen, device=device) / k ** 0.5
        out.append(quantize_fp8_block(w, FP8_WEIGHT_BLOCK) if mode == "block" else quantize_fp8_per_channel(w))
    return out


def compare(name: str, n: int, k: int, mode: ScaleMode, rows: int, ws: list, rounds: int, timed: bool) -> None:
    """Check the two roads against each other at x (rows, K), then time them (``timed``)."""
    device = ws[0][0].device
    x = torch.randn(rows, k, generator=torch.Generator(device=device).manual_seed(rows), device=device,
                    dtype=torch.bfloat16)
    outs = {road: f(x, *ws[0], mode) for road, f in ROADS.items()}
    same = torch.equal(outs["in loop"], outs["quantized first"])
    torch.testing.assert_close(outs["in loop"].float(), outs["quantized first"].float(), rtol=1.6e-2, atol=1e-2)
    line = f"{name:>12} {mode:>7} M={rows:<5} {n:>6} x {k:<6} {'same bits' if same else 'close':>9}"
    if timed:
        from benchmarks.gpu_timing import graph_us

        times: dict[str, list[float]] = {road: [] for road in ROADS}
        for _ in range(rounds):
            for road, f in ROADS.items():
                times[road].append(graph_us(lambda i, f=f: f(x, *ws[i], mode), len(ws)))
        us = {road: statistics.median(t) for road, t in times.items()}
        line += "".join(f"  {road} {t:8.2f} us" for road, t in us.items())
        line += f"  in loop / first {us['in loop'] / us['quantized first']:.2f}"
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="0.6b,8b")
    ap.add_argument("--rows", default="16,64,256,2048")
    ap.add_argument("--modes", default="block,channel")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1), untimed")
    args = ap.parse_args()
    if args.smoke:
        gemms, rows, device = SMOKE_GEMMS, SMOKE_ROWS, "cpu"
    else:
        from benchmarks.gemv import decode_gemms

        gemms = [g for model in args.models.split(",") for g in decode_gemms(model)]
        rows, device = tuple(int(r) for r in args.rows.split(",")), "cuda"
    for name, n, k in gemms:
        for mode in args.modes.split(","):
            copies = 1 if args.smoke else max(2, -(-L2_FLUSH_BYTES // (n * k)))
            ws = weights(n, k, mode, copies, device)  # type: ignore[arg-type]
            for m in rows:
                compare(name, n, k, mode, m, ws, args.rounds, timed=not args.smoke)  # type: ignore[arg-type]
            del ws


if __name__ == "__main__":
    main()
