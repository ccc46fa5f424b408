"""Question: where does a Qwen3.5-9B-shaped batch-1 decode step spend its time: in which
kernels, and how much of its wall time do the kernels fill at all?

Builds the 9B-shaped hybrid engine (dummy weights, as ``benchmarks.hybrid``), runs
``--rounds`` batch-1 rounds (128-token prompt, 256 greedy tokens, prefill included), times
each ``engine.step`` of one round (its distribution), then one round under the torch profiler
(CUDA kernels only) and prints the kernels' sum against the wall time, the kernels by group
and the largest by name::

    PYTHONPATH=. python3 lab/hybrid_batch1.py [--shapes qwen3.5-9b] [--rounds 2]
"""

from __future__ import annotations

import argparse
import collections
import time

from benchmarks.throughput import profiled_kernel_us, run_batch1
from lab.batch1_host import time_steps
from minivllm import LLM
from minivllm.testing import write_random_config

GROUPS = (("delta rule", ("delta_rule", "_recurrent", "_chunk")),
          ("conv", ("conv",)),
          ("gating", ("gdn_gating", "_gating")),
          ("attention", ("_decode_split_kernel", "_merge_splits_kernel", "_prefill_kernel")),
          ("GEMV", ("_gemv",)),
          ("GEMM", ("nvjet", "gemm", "cutlass", "sm90")),
          ("experts", ("moe",)),
          ("norms, RoPE, store", ("norm", "rope", "_store")),
          ("activation", ("silu", "sigmoid", "mul")),
          ("sampler", ("_gumbel", "ArgMax", "argmax", "reduce_kernel", "softmax")),
          ("copies", ("copy", "Memcpy", "Memset", "fill")))


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k.lower() in name.lower() for k in keys):
            return group
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3.5-9b")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    path = write_random_config(f"/tmp/{args.shapes}-config", args.shapes)
    llm = LLM(path, device="cuda", seed=0, skip_tokenizer_init=True, max_num_seqs=16, max_model_len=2048,
              load_format="dummy")
    for r in range(args.rounds):
        run_batch1(llm, 100 + r, f"round {r}", False, 10000)

    time_steps(llm)

    t0 = time.perf_counter()
    result: dict = {}
    kernels = profiled_kernel_us(lambda: result.update(run_batch1(llm, 300, "profiled", False, 10000)))
    wall = time.perf_counter() - t0
    steps = result["tokens"]
    busy = sum(kernels.values())
    print(f"profiled round: wall {wall * 1e3:.0f} ms, kernels {busy / 1e3:.0f} ms = {100 * busy / 1e3 / wall / 1e3:.0f}%"
          f" of it; per token {busy / steps / 1e3:.3f} ms of kernels", flush=True)
    groups: collections.Counter = collections.Counter()
    for name, us in kernels.items():
        groups[group_of(name)] += us
    for group, us in groups.most_common():
        print(f"  {us / steps:8.1f} us/token  {group}")
    for name, us in kernels.most_common(30):
        print(f"    {us / steps:8.1f} us/token  {name[:110]}")
    llm.close()


if __name__ == "__main__":
    main()
