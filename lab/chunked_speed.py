"""Question: how fast is the chunked delta rule on prefill at Qwen3.5-9B's DeltaNet shapes (16
q/k heads and 32 value heads of 128, bf16 inputs, float32 state), and which of its dot
precisions (float32 on CUDA cores, "ieee"; three TF32 tensor-core products, "tf32x3"; one,
"tf32"), pieces, value tiles and warps make it fastest while it still agrees with the
token-by-token kernel?

Each configuration runs in a process of its own under a time limit (a piece size that does
not compile must not stall the rest). Prints, per configuration and prompt set, the
time of one call and its tokens a second, and the largest difference from the recurrent
kernel in output and state::

    PYTHONPATH=. python3 lab/chunked_speed.py [--limit 90]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

CONFIGS = (  # (precision, chunk, block_v, warps)
    ("ieee", 16, 32, 8),
    ("tf32x3", 16, 32, 4), ("tf32x3", 16, 64, 4), ("tf32x3", 16, 128, 8), ("tf32x3", 32, 32, 4),
    ("tf32x3", 32, 64, 8), ("tf32x3", 64, 64, 8), ("tf32", 16, 32, 4), ("tf32", 32, 64, 4),
)
PROMPTS = ([128], [2048], [128] * 16)


def child(precision: str, chunk: int, block_v: int, warps: int) -> None:
    import torch
    import triton

    import minivllm.kernels.gated_delta_rule_chunked as mod
    from benchmarks.delta_rule import _problem
    from minivllm.kernels.gated_delta_rule_recurrent import gated_delta_rule_recurrent

    tiles = dict(chunk=chunk, block_v=block_v, num_warps=warps, precision=precision)
    for lens in PROMPTS:
        p = _problem(lens, 16, 32, 128, "cuda")
        args = (p["q"], p["k"], p["v"], p["g"], p["beta"])
        rest = (p["cu"], p["slots"], p["init"])
        s_ref, s_got = p["state"].clone(), p["state"].clone()
        ref = gated_delta_rule_recurrent(*args, s_ref, *rest)
        t0 = time.time()
        got = mod.gated_delta_rule_chunked(*args, s_got, *rest, **tiles)
        torch.cuda.synchronize()
        first = time.time() - t0
        out_diff = (ref.float() - got.float()).abs().max().item()
        state_diff = (s_ref - s_got).abs().max().item()
        state = p["state"].clone()
        ms = triton.testing.do_bench(lambda: mod.gated_delta_rule_chunked(*args, state, *rest, **tiles),
                                     warmup=20, rep=200)
        ms_rec = triton.testing.do_bench(lambda: gated_delta_rule_recurrent(*args, state, *rest), warmup=20, rep=200)
        t = sum(lens)
        print(f"{precision:6s} chunk {chunk:2d} bv {block_v:3d} w {warps}  {len(lens):2d}x{lens[0]:<5d}: "
              f"{ms * 1e3:9.1f} us ({t / ms / 1e3:8.2f} Mtok/s), recurrent {ms_rec * 1e3:9.1f} us; "
              f"first call {first:5.1f} s; |diff| out {out_diff:.1e} state {state_diff:.1e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=90, help="seconds per configuration")
    ap.add_argument("--child", nargs=4)
    args = ap.parse_args()
    if args.child:
        precision, *ints = args.child
        child(precision, *(int(x) for x in ints))
        return
    for precision, chunk, block_v, warps in CONFIGS:
        cmd = [sys.executable, __file__, "--child", precision, str(chunk), str(block_v), str(warps)]
        try:
            subprocess.run(cmd, timeout=args.limit, check=False)
        except subprocess.TimeoutExpired:
            print(f"{precision} chunk {chunk} bv {block_v} w {warps}: no result within {args.limit} s", flush=True)


if __name__ == "__main__":
    main()
