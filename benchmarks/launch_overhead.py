"""Host and GPU cost per call of the small per-layer ops, three ways: our Triton kernel,
the same function through ``torch.compile`` (dynamic shapes, as ``layers/fuse.py``
compiles), and eager torch.

    PYTHONPATH=. python3 -m benchmarks.launch_overhead [--rows 8192 256] [--smoke]

Host µs: a loop of 200 calls timed without synchronising (what the host spends to
issue one call; when it exceeds the GPU time, the host sets the pace). GPU µs: 20
calls captured in a CUDA graph and replayed (no launch cost). Outside a CUDA graph
(prefill and mixed steps) a layer's step time is at least its host time.

``--smoke``: the CPU, eager torch only (checks the script runs).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks.gpu_timing import graph_us
from benchmarks.throughput import write_summary


def host_us(fn: Callable[[], Any], n: int = 200) -> float:
    for _ in range(5):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return dt * 1e6


def cases(rows: int, device: str, smoke: bool) -> list[tuple[str, str, Callable[[], Any]]]:
    """(op, variant, call) at Qwen3-0.6B's widths: hidden 1024, intermediate 3072."""
    from minivllm.layers.activation import silu_and_mul_ref
    from minivllm.layers.fuse import compile_fused
    from minivllm.layers.norm import add_rms_norm_ref

    dt = torch.bfloat16
    x = torch.randn(rows, 1024, device=device, dtype=dt)
    r, w = torch.randn_like(x), torch.ones(1024, device=device, dtype=dt)
    g = torch.randn(rows, 6144, device=device, dtype=dt)
    weight = torch.randn(4096, 1024, device=device, dtype=dt)
    out = [("add + RMSNorm", "eager", lambda: add_rms_norm_ref(x, r, w, 1e-6)),
           ("SiLU-and-mul", "eager", lambda: silu_and_mul_ref(g)),
           ("linear 1024 -> 4096", "eager", lambda: F.linear(x, weight))]
    if smoke:
        return out
    from minivllm.kernels.rms_norm import rms_norm
    from minivllm.kernels.silu_and_mul import silu_and_mul

    from minivllm.kernels.prefill_attention import prefill_attention
    from minivllm.kernels.qk_norm_rope_store import qk_norm_rope_store

    norm_c, silu_c = compile_fused(add_rms_norm_ref), compile_fused(silu_and_mul_ref)
    # The attention side of a layer: q/k norm + RoPE + K/V store, and prefill attention over
    # 16 sequences of rows / 16 tokens (16 heads, 8 KV heads, head_dim 128, blocks of 16).
    seqs, per = 16, max(1, rows // 16)
    blocks = seqs * -(-per // 16)
    cache = torch.zeros(blocks + 1, 16, 8, 128, device=device, dtype=dt)
    qkv = torch.randn(seqs * per, 32 * 128, device=device, dtype=dt)
    pos = torch.arange(seqs * per, device=device) % per
    slots = torch.arange(seqs * per, device=device)
    cos_sin = torch.randn(max(per, 1), 128, device=device)
    q = torch.randn(seqs * per, 16, 128, device=device, dtype=dt)
    cu = torch.arange(seqs + 1, device=device, dtype=torch.int32) * per
    kv_lens = torch.full((seqs,), per, device=device, dtype=torch.int32)
    tables = torch.arange(blocks, device=device, dtype=torch.int32).view(seqs, -1)
    hw = torch.ones(128, device=device, dtype=dt)
    return out + [("add + RMSNorm", "compiled", lambda: norm_c(x, r, w, 1e-6)),
                  ("add + RMSNorm", "triton", lambda: rms_norm(x, w, 1e-6, residual=r)),
                  ("SiLU-and-mul", "compiled", lambda: silu_c(g)),
                  ("SiLU-and-mul", "triton", lambda: silu_and_mul(g)),
                  ("q/k norm+RoPE+store", "triton",
                   lambda: qk_norm_rope_store(qkv, pos, hw, hw, 1e-6, cos_sin, cache, cache, slots)),
                  ("prefill attention", "triton",
                   lambda: prefill_attention(q, cache, cache, cu, kv_lens, tables, 0.088, per))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8192, 256])
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke for a CPU check")
    device = "cpu" if args.smoke else "cuda"
    rows = []
    print(f"{'op':22s} {'variant':9s} {'rows':>6s} {'host us':>8s} {'GPU us':>8s}")
    for n in ([8] if args.smoke else args.rows):
        for op, variant, fn in cases(n, device, args.smoke):
            h = host_us(fn)
            gpu = None if args.smoke else graph_us(lambda i: fn(), 20, replays=1)
            rows.append(dict(op=op, variant=variant, rows=n, host_us=h, gpu_us=gpu))
            print(f"{op:22s} {variant:9s} {n:6d} {h:8.1f} {'-' if gpu is None else f'{gpu:8.1f}':>8s}", flush=True)
    write_summary("launch_overhead", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
