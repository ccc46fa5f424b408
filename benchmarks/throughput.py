"""Offline throughput ("offline-256" of DESIGN.md) and batch-1 decode latency.

256 requests, prompt lengths uniform in [100, 1024] of random token ids
< 10000, max_tokens uniform in [100, 1024], eos ignored, Qwen3-0.6B shapes
(random weights), bf16. Throughput = completion tokens / wall time of generate().

    PYTHONPATH=. python3 -m benchmarks.throughput [--num-requests 256] [--enforce-eager]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.qwen3_shapes import write_random_qwen3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--model-dir", default="/tmp/qwen3-0.6b-random")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from minivllm import LLM, SamplingParams

    path = write_random_qwen3(args.model_dir)
    t0 = time.perf_counter()
    llm = LLM(path, max_num_seqs=args.max_num_seqs, max_model_len=2048,
              max_num_batched_tokens=8192, enforce_eager=args.enforce_eager)
    print(f"engine start-up {time.perf_counter() - t0:.1f}s, KV pool {llm.engine.num_blocks} blocks")

    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    prompts = [rng.integers(0, 10000, int(k)).tolist() for k in rng.integers(100, 1025, n)]
    # Random sampling (temperature 1, unseeded), as vLLM's offline throughput benchmark does.
    params = [SamplingParams(temperature=1.0, max_tokens=int(m), ignore_eos=True)
              for m in rng.integers(100, 1025, n)]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up

    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    ntok = sum(len(o.token_ids) for o in outs)
    s = llm.engine.stats
    print(f"offline-{n}: {ntok} completion tokens in {wall:.2f}s = {ntok / wall:,.0f} tok/s "
          f"(steps {s.num_steps}, preemptions {s.num_preemptions})")

    t0 = time.perf_counter()
    out = llm.generate([prompts[0][:128]], SamplingParams(temperature=0, max_tokens=257,
                                                          ignore_eos=True), use_tqdm=False)[0]
    dt = time.perf_counter() - t0
    print(f"batch-1: {len(out.token_ids)} tokens in {dt * 1e3:.0f} ms = "
          f"{dt * 1e3 / len(out.token_ids):.2f} ms/token (prefill of 128 included)")


if __name__ == "__main__":
    main()
