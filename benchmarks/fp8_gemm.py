"""The FP8 linear-layer kernels (``kernels/fp8_gemm.py``, ``kernels/fp8_gemv.py``) against
cuBLAS in bf16 and ``torch._scaled_mm``, at the linear shapes of Qwen3-0.6B and Qwen3-8B.

    PYTHONPATH=. python3 -m benchmarks.fp8_gemm [--quick] [--sweep] [--rows 1,16,64,256,2048]
        [--models 0.6b,8b] [--modes block,channel]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 -m benchmarks.fp8_gemm --smoke

A layer's four GEMMs (``benchmarks.gemv.decode_gemms``: qkv (H + 2 Hkv) D x hidden, o
hidden x H D, gate_up 2 I x hidden, down hidden x I), random weights quantized to e4m3 in
each scale mode (``block``: 128x128 blocks, as Qwen3-FP8 checkpoints; ``channel``: one scale
per output channel), x bf16 of M rows. Per (GEMM, mode, M) each implementation of y = x W^T:

- ``fp8_gemm``: W8A8, x quantized per token (and 128-column group) first (``kernels/fp8_quant.py``),
  then the e4m3 x e4m3 kernel;
- ``scaled_mm``: the same product, x quantized in torch, then ``torch._scaled_mm``
  (``scaled_mm_fp8``); ``unsupported: <reason>`` where torch or cuBLAS lacks the mode on the
  device (row-wise: sm89 / sm90; 128x128 blocks: cuBLAS >= 12.9);
- ``fp8_gemv``: at M = 1 only, the one-row kernel (weight-only: x stays bf16);
- ``cublas_bf16``: ``F.linear`` on the dequantized weights rounded to bf16, the 16-bit baseline.

Checked first, on weight copy 0: the two W8A8 ones against ``fp8_gemm_reference``, the other
two against ``fp8_gemv_reference`` (the dequantized W, float32), |y - ref| <= 1e-2 +
1.6e-2 |ref| as the GPU kernel tests; a mismatch raises. Then timed in a CUDA graph
(``benchmarks.gpu_timing.graph_us``), one call per weight copy, with enough copies that L2
holds none of them. Each number:

- ``us``: GPU time per call, the median over the graph's replays;
- ``GB/s``: the bytes that must be read (the weights as this implementation reads them: e4m3
  and float32 scales, or bf16; and x) over ``us``;
- ``% of copy``: GB/s over the device-to-device copy bandwidth measured in the run;
- ``TFLOP/s``: 2 M N K over ``us`` (the measure where M is large and the product compute-bound);
- ``x cuBLAS``: cuBLAS bf16's us over this one's.

``--sweep``: also every tile config of ``GEMV_SWEEP`` (one row) and ``GEMM_SWEEP`` (more rows),
each checked and timed as a contender of its own (``fp8_gemv[16x128 w4 s3]``), and per row the
fastest of each kernel beside its default's time: the run that sets ``fp8_gemv.default_config``
and ``fp8_gemm.default_config``. ``--quick``: M = 1, 64, 2048 only. ``--smoke``: on the CPU under ``TRITON_INTERPRET=1`` (the Triton
kernels in the interpreter), tiny shapes, every check, nothing timed, no CUDA call.
Summary: ``$OUT/fp8_gemm.json``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks.gemv import decode_gemms
from benchmarks.gpu_timing import copy_bandwidth_gbs, graph_us
from benchmarks.report import write_summary
from benchmarks.throughput import bench_device
from minivllm.config import FP8_WEIGHT_BLOCK
from minivllm.envs import TRITON_INTERPRET, triton_interpreted
from minivllm.kernels.fp8 import (
    SCALE_MODES, ScaleMode, dequantize_fp8_weight, quantize_fp8_block, quantize_fp8_per_channel,
)
from minivllm.kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm, scaled_mm_fp8
from minivllm.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv
from minivllm.kernels.reference import fp8_gemm_reference, fp8_gemv_reference

ROWS = (1, 16, 64, 256, 2048)
QUICK_ROWS = (1, 64, 2048)
SMOKE_ROWS = (1, 16, 64)     # the three row tiles of fp8_gemm.default_config that these reach
# (name, N, K): K < 128 (one partial activation group), K = 320 (two full and a partial one);
# N = 64 a partial 128-row weight block. Multiples of 16, as _scaled_mm on CUDA wants.
SMOKE_GEMMS = [("smoke qkv", 128, 64), ("smoke down", 64, 320)]
MODELS = ("0.6b", "8b", "8b-tp2")   # what benchmarks.gemv.decode_gemms knows
L2_FLUSH_BYTES = 256 << 20   # weight bytes cycled per timing: more than the H200's 50 MB L2
RTOL, ATOL = 1.6e-2, 1e-2    # bf16, as the GPU kernel tests
X_SEED = 1 << 16              # x: X_SEED + M; the weights: the GEMM's index (far below)
# What torch raises for a scaling mode it lacks on a device ("Invalid scaling configuration"
# is a ValueError), and what scaled_mm_fp8 raises for block scales off CUDA.
UNSUPPORTED = (RuntimeError, NotImplementedError, ValueError)


@dataclass(frozen=True)
class Weights:
    """``copies`` random weights of one GEMM in one scale mode, in both forms a contender
    reads; the timed calls cycle over them so that L2 holds none (copy 0 is the checked one)."""

    mode: ScaleMode
    fp8: list[torch.Tensor]      # (N, K) float8_e4m3fn each
    scales: list[torch.Tensor]   # float32: block (cdiv(N, 128), cdiv(K, 128)); channel (N,)
    bf16: list[torch.Tensor]     # (N, K): fp8 * scales rounded to bf16, cuBLAS's operand

    def fp8_args(self, copy: int) -> tuple[torch.Tensor, torch.Tensor, ScaleMode]:
        """``(weight, weight_scale, mode)`` of ``copy``, as the FP8 kernels take them."""
        return self.fp8[copy], self.scales[copy], self.mode

    def fp8_bytes(self) -> int:
        """Bytes of one copy as an FP8 kernel reads it: the e4m3 values and their scales."""
        return self.fp8[0].nbytes + self.scales[0].nbytes


def make_weights(n: int, k: int, mode: ScaleMode, copies: int, device: str, seed: int) -> Weights:
    """N(0, 1 / K) weights (outputs O(1) for x ~ N(0, 1)), quantized in ``mode``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    fp8, scales, bf16 = [], [], []
    for _ in range(copies):
        w = torch.randn(n, k, generator=gen, device=device) / k ** 0.5
        w8, s = quantize_fp8_block(w, FP8_WEIGHT_BLOCK) if mode == "block" else quantize_fp8_per_channel(w)
        fp8.append(w8)
        scales.append(s)
        bf16.append(dequantize_fp8_weight(w8, s, mode).to(torch.bfloat16))
    return Weights(mode, fp8, scales, bf16)


