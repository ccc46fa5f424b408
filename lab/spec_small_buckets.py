"""Do prefill-graph buckets of 8, 16 and 32 tokens make drafted steps cheaper? Batch-1 greedy with
k replayed drafts (all right, all wrong) and without, with the default buckets (64 up) and with
small ones added (the graphs captured again after start-up).

    PYTHONPATH=. python3 lab/spec_small_buckets.py [--k 4] [--new-tokens 256]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from minivllm import LLM, SamplingParams
from minivllm.executor.prefill_graph import default_prefill_buckets
from minivllm.testing import ReplayProposer, write_random_config


def ms_per_token(llm: LLM, prompt: list[int], params: SamplingParams) -> float:
    llm.generate([prompt], params, use_tqdm=False)  # warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / params.max_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256)
    args = ap.parse_args()
    path = write_random_config("/tmp/qwen3-0.6b-config", "qwen3-0.6b")
    llm = LLM(path, device="cuda", load_format="dummy", skip_tokenizer_init=True,
              max_model_len=1024, speculative_config={"method": "ngram", "num_speculative_tokens": args.k})
    ex = llm.engine.executor
    prompt = np.random.default_rng(0).integers(0, 10000, 128).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.engine.proposer = None
    truth = {tuple(prompt): llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids}
    vocab = llm.model_config.vocab_size
    default = default_prefill_buckets(ex.max_num_batched_tokens)
    for name, buckets in (("buckets from 64", default), ("buckets from 8", [8, 16, 32] + default),
                          ("buckets from 64 again", default)):
        ex.prefill_graph_runner = ex.make_prefill_graph_runner(capture=True, buckets=buckets)
        row = {}
        for label, proposer in (("no drafts", None), ("all right", ReplayProposer(truth, 128, args.k, 1.0, vocab)),
                                ("all wrong", ReplayProposer(truth, 128, args.k, 0.0, vocab))):
            llm.engine.proposer = proposer
            row[label] = ms_per_token(llm, prompt, greedy)
        print(f"{name}: " + ", ".join(f"{k} {v:.3f} ms/token" for k, v in row.items())
              + f"; all right x{row['no drafts'] / row['all right']:.2f}, all wrong x{row['all wrong'] / row['no drafts']:.2f}",
              flush=True)
    llm.close()


if __name__ == "__main__":
    main()
