"""The GEMV kernel (``kernels/gemv.py``) against cuBLAS (``F.linear``) at decode shapes,
where a step reads every weight once and cuBLAS leaves bandwidth unused.

    PYTHONPATH=. python3 -m benchmarks.gemv [--quick] [--rows 1,4,16] [--models 0.6b,8b,8b-tp2,30b-a3b]

The decode GEMMs (qkv, o, gate_up, down; bf16) of Qwen3-0.6B, Qwen3-8B and one rank of
Qwen3-8B at TP=2, x of ``--rows`` rows. Each call is timed in a CUDA graph as the decode
step replays it (``benchmarks.gpu_timing``), cycling over enough copies of the weight that
they do not fit in L2; GB/s counts the weight bytes. Every config is checked against
``F.linear`` in float32 first; a failing one is reported and skipped. The default config
for the shape (``gemv.default_config``) is marked ``*``, a shape the engine leaves to
cuBLAS (``gemv_takes``) ``(not taken)``. ``--quick``: the default configs only.
Summary: ``$OUT/gemv.json``. Exit status 1 if a default config fails its check.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

import torch
import torch.nn.functional as F

from benchmarks.gpu_timing import graph_us
from benchmarks.report import write_summary
from minivllm.kernels.gemv import (
    FEW_ROWS_CONFIG, ONE_ROW_BY_SHAPE, ONE_ROW_CONFIG, GemvConfig, default_config, gemv, gemv_takes,
)
from minivllm.testing import QWEN3_0_6B, QWEN3_8B, QWEN3_30B_A3B

DEVICE = "cuda"             # a module constant so that a CPU dry run (TRITON_INTERPRET=1) can swap it
L2_FLUSH_BYTES = 256 << 20  # copies of a weight cycled per timing: more than the H200's 50 MB L2
TOL = 1.6e-2                # bf16, as the kernel GPU tests

CANDIDATES = [
    GemvConfig(16, 256, 4, 4), GemvConfig(16, 512, 4, 3), GemvConfig(16, 512, 8, 3), GemvConfig(16, 128, 4, 6),
    GemvConfig(32, 256, 4, 4), GemvConfig(32, 256, 8, 3), GemvConfig(32, 128, 4, 5),
    GemvConfig(64, 128, 4, 4), GemvConfig(64, 256, 8, 3),
    # Batch 1 on CUDA cores (timed at one row only: above it they are the tensor-core tiles).
    GemvConfig(16, 256, 4, 4, one_row=True), GemvConfig(16, 512, 4, 3, one_row=True),
    GemvConfig(32, 256, 8, 4, one_row=True),
    GemvConfig(8, 1024, 4, 3, one_row=True),
    GemvConfig(8, 512, 2, 4, one_row=True), GemvConfig(4, 1024, 4, 3, one_row=True),
]


def decode_gemms(model: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of one layer's dense GEMMs: ``0.6b``, ``8b``, ``8b-tp2`` (one rank): qkv,
    o, gate_up, down; ``30b-a3b`` (Qwen3-30B-A3B): qkv, o and the router (its experts are
    ``benchmarks.moe``'s)."""
    cfg, tp = {"0.6b": (QWEN3_0_6B, 1), "8b": (QWEN3_8B, 1), "8b-tp2": (QWEN3_8B, 2),
               "30b-a3b": (QWEN3_30B_A3B, 1)}[model]
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d // tp, max(1, cfg["num_key_value_heads"] // tp) * d
    attention = [(f"{model} qkv", q + 2 * kv, h), (f"{model} o", h, q)]
    if "num_experts" in cfg:
        return attention + [(f"{model} router", cfg["num_experts"], h)]
    i = cfg["intermediate_size"]
    return attention + [(f"{model} gate_up", 2 * i // tp, h), (f"{model} down", h, i // tp)]


def time_us(fn, weights: list[torch.Tensor], x: torch.Tensor) -> float:
    return graph_us(lambda c: fn(x, weights[c]), len(weights))


def bench_shape(name: str, n: int, k: int, rows: int, configs: list[GemvConfig]) -> dict:
    w0 = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k ** 0.5
    copies = max(2, -(-L2_FLUSH_BYTES // w0.nbytes))
    weights = [w0] + [torch.randn_like(w0) / k ** 0.5 for _ in range(copies - 1)]
    x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
    ref = F.linear(x.float(), w0.float())
    row = {"shape": name, "N": n, "K": k, "rows": rows, "weight_MB": w0.nbytes / 2 ** 20,
           "taken_by_default": gemv_takes(x, w0), "configs": []}
    cublas = time_us(F.linear, weights, x)
    row["cublas_us"], row["cublas_GBs"] = cublas, w0.nbytes / cublas / 1e3
    for config in configs:
        if config.one_row and rows > 1:
            continue
        entry = {"config": asdict(config), "default": config == default_config(rows, n, k)}
        try:
            err = (gemv(x, w0, config=config).float() - ref).abs().max().item()
            if not err <= TOL * max(1.0, ref.abs().max().item()):
                raise AssertionError(f"max error {err:.3g}")
            us = time_us(lambda a, w, c=config: gemv(a, w, config=c), weights, x)
            entry.update(us=us, GBs=w0.nbytes / us / 1e3, speedup=cublas / us)
        except Exception as exc:  # noqa: BLE001 - a sweep reports a failing config and goes on
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
        row["configs"].append(entry)
    del weights
    torch.cuda.empty_cache()
    return row


def label(c: dict) -> str:
    one_row = " one-row" if c["one_row"] else ""
    return f"n{c['block_n']} k{c['block_k']} w{c['num_warps']} s{c['num_stages']}{one_row}"


def print_row(row: dict) -> None:
    taken = "" if row["taken_by_default"] else " (not taken)"
    print(f"{row['shape']:>16} M={row['rows']:<2} {row['weight_MB']:7.1f} MB  cuBLAS {row['cublas_us']:7.2f} us "
          f"{row['cublas_GBs']:6.0f} GB/s{taken}")
    for e in row["configs"]:
        mark = "*" if e["default"] else " "
        if "error" in e:
            print(f"      {mark} {label(e['config']):<20} FAILED {e['error']}")
        else:
            print(f"      {mark} {label(e['config']):<20} {e['us']:7.2f} us {e['GBs']:6.0f} GB/s  x{e['speedup']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the default configs only")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--models", default="0.6b,8b,8b-tp2")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gemv needs a CUDA device")
    defaults = [ONE_ROW_CONFIG, *(c for _, _, c in ONE_ROW_BY_SHAPE), FEW_ROWS_CONFIG]
    configs = defaults + ([] if args.quick else [c for c in CANDIDATES if c not in defaults])
    results, default_failed = [], False
    for model in args.models.split(","):
        for name, n, k in decode_gemms(model):
            for rows in (int(r) for r in args.rows.split(",")):
                row = bench_shape(name, n, k, rows, configs)
                print_row(row)
                results.append(row)
                default_failed |= any("error" in e for e in row["configs"] if e["default"])
    ok = [(r, e) for r in results for e in r["configs"] if "us" in e]
    total = {key: sum(r["cublas_us"] if key == "cublas" else e["us"] for r, e in ok if e["default"])
             for key in ("cublas", "gemv")}
    print(f"sum over the shapes, default config: cuBLAS {total['cublas']:.1f} us, gemv {total['gemv']:.1f} us")
    write_summary("gemv", {"args": vars(args), "rows": results, "total_us": total})
    if default_failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
