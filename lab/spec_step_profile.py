"""Where a batch-1 step with drafts spends its time (GPU): torch profiler over a few steps of
greedy decoding with k replayed drafts, against the same without drafts.

    PYTHONPATH=. python3 lab/spec_step_profile.py [--k 4] [--accept 1.0] [--dtype auto]
"""

from __future__ import annotations

import argparse

import numpy as np
from torch.profiler import ProfilerActivity, profile

from benchmarks.speculative import ReplayProposer
from minivllm import LLM, SamplingParams
from minivllm.testing import write_random_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--accept", type=float, default=1.0)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    path = write_random_config("/tmp/qwen3-0.6b-config", "qwen3-0.6b")
    llm = LLM(path, device="cuda", dtype=args.dtype, load_format="dummy", skip_tokenizer_init=True,
              max_model_len=1024, speculative_config={"method": "ngram", "num_speculative_tokens": args.k})
    prompt = np.random.default_rng(0).integers(0, 10000, 128).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.engine.proposer = None
    truth = {tuple(prompt): llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids}
    for name, proposer in (("no drafts", None),
                           (f"k {args.k} accept {args.accept}", ReplayProposer(truth, 128, args.k, args.accept,
                                                                                llm.model_config.vocab_size))):
        llm.engine.proposer = proposer
        llm.generate([prompt], greedy, use_tqdm=False)
        steps = llm.engine.stats.num_steps
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate([prompt], greedy, use_tqdm=False)
        steps = llm.engine.stats.num_steps - steps
        print(f"=== {name}: {steps} steps for 64 tokens")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10))
    llm.close()


if __name__ == "__main__":
    main()
