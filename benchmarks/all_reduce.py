"""The tensor-parallel all-reduce by message size: NCCL against torch's one-shot and
two-shot symmetric-memory kernels (``minivllm/layers/all_reduce.py``), each inside a
CUDA graph as a decode step runs it, results checked against NCCL's first; then the
all-reduce fused with the residual add + RMSNorm after it
(``kernels/all_reduce_rms_norm.py``) against the all-reduce followed by ``rms_norm``.

    python3 -m benchmarks.all_reduce [--world-size 2] [--dtype bfloat16]

Needs ``--world-size`` GPUs. Rows are a decode step's message (tokens x hidden): 1 x
4096 is Qwen3-8B at batch 1 (8 KB), 256 x 4096 at batch 256 (2 MB). Times are per
all-reduce, from 50 back-to-back all-reduces per graph replay, median of 20 replays,
on rank 0. ``$OUT/all_reduce.json`` keeps the table.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.gpu_timing import graph_us
from benchmarks.throughput import write_summary
from minivllm.executor.distributed import free_port
from minivllm.layers import all_reduce as ar
from minivllm.layers.norm import add_rms_norm

ROWS = (1, 8, 32, 64, 128, 256, 512, 1024)
REPS, REPLAYS = 50, 20


def nccl(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def worker(rank: int, world: int, port: int, hidden: int, dtype_name: str, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    dtype = getattr(torch, dtype_name)
    dev = torch.device("cuda", rank)
    why = ar.install_symm_mem_all_reduce(dev, dtype, max_bytes=max(ROWS) * hidden * dtype.itemsize,
                                         fuse_norm=True)
    norm_w = torch.rand(hidden, device=dev, dtype=dtype) + 0.5
    rows = []
    for m in ROWS:
        g = torch.Generator(device=dev).manual_seed(1000 * rank + m)
        x = torch.randn(m, hidden, device=dev, dtype=dtype, generator=g)
        row: dict[str, Any] = dict(rows=m, kb=m * hidden * dtype.itemsize / 1024)
        want = x.clone()
        dist.all_reduce(want)
        fast = ar.installed()
        if fast is not None:
            got = fast.one_shot(x)
            torch.cuda.synchronize()
            row["max_abs_diff"] = float((got.float() - want.float()).abs().max())
            row["one_shot_us"] = graph_us(lambda i: fast.one_shot(x), REPS, REPLAYS, dist.barrier)
            try:  # torch's two-shot kernel (reduce-scatter + all-gather over the symmetric buffer)
                got = fast.two_shot(x)
                torch.cuda.synchronize()
                row["two_shot_max_abs_diff"] = float((got.float() - want.float()).abs().max())
                row["two_shot_us"] = graph_us(lambda i: fast.two_shot(x), REPS, REPLAYS, dist.barrier)
            except (RuntimeError, AttributeError, TypeError) as e:  # TypeError: no two-shot op in this torch
                row["two_shot_error"] = f"{type(e).__name__}: {e}"[:200]
            if fast.fuses_norm:  # all-reduce + residual add + RMSNorm: one kernel vs two
                res = torch.randn(m, hidden, device=dev, dtype=dtype, generator=g)
                fused = fast.add_rms_norm(x, res, norm_w, 1e-6)
                unfused = add_rms_norm(fast(x), res, norm_w, 1e-6)
                torch.cuda.synchronize()
                row["fused_max_abs_diff"] = max(float((a.float() - b.float()).abs().max())
                                                for a, b in zip(fused, unfused))
                row["fused_norm_us"] = graph_us(lambda i: fast.add_rms_norm(x, res, norm_w, 1e-6),
                                                REPS, REPLAYS, dist.barrier)
                row["unfused_norm_us"] = graph_us(lambda i: add_rms_norm(fast(x), res, norm_w, 1e-6),
                                                  REPS, REPLAYS, dist.barrier)
        y = x.clone()
        row["nccl_us"] = graph_us(lambda i: nccl(y), REPS, REPLAYS, dist.barrier)
        rows.append(row)
    if rank == 0:
        q.put(dict(rows=rows, symm_mem=why or "installed"))
    ar.uninstall()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    if torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"needs {args.world_size} GPUs, found {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args.world_size, port, args.hidden, args.dtype, q))
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    res = q.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    print(f"symmetric memory: {res['symm_mem']}; {args.world_size} ranks, hidden {args.hidden}, {args.dtype}")
    print(f"{'rows':>6} {'KB':>8} {'NCCL us':>9} {'one-shot us':>12} {'two-shot us':>12} {'max |diff|':>11}")
    for r in res["rows"]:
        print(f"{r['rows']:>6} {r['kb']:>8.0f} {r['nccl_us']:>9.2f} {r.get('one_shot_us', float('nan')):>12.2f} "
              f"{r.get('two_shot_us', float('nan')):>12.2f} {r.get('max_abs_diff', float('nan')):>11.3g}"
              + (f"  two-shot: {r['two_shot_error']}" if "two_shot_error" in r else ""))
    if all("fused_norm_us" in r for r in res["rows"]):
        print(f"\nall-reduce + residual add + RMSNorm ({args.dtype}): one fused kernel vs all-reduce then rms_norm")
        print(f"{'rows':>6} {'fused us':>9} {'unfused us':>11} {'max |diff|':>11}")
        for r in res["rows"]:
            print(f"{r['rows']:>6} {r['fused_norm_us']:>9.2f} {r['unfused_norm_us']:>11.2f} "
                  f"{r['fused_max_abs_diff']:>11.3g}")
    write_summary("all_reduce", dict(args=vars(args), **res))


if __name__ == "__main__":
    main()
