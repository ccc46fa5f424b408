"""Question: what does one more kernel in a batch-1 decode step cost, by itself?

A Qwen3-30B-A3B decode step at batch 1 is a chain of about 9 dependent kernels a layer over
48 layers; each starts after the one before it (with PDL: may start early and wait). This
times a chain of ``--kernels`` dependent kernels replayed from one CUDA graph, each reading
``--mb`` MB of its own (cold, beyond L2) and one value its predecessor wrote, with and
without programmatic dependent launch, so that the cost of the chain's links can be told
from the bytes::

    PYTHONPATH=. python3 lab/launch_chain.py [--kernels 432] [--mb 0,1,8,20]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 lab/launch_chain.py --check   # CPU: the chain's values
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import takes_pdl

BLOCK = 4096           # elements a program reads a step
PROGRAMS = 264         # two a streaming multiprocessor on an H200


@triton.jit
def _link(prev_ptr, next_ptr, data_ptr, n, n_per_program, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """next = prev + 1 (program 0), after every program streamed its share of ``data`` (n)."""
    pid = tl.program_id(0)
    total = tl.zeros([BLOCK], tl.float32)
    first = pid.to(tl.int64) * n_per_program
    for k in tl.range(0, n_per_program, BLOCK):    # independent of the predecessor: may run early
        offs = k + tl.arange(0, BLOCK)
        ok = (offs < n_per_program) & (first + offs < n)
        total += tl.load(data_ptr + first + offs, mask=ok, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    value = tl.load(prev_ptr)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if pid == 0:
        tl.store(next_ptr, value + 1.0)
    if tl.sum(total) < 0.0:                         # never (the data are ones): keeps the loads
        tl.store(next_ptr, -1.0)


def chain(values: torch.Tensor, data: list[torch.Tensor], pdl: bool) -> None:
    """values[i + 1] = values[i] + 1 for each link, link i reading data[i % len(data)]."""
    use_pdl = takes_pdl(pdl, values)
    launch = {"launch_pdl": True} if use_pdl else {}
    for i in range(values.numel() - 1):
        d = data[i % len(data)]
        per = triton.cdiv(d.numel(), PROGRAMS)
        _link[(PROGRAMS,)](values[i:], values[i + 1:], d, d.numel(), per, PDL=use_pdl, BLOCK=BLOCK, **launch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", type=int, default=432, help="links of the chain (48 layers x 9 kernels)")
    ap.add_argument("--mb", default="0,1,8,20", help="MB each link reads, a comma list")
    ap.add_argument("--check", action="store_true", help="a short chain on the CPU, values checked only")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernels = 4 if args.check else args.kernels
    for mb in [float(m) for m in args.mb.split(",")]:
        n = max(PROGRAMS, int(mb * 2 ** 20 / 2))                      # bf16 elements a link reads
        copies = 1 if args.check else max(2, triton.cdiv(256 * 2 ** 20, 2 * n))   # cycle beyond L2
        data = [torch.ones(n, dtype=torch.bfloat16, device=device) for _ in range(copies)]
        for pdl in (False, True):
            values = torch.zeros(kernels + 1, dtype=torch.float32, device=device)
            if device != "cuda":
                chain(values, data, pdl)
                assert values.tolist() == [float(i) for i in range(kernels + 1)], values
                continue
            chain(values, data, pdl)                                  # compile, outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain(values, data, pdl)
            graph.replay()
            torch.cuda.synchronize()
            assert values[-1].item() == kernels
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(10):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / kernels)
            print(f"{mb:5.1f} MB a link, PDL {'on ' if pdl else 'off'}: {sorted(times)[5]:6.2f} us a link "
                  f"({kernels} links, median of 10 replays)", flush=True)
    if device != "cuda":
        print("chain values as expected")


if __name__ == "__main__":
    main()
