"""Would the all-reduce's wait pay for warming L2 with the next GEMV's weights? On one GPU.

At batch 1 under tensor parallelism the fused all-reduce + RMSNorm kernel before the qkv
and gate_up GEMVs spends ~5 us waiting on its peers over NVLink while HBM is idle. Here a
stand-in kernel waits that long (its program 0 spins on the global timer) while P programs
ask L2 for the first X MB of the next GEMV's W, either as ``cp.async.bulk.prefetch.L2`` of
16 KB a lane (bulk) or as one ``prefetch.global.L2`` per 128-byte line (lines); the GEMV
after it then finds those bytes in L2. (A first version prefetched from one program, in
128 KB bulk requests: 8 MB took ~60 us, one SM's copy engine being the bottleneck.) Timed
as CUDA graph replays of (wait, GEMV) pairs cycling through 8 weight copies (so W streams
from HBM as in the model; ``benchmarks.gpu_timing.graph_us``, per pair):

    python3 -m benchmarks.l2_warm_gemv [--wait-us 5] [--mb 0 8 16 24] [--programs 32 128]

Prints per shape the pair's time for each mode, P and X (X = 0: the wait alone), and the
GEMV alone. Mode "pdl": the wait kernel lets the GEMV start at once (programmatic dependent
launch: the GEMV loads its first W tile, then waits for the kernel before it) on top of the
line prefetch; "pdl_alone": the early start without any L2 prefetch, "plain_alone" its
baseline (the same wait, no prefetch, no early start). The gain per call is the drop from
the wait alone. With ``$OUT`` set the results go to ``$OUT/l2_warm_gemv.json`` too.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

os.environ.setdefault("MINIVLLM_PDL", "1")  # read once, at the first launch: the "pdl" rows need it

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.gpu_timing import graph_us  # noqa: E402
from benchmarks.throughput import write_summary  # noqa: E402
from minivllm.kernels.gemv import default_config, gemv  # noqa: E402

SHAPES = {  # (N, K) of W: Qwen3-8B at TP=2
    "8b-tp2 qkv": (3072, 4096), "8b-tp2 gate_up": (12288, 4096),
}
COPIES = 8
CHUNK = 16 * 1024  # bytes per bulk prefetch


@triton.jit
def _wait_and_prefetch(w_ptr, nbytes, wait_ns, LINES: tl.constexpr, CHUNK: tl.constexpr, BULK: tl.constexpr,
                       SIGNAL: tl.constexpr):
    """Program p asks L2 for its share of the first ``nbytes`` of ``w_ptr`` (bytes): BULK, as
    ``cp.async.bulk.prefetch.L2`` of CHUNK bytes per lane; else a ``prefetch.global.L2`` per
    128-byte line, LINES lines per pass. Then program 0 alone spins ``wait_ns``. SIGNAL: let
    the next kernel start at once (programmatic dependent launch, as the fused all-reduce
    does under ``MINIVLLM_PDL=1``)."""
    if SIGNAL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    share = tl.cdiv(nbytes, tl.num_programs(0) * CHUNK) * CHUNK
    lo = pid.to(tl.int64) * share
    hi = tl.minimum(lo + share, nbytes)
    if BULK:
        for at in range(lo, hi, LINES * CHUNK):
            offs = tl.minimum(at + tl.arange(0, LINES).to(tl.int64) * CHUNK, hi - CHUNK)
            tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 16384; mov.u32 $0, 0;", "=r,l",
                                      [w_ptr + offs], dtype=tl.int32, is_pure=False, pack=1)
    else:
        for at in range(lo, hi, LINES * 128):
            offs = tl.minimum(at + tl.arange(0, LINES).to(tl.int64) * 128, hi - 128)
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                      [w_ptr + offs], dtype=tl.int32, is_pure=False, pack=1)
    if pid == 0:
        t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        now = t0
        while now - t0 < wait_ns:
            now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                            is_pure=False, pack=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wait-us", type=float, default=5.0)
    ap.add_argument("--mb", type=int, nargs="+", default=[0, 8, 16, 24])
    ap.add_argument("--programs", type=int, nargs="+", default=[32, 128])
    args = ap.parse_args()
    dev = torch.device("cuda")
    results = []
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev).to(torch.bfloat16) for _ in range(COPIES)]
        x = torch.randn(1, k, device=dev).to(torch.bfloat16)
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        plain = dataclasses.replace(default_config(1, n, k), prefetch=False)
        row = {"shape": name, "weight_MB": n * k * 2 / 1e6,
               "gemv_alone_us": graph_us(lambda i: gemv(x, ws[i], out=out, config=plain), COPIES)}
        early = dataclasses.replace(plain, prefetch=True)  # launched with PDL (module doc of gemv.py)
        for mode in ("bulk", "lines", "pdl"):
            for programs in args.programs:
                for mb in args.mb:
                    if mb == 0 and (mode, programs) != ("bulk", args.programs[0]):
                        continue  # the wait alone, once
                    if mode == "pdl" and (mb, programs) != (args.mb[1], args.programs[-1]):
                        continue  # the early start (with one prefetch size)
                    nbytes = min(mb * 1_000_000, n * k * 2) // CHUNK * CHUNK

                    def pair(i):
                        _wait_and_prefetch[(programs,)](ws[i].view(torch.uint8), nbytes, int(args.wait_us * 1000),
                                                        LINES=128, CHUNK=CHUNK, BULK=mode == "bulk",
                                                        SIGNAL=mode == "pdl", num_warps=4)
                        gemv(x, ws[i], out=out, config=early if mode == "pdl" else plain)
                    key = "wait_alone_us" if mb == 0 else f"{mode}_{programs}p_{mb}MB_us"
                    row[key] = graph_us(pair, COPIES)
        for mode, config in (("pdl_alone", early), ("plain_alone", plain)):
            def pair(i):
                _wait_and_prefetch[(1,)](ws[i].view(torch.uint8), 0, int(args.wait_us * 1000), LINES=128, CHUNK=CHUNK,
                                         BULK=False, SIGNAL=mode == "pdl_alone", num_warps=4)
                gemv(x, ws[i], out=out, config=config)
            row[f"{mode}_us"] = graph_us(pair, COPIES)
        results.append(row)
        print("  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    write_summary("l2_warm_gemv", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
