"""The tensor-parallel all-reduce by message size, in CUDA graphs as a decode step runs it:
NCCL against torch's one-shot and two-shot symmetric-memory kernels and the path the engine
picks by size (``minivllm/ops/communicator.py``), then the all-reduce fused with the
residual add + RMSNorm after it against the all-reduce followed by the norm kernel.

    python3 -m benchmarks.all_reduce [--world-size 2] [--hidden 4096] [--dtype bfloat16]

Needs ``--world-size`` GPUs. Rows are a decode step's message (tokens x hidden): 1 x 4096
is Qwen3-8B at batch 1 (8 KB), 256 x 4096 at batch 256 (2 MB). Results are checked against
NCCL's first. Times are per all-reduce, from 50 back-to-back calls per graph replay, median
of 20 replays, on rank 0. Summary: ``$OUT/all_reduce.json``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.gpu_timing import graph_us
from benchmarks.report import write_summary
from minivllm.executor.distributed import free_port
from minivllm.kernels.rms_norm import rms_norm
from minivllm.ops.communicator import Communicator, build_communicator

ROWS = (1, 8, 32, 64, 128, 256, 512, 1024)
REPS, REPLAYS = 50, 20
EPS = 1e-6


def nccl(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def symm_kernels(comm: Communicator, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """torch's one-shot and two-shot kernels over the communicator's symmetric buffer (the two
    the engine picks between by size), and the engine's pick."""
    symm = comm.symm
    assert symm is not None
    slot = symm.buffer.narrow(0, 0, x.numel()).view(x.shape)
    out = torch.empty_like(x)
    ops = torch.ops.symm_mem
    kernels = {"one_shot": lambda: ops.one_shot_all_reduce_copy(slot, x, "sum", symm.group_name),
               "engine": lambda: comm.all_reduce(x)}
    if hasattr(ops, "two_shot_all_reduce_out"):
        def two_shot() -> torch.Tensor:
            slot.copy_(x)  # the two-shot kernel reduces in the symmetric buffer
            return ops.two_shot_all_reduce_out(slot, "sum", symm.group_name, out)
        kernels["two_shot"] = two_shot
    return kernels


def measure_row(comm: Communicator, m: int, hidden: int, dtype: torch.dtype, rank: int) -> dict[str, Any]:
    """One message size: every path checked against NCCL, then timed (us per call)."""
    dev = torch.device("cuda", rank)
    g = torch.Generator(device=dev).manual_seed(1000 * rank + m)
    x = torch.randn(m, hidden, device=dev, dtype=dtype, generator=g)
    row: dict[str, Any] = dict(rows=m, kb=m * hidden * dtype.itemsize / 1024)
    want = nccl(x.clone())
    if comm.symm is not None:
        for name, fn in symm_kernels(comm, x).items():
            try:
                row[f"{name}_max_abs_diff"] = float((fn().float() - want.float()).abs().max())
                row[f"{name}_us"] = graph_us(lambda i: fn(), REPS, REPLAYS, dist.barrier)
            except (RuntimeError, TypeError) as e:  # a kernel this torch build lacks or refuses
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
        res = torch.randn(m, hidden, device=dev, dtype=dtype, generator=g)
        weight = torch.rand(hidden, device=dev, dtype=dtype, generator=g) + 0.5

        def unfused() -> tuple[torch.Tensor, torch.Tensor]:
            return rms_norm(comm.all_reduce(x), weight, EPS, residual=res)  # type: ignore[return-value]

        def fused() -> tuple[torch.Tensor, torch.Tensor] | None:
            return comm.add_rms_norm(x, res, weight, EPS, pdl=False)

        got = fused()
        if got is not None:
            row["fused_max_abs_diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, unfused()))
            row["fused_norm_us"] = graph_us(lambda i: fused(), REPS, REPLAYS, dist.barrier)
            row["unfused_norm_us"] = graph_us(lambda i: unfused(), REPS, REPLAYS, dist.barrier)
    y = x.clone()
    row["nccl_us"] = graph_us(lambda i: nccl(y), REPS, REPLAYS, dist.barrier)
    return row


def worker(rank: int, world: int, port: int, hidden: int, dtype_name: str, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    dtype = getattr(torch, dtype_name)
    comm, why = build_communicator(torch.device("cuda", rank), dtype, custom_all_reduce=True)
    rows = [measure_row(comm, m, hidden, dtype, rank) for m in ROWS]
    if rank == 0:
        q.put(dict(rows=rows, symm_mem=why or "available"))
    comm.close()
    dist.barrier()
    dist.destroy_process_group()


def print_table(res: dict[str, Any], args: argparse.Namespace) -> None:
    nan = float("nan")
    print(f"symmetric memory: {res['symm_mem']}; {args.world_size} ranks, hidden {args.hidden}, {args.dtype}")
    print(f"{'rows':>6} {'KB':>8} {'NCCL us':>9} {'one-shot us':>12} {'two-shot us':>12} {'engine us':>10} "
          f"{'fused norm us':>14} {'unfused us':>11}")
    for r in res["rows"]:
        print(f"{r['rows']:>6} {r['kb']:>8.0f} {r['nccl_us']:>9.2f} {r.get('one_shot_us', nan):>12.2f} "
              f"{r.get('two_shot_us', nan):>12.2f} {r.get('engine_us', nan):>10.2f} "
              f"{r.get('fused_norm_us', nan):>14.2f} {r.get('unfused_norm_us', nan):>11.2f}"
              + "".join(f"  {k}: {v}" for k, v in r.items() if k.endswith("_error")))


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
    print_table(res, args)
    write_summary("all_reduce", dict(args=vars(args), **res))


if __name__ == "__main__":
    main()
