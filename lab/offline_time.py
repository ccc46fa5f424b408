"""Question: where does offline-256's wall time go, over the whole run: how much of it do the
GPU's kernels fill, and which kernels, with the FP8 KV cache and with bf16?

Builds the Qwen3-0.6B-shaped engine (dummy weights, as ``benchmarks.fp8``) for each cache
dtype, runs offline-256 once untimed-for-the-answer to warm, once timed, then once under the
torch profiler (CUDA kernels only), and prints the wall time, the kernels' sum (one stream:
they do not overlap, so the rest is time the GPU waited on the host), and the kernels by
name and by group::

    PYTHONPATH=. python3 lab/offline_time.py [--kv auto,fp8]
"""

from __future__ import annotations

import argparse
import collections
import time

from benchmarks.throughput import profiled_kernel_us, offline_workload
from minivllm import LLM, SamplingParams
from minivllm.testing import release_memory, write_random_config

GROUPS = (("decode attention", ("_decode_split_kernel", "_merge_splits_kernel")),
          ("prefill attention", ("_prefill_kernel",)),
          ("GEMM", ("nvjet", "gemm", "cutlass", "_gemv_kernel")),
          ("norms, RoPE, store, activation", ("_rms_norm", "_qk_norm_rope_store", "_silu_and_mul")),
          ("sampler", ("_gumbel", "ArgMax", "reduce_kernel", "softmax")))


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv", default="fp8,auto", help="comma list of kv_cache_dtype values")
    args = ap.parse_args()
    path = write_random_config("/tmp/qwen3-0.6b-config", "qwen3-0.6b")
    wl = offline_workload(256, 0, False)
    params = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True) for m in wl.max_tokens]
    for kv in args.kv.split(","):
        llm = LLM(path, device="cuda", seed=0, skip_tokenizer_init=True, max_num_seqs=256, max_model_len=2048,
                  load_format="dummy", kv_cache_dtype=kv)
        llm.generate(wl.prompts(stream=1000, n=64), [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)]
                     * 64, use_tqdm=False)
        prompts = wl.prompts(stream=1)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        kernels = profiled_kernel_us(lambda: llm.generate(wl.prompts(stream=2), params, use_tqdm=False))
        wall_profiled = time.perf_counter() - t0
        busy = sum(kernels.values()) / 1e6
        print(f"[kv {kv}] offline-256 wall {wall:.2f} s ({sum(wl.max_tokens) / wall:,.0f} tok/s); under the "
              f"profiler {wall_profiled:.2f} s, kernels {busy:.2f} s = {100 * busy / wall_profiled:.0f}% of it",
              flush=True)
        groups: collections.Counter = collections.Counter()
        for name, us in kernels.items():
            groups[group_of(name)] += us
        for group, us in groups.most_common():
            print(f"  {us / 1e6:6.3f} s  {group}")
        for name, us in kernels.most_common(12):
            print(f"    {us / 1e6:6.3f} s  {name[:100]}")
        llm.close()
        llm = None  # noqa: F841 (the engine freed before the next one)
        release_memory()


if __name__ == "__main__":
    main()
