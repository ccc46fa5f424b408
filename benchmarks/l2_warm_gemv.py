"""Would the all-reduce's wait pay for warming L2 with the next GEMV's weights? On one GPU.

At batch 1 under tensor parallelism the fused all-reduce + RMSNorm kernel before the qkv
and gate_up GEMVs spends ~5 us waiting on its peers over NVLink while HBM is idle. Here a
stand-in kernel waits that long (a spin on the global timer) after asking L2 for the
first X MB of the next GEMV's W (``cp.async.bulk.prefetch.L2``, chunks of 128 KB); the
GEMV after it then finds those bytes in L2. Timed as CUDA graph replays of (wait, GEMV)
pairs cycling through 8 weight copies (so W streams from HBM as in the model):

    python3 -m benchmarks.l2_warm_gemv [--wait-us 5] [--mb 0 8 16 24 32]

Prints per shape the pair's time for each X (X = 0: the wait alone, no prefetch), and the
GEMV alone. The gain per call is the drop from X = 0. With ``$OUT`` set the results go to
``$OUT/l2_warm_gemv.json`` too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import triton
import triton.language as tl

from minivllm.kernels.gemv import gemv

SHAPES = {  # (N, K) of W: Qwen3-8B at TP=2, and at TP=1 for comparison
    "8b-tp2 qkv": (3072, 4096), "8b-tp2 gate_up": (12288, 4096),
    "8b qkv": (6144, 4096), "8b gate_up": (24576, 4096),
}
COPIES = 8
CHUNK = 128 * 1024


@triton.jit
def _wait_and_prefetch(w_ptr, nbytes, wait_ns, CHUNKS: tl.constexpr, CHUNK: tl.constexpr):
    """Ask L2 for the first ``nbytes`` of ``w_ptr`` (bytes), then spin ``wait_ns``."""
    if nbytes > 0:
        offs = tl.minimum(tl.arange(0, CHUNKS).to(tl.int64) * CHUNK, nbytes - CHUNK)
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 131072; mov.u32 $0, 0;", "=r,l",
                                  [w_ptr + offs], dtype=tl.int32, is_pure=False, pack=1)
    t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    now = t0
    while now - t0 < wait_ns:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                        pack=1)


def graph_us(fn, replays: int = 40) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wait-us", type=float, default=5.0)
    ap.add_argument("--mb", type=int, nargs="+", default=[0, 8, 16, 24, 32])
    args = ap.parse_args()
    dev = torch.device("cuda")
    results = []
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev).to(torch.bfloat16) for _ in range(COPIES)]
        x = torch.randn(1, k, device=dev).to(torch.bfloat16)
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        row = {"shape": name, "weight_MB": n * k * 2 / 1e6,
               "gemv_alone_us": graph_us(lambda: [gemv(x, w, out=out) for w in ws]) / COPIES}
        for mb in args.mb:
            nbytes = min(mb * 1_000_000 // CHUNK * CHUNK, n * k * 2 // CHUNK * CHUNK)
            chunks = max(1, triton.next_power_of_2(max(1, nbytes // CHUNK)))

            def pairs():
                for w in ws:
                    _wait_and_prefetch[(1,)](w.view(torch.uint8), nbytes, int(args.wait_us * 1000),
                                             CHUNKS=chunks, CHUNK=CHUNK, num_warps=4)
                    gemv(x, w, out=out)
            row[f"pair_us_{mb}MB"] = graph_us(pairs) / COPIES
        results.append(row)
        print("  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "l2_warm_gemv.json"), "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