def w8a8_reference(x: torch.Tensor, w: Weights) -> torch.Tensor:
    """x quantized as the W8A8 kernels quantize it, both operands dequantized, float32."""
    return fp8_gemm_reference(x, *w.fp8_args(0))


def dequantized_reference(x: torch.Tensor, w: Weights) -> torch.Tensor:
    """bf16 x times the dequantized W, float32."""
    return fp8_gemv_reference(x, *w.fp8_args(0))


def bf16_reference(x: torch.Tensor, w: Weights) -> torch.Tensor:
    """bf16 x times cuBLAS's own operand (the dequantized W rounded to bf16), float32: against
    the unrounded W, that rounding alone put one of 12.6 million outputs past the tolerance
    (Qwen3-8B's qkv at M = 2048)."""
    return x.float() @ w.bf16[0].float().T


@dataclass(frozen=True)
class Contender:
    """One implementation of y = x W^T: its call on weight copy ``c``, the reference it is
    checked against, and the weight form it reads."""

    name: str
    run: Callable[[torch.Tensor, Weights, int], torch.Tensor]
    reference: Callable[[torch.Tensor, Weights], torch.Tensor]
    reads_fp8: bool                    # e4m3 + scales; else the bf16 copies
    one_row: bool = False              # runs at M = 1 only
    may_be_unsupported: bool = False   # torch may lack the mode on the device: reported, not raised


CONTENDERS: tuple[Contender, ...] = (
    Contender("fp8_gemm", lambda x, w, c: fp8_gemm(x, *w.fp8_args(c)), w8a8_reference, reads_fp8=True),
    Contender("scaled_mm", lambda x, w, c: scaled_mm_fp8(x, *w.fp8_args(c)), w8a8_reference, reads_fp8=True,
              may_be_unsupported=True),
    Contender("fp8_gemv", lambda x, w, c: fp8_gemv(x, *w.fp8_args(c)), dequantized_reference, reads_fp8=True,
              one_row=True),
    Contender("cublas_bf16", lambda x, w, c: F.linear(x, w.bf16[c]), bf16_reference, reads_fp8=False),
)


# Tiles --sweep times: (block_n, block_k, num_warps, num_stages) of the one-row GEMV, (block_m,
# block_n, num_warps, num_stages) of the GEMM; the smoke run checks two of each.
GEMV_SWEEP = [(bn, bk, 4, ns) for bn in (4, 8, 16, 32) for bk in (128, 256, 512) for ns in (3, 5)]
GEMM_SWEEP = [(16, 64, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 8, 4), (128, 64, 4, 4),
              (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 2)]
