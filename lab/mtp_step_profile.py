"""Question: where does a Qwen3.5-9B-shaped decode step with the MTP head drafting k tokens
spend its time, against a step of the same engine with no drafts?

Builds the 9B-shaped hybrid with a one-layer MTP head (dummy weights, as ``benchmarks.hybrid``'s
mtp part; random weights, so every draft is rejected and a drafted step yields one token), runs
a batch of ``--batch`` 128-token prompts for 64 greedy tokens once, then once timed, then once
under the torch profiler (CUDA kernels only), with the proposer off and then drafting ``--k``
tokens a step: wall time a step, kernel time a step, the kernels by name. Twice: with the
prefill buckets a dense model has (drafted steps padded to 64 tokens), then with the hybrid
model's own (``default_prefill_buckets``: 2 to 16 tokens too)::

    PYTHONPATH=. python3 lab/mtp_step_profile.py [--k 1] [--batch 1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.throughput import profiled_kernel_us
from minivllm import LLM, SamplingParams
from minivllm.executor import model_executor
from minivllm.executor.prefill_graph import default_prefill_buckets
from minivllm.testing import write_random_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top", type=int, default=12, help="kernels to print (0: no profiled run)")
    args = ap.parse_args()
    path = write_random_config("/tmp/qwen3.5-9b-mtp-config", "qwen3.5-9b", mtp_num_hidden_layers=1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 10000, 128).tolist() for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for buckets in ("dense buckets", "hybrid buckets"):
        model_executor.default_prefill_buckets = (
            (lambda n, hybrid=False: default_prefill_buckets(n)) if buckets == "dense buckets"
            else default_prefill_buckets)
        llm = LLM(path, device="cuda", seed=0, skip_tokenizer_init=True, max_num_seqs=16, max_model_len=2048,
                  load_format="dummy", speculative_config={"method": "mtp", "num_speculative_tokens": args.k})
        llm.engine.max_spec_backoff = 0
        proposer = llm.engine.proposer
        for name, drafting in (("no drafts", None), (f"k={args.k}", proposer)):
            llm.engine.proposer = drafting
            llm.generate(prompts, params, use_tqdm=False)
            steps0 = llm.engine.stats.num_steps
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = (time.perf_counter() - t0) / (llm.engine.stats.num_steps - steps0)
            if not args.top:
                print(f"[{buckets}, {name}] {wall * 1e3:.2f} ms a step", flush=True)
                continue
            steps0, drafts0 = llm.engine.stats.num_steps, llm.engine.stats.num_draft_tokens
            kernels = profiled_kernel_us(lambda: llm.generate(prompts, params, use_tqdm=False))
            steps = llm.engine.stats.num_steps - steps0
            print(f"[{buckets}, {name}] {wall * 1e3:.2f} ms a step; profiled: {steps} steps, "
                  f"{llm.engine.stats.num_draft_tokens - drafts0} drafts, kernels "
                  f"{sum(kernels.values()) / 1e3 / steps:.3f} ms a step", flush=True)
            for kernel, us in kernels.most_common(args.top):
                print(f"    {us / steps:8.1f} us/step  {kernel[:110]}")
        llm.close()
        del llm


if __name__ == "__main__":
    main()
