"""The fused all-reduce + RMSNorm kernel's own work on one GPU: every rank's call in turn,
no barrier, the "peers'" buffers in this GPU's memory. What its loads and its norm cost
without NVLink's latency (``benchmarks.all_reduce`` times the real thing on two GPUs).

    python3 -m benchmarks.fused_all_reduce_local [--world-size 2] [--hidden 4096]

For rows 1, 16, 64 and 256 (bf16): each rank's kernel (``sync=False``, its x already in its
buffer half, as a row-parallel GEMM leaves it), both ranks per call, 50 calls per CUDA
graph, median of replays; prints us per rank-call. With ``$OUT`` set the results go to
``$OUT/fused_all_reduce_local.json`` too.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.gpu_timing import graph_us
from benchmarks.throughput import write_summary
from minivllm.kernels.all_reduce_rms_norm import all_reduce_add_rms_norm
from minivllm.layers.all_reduce import ranks_in_one_process

ROWS = (1, 16, 64, 256)
CALLS = 50


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    args = ap.parse_args()
    world, n = args.world_size, args.hidden
    paths = ranks_in_one_process(world, torch.bfloat16, "cuda", max_numel=max(ROWS) * n)
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for rows in ROWS:
        slots = [p.fused_buffer[: rows * n].view(rows, n) for p in paths]
        for slot in slots:
            slot.copy_(torch.randn(rows, n, generator=gen, device="cuda"))
        residual = torch.randn(rows, n, generator=gen, device="cuda").to(torch.bfloat16)
        norm_w = torch.ones(n, device="cuda", dtype=torch.bfloat16)

        def call(i: int) -> None:
            rank = i % world
            all_reduce_add_rms_norm(slots[rank], residual, norm_w, 1e-6, paths[0].buf_ptrs, paths[0].pad_ptrs,
                                    rank, world, sync=False, in_place=True)
        row = {"rows": rows, "us_per_rank_call": graph_us(call, CALLS)}
        results.append(row)
        print(f"rows {rows:4d}  {row['us_per_rank_call']:.2f} us per rank-call", flush=True)
    write_summary("fused_all_reduce_local", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