SMOKE_SWEEP = ([(8, 256, 4, 2), (16, 128, 4, 3)], [(16, 64, 4, 2), (32, 32, 4, 2)])


def sweep_contenders(gemv_tiles: list[tuple[int, ...]], gemm_tiles: list[tuple[int, ...]]) -> tuple[Contender, ...]:
    """One contender per tile config: the GEMV's at one row, the GEMM's at more."""
    out = []
    for bn, bk, nw, ns in gemv_tiles:
        cfg = Fp8GemvConfig(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
        out.append(Contender(f"fp8_gemv[{bn}x{bk} w{nw} s{ns}]", lambda x, w, c, cfg=cfg: fp8_gemv(
            x, *w.fp8_args(c), config=cfg), dequantized_reference, reads_fp8=True, one_row=True))
    for bm, bn, nw, ns in gemm_tiles:
        cfg = Fp8GemmConfig(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
        name = f"fp8_gemm[{bm}x{bn} w{nw} s{ns}]"
        out.append(Contender(name, lambda x, w, c, cfg=cfg: fp8_gemm(x, *w.fp8_args(c), config=cfg),
                             w8a8_reference, reads_fp8=True))
    return tuple(out)


def best_of_sweep(row: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per kernel (``fp8_gemv``, ``fp8_gemm``): its fastest swept tiles and their us beside
    the default's (the contender without tiles in its name)."""
    best = {}
    for kernel in ("fp8_gemv", "fp8_gemm"):
        timed = {n: e["us"] for n, e in row["results"].items() if n.startswith(kernel + "[") and "us" in e}
        default = row["results"].get(kernel, {}).get("us")
        if timed and default is not None:
            name = min(timed, key=timed.__getitem__)
            best[kernel] = dict(tiles=name[len(kernel):], us=timed[name], default_us=default,
                                x_default=default / timed[name])
    return best


def check_close(what: str, y: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest |y - ref|, after checking |y - ref| <= ATOL + RTOL |ref| everywhere.

    Raises:
        AssertionError: a shape that differs, or an element (NaN included) out of tolerance.
    """
    if y.shape != ref.shape:
        raise AssertionError(f"{what}: shape {tuple(y.shape)}, the reference's {tuple(ref.shape)}")
    err = (y.float() - ref.float()).abs()
    bad = ~(err <= ATOL + RTOL * ref.float().abs())
    if bool(bad.any()):
        raise AssertionError(f"{what}: {int(bad.sum())} of {err.numel()} elements off the reference "
                             f"(max error {float(err.nan_to_num(float('inf')).max()):.3g}, "
                             f"tolerance {ATOL:g} + {RTOL:g} |ref|)")
    return float(err.max()) if err.numel() else 0.0


def bench_row(name: str, rows: int, w: Weights, device: str, copy_gbs: float | None,
              contenders: tuple[Contender, ...] = CONTENDERS) -> dict[str, Any]:
    """Every contender at x (rows, K) on ``w``: checked, then timed unless ``copy_gbs`` is None.

    Raises:
        AssertionError: a contender's output off its reference (``check_close``).
    """
    (n, k), copies = w.fp8[0].shape, len(w.fp8)
    # A seed apart from the weights' (make_weights): a shared stream would correlate x with W.
    gen = torch.Generator(device=device).manual_seed(X_SEED + rows)
    x = torch.randn(rows, k, generator=gen, device=device, dtype=torch.bfloat16)
    row: dict[str, Any] = {"gemm": name, "mode": w.mode, "M": rows, "N": n, "K": k, "weight_copies": copies,
                           "fp8_bytes": w.fp8_bytes() + x.nbytes, "bf16_bytes": w.bf16[0].nbytes + x.nbytes,
                           "results": {}}
    refs: dict[Callable[..., torch.Tensor], torch.Tensor] = {}
    for c in contenders:
        if c.one_row and rows != 1:
            continue
        try:
            y = c.run(x, w, 0)
        except UNSUPPORTED as exc:
            if not c.may_be_unsupported:
                raise
            row["results"][c.name] = {"unsupported": first_line(exc)}
            continue
        if c.reference not in refs:
            refs[c.reference] = c.reference(x, w)
        ref = refs[c.reference]
        entry: dict[str, Any] = {"max_err": check_close(f"{c.name} at {name} M={rows} {w.mode}", y, ref)}
        if copy_gbs is not None:
            nbytes = row["fp8_bytes"] if c.reads_fp8 else row["bf16_bytes"]
            us = graph_us(lambda i, c=c: c.run(x, w, i), copies)
            entry.update(us=us, GBs=nbytes / us / 1e3, pct_copy=100 * nbytes / us / 1e3 / copy_gbs,
                         TFLOPs=2 * rows * n * k / us / 1e6)
        row["results"][c.name] = entry
    cublas_us = row["results"].get("cublas_bf16", {}).get("us")
    for entry in row["results"].values():
        if cublas_us is not None and "us" in entry:
            entry["x_cublas"] = cublas_us / entry["us"]
    return row


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 160 characters), for a one-line report."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def print_row(row: dict[str, Any]) -> None:
    print(f"{row['gemm']:>14} {row['mode']:>7} M={row['M']:<4} {row['N']:>5} x {row['K']:<5}"
          f" ({row['weight_copies']} copies)", flush=True)
    for name, e in row["results"].items():
        if "unsupported" in e:
            print(f"    {name:>11}  unsupported: {e['unsupported']}", flush=True)
        elif "us" not in e:
            print(f"    {name:>11}  checked (max error {e['max_err']:.2e}), untimed", flush=True)
        else:
            speed = f"  x{e['x_cublas']:.2f} cuBLAS" if "x_cublas" in e else ""
            print(f"    {name:>11} {e['us']:9.2f} us {e['GBs']:7,.0f} GB/s {e['pct_copy']:5.1f}% of copy "
                  f"{e['TFLOPs']:7.1f} TFLOP/s{speed}", flush=True)


def run_gemms(gemms: list[tuple[str, int, int]], modes: list[str], rows: tuple[int, ...], device: str,
              copy_gbs: float | None, contenders: tuple[Contender, ...] = CONTENDERS) -> list[dict[str, Any]]:
    """One row per (GEMM, mode, M); the weights made once per (GEMM, mode)."""
    results = []
    for seed, (name, n, k) in enumerate(gemms):
        for mode in modes:
            copies = 1 if copy_gbs is None else max(2, -(-L2_FLUSH_BYTES // (n * k)))
            w = make_weights(n, k, mode, copies, device, seed)  # type: ignore[arg-type]
            for m in rows:
                results.append(bench_row(name, m, w, device, copy_gbs, contenders))
                print_row(results[-1])
                if len(contenders) > len(CONTENDERS):
                    results[-1]["best"] = best_of_sweep(results[-1])
                    for kernel, b in results[-1]["best"].items():
                        print(f"    best {kernel}{b['tiles']}: {b['us']:.2f} us, default {b['default_us']:.2f} us "
                              f"(x{b['x_default']:.2f})", flush=True)
            del w
            if device == "cuda":
                torch.cuda.empty_cache()
    return results


def comma_list(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"M = {', '.join(map(str, QUICK_ROWS))} only")
    ap.add_argument("--rows", default=None, help=f"a comma list of M (default {','.join(map(str, ROWS))})")
    ap.add_argument("--models", default="0.6b,8b", help=f"a comma list of {', '.join(MODELS)} (one rank at TP=2)")
    ap.add_argument("--modes", default=",".join(SCALE_MODES), help="block, channel, a comma list")
    ap.add_argument("--sweep", action="store_true", help="also time the tile configs of GEMV_SWEEP and GEMM_SWEEP")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, checked, untimed")
    args = ap.parse_args(argv)
    unknown = [m for m in comma_list(args.modes) if m not in SCALE_MODES]
    if unknown:
        ap.error(f"unknown --modes {unknown}; known: {list(SCALE_MODES)}")
    unknown = [m for m in comma_list(args.models) if m not in MODELS]
    if unknown:
        ap.error(f"unknown --models {unknown}; known: {list(MODELS)}")
    if args.smoke and not triton_interpreted():
        ap.error(f"--smoke runs the Triton kernels on the CPU: set {TRITON_INTERPRET}=1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = bench_device(args)
    if args.smoke:
        gemms, rows = SMOKE_GEMMS, SMOKE_ROWS
    else:
        gemms = [g for model in comma_list(args.models) for g in decode_gemms(model)]
        rows = tuple(int(r) for r in args.rows.split(",")) if args.rows else QUICK_ROWS if args.quick else ROWS
    copy_gbs = None if args.smoke else copy_bandwidth_gbs(device)
    print(f"FP8 linear layers on {device}" + (f", copy bandwidth {copy_gbs:,.0f} GB/s" if copy_gbs else
                                              " (smoke: checked, untimed)"), flush=True)
    contenders = CONTENDERS
    if args.sweep:
        contenders += sweep_contenders(*(SMOKE_SWEEP if args.smoke else (GEMV_SWEEP, GEMM_SWEEP)))
    results = run_gemms(gemms, comma_list(args.modes), rows, device, copy_gbs, contenders)
    write_summary("fp8_gemm", {"args": vars(args), "copy_gbs": copy_gbs, "rows": results})


if __name__ == "__main__":
    main()
