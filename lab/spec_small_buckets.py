"""Do prefill-graph buckets of 8, 16 and 32 tokens make drafted steps cheaper, and how far must
rounds that keep nothing back off? Batch-1 greedy with k replayed drafts (all right, all wrong)
and without, with buckets from 64 and from 8 (the graphs captured again after start-up), in
alternating rounds; all-wrong drafts under each ``MAX_SPEC_BACKOFF`` given.

    PYTHONPATH=. python3 lab/spec_small_buckets.py [--shapes qwen3-0.6b] [--k 4] [--new-tokens 256]
        [--backoffs 16,64] [--rounds 2] [--settle 8]

In bf16 the scoring forward may round a near-tie of random weights otherwise than decode, so
the "all right" truth is settled per bucket set: the drafted run's own output, replayed until
it reproduces itself; the share of drafts kept is printed beside its time.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import minivllm.engine.llm_engine as llm_engine
from minivllm import LLM, SamplingParams
from minivllm.executor.prefill_graph import default_prefill_buckets
from minivllm.testing import ReplayProposer, write_random_config


def ms_per_token(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, list[int], float]:
    """ms/token of a warm run, its tokens, and the share of its drafts kept."""
    llm.generate([prompt], params, use_tqdm=False)  # warm
    s = llm.engine.stats
    drafted, kept = s.num_draft_tokens, s.num_accepted_tokens
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    d = s.num_draft_tokens - drafted
    return 1e3 * wall / params.max_tokens, out, (s.num_accepted_tokens - kept) / d if d else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-0.6b")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--backoffs", default="16,64")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settle", type=int, default=8)
    args = ap.parse_args()
    path = write_random_config(f"/tmp/{args.shapes}-config", args.shapes)
    llm = LLM(path, device="cuda", load_format="dummy", skip_tokenizer_init=True,
              max_model_len=1024, speculative_config={"method": "ngram", "num_speculative_tokens": args.k})
    ex = llm.engine.executor
    prompt = np.random.default_rng(0).integers(0, 10000, 128).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.engine.proposer = None
    plain = llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids
    vocab = llm.model_config.vocab_size
    default = default_prefill_buckets(ex.max_num_batched_tokens)
    truths = {}
    for round_ in range(args.rounds):
        for name, buckets in (("buckets from 64", default), ("buckets from 8", [8, 16, 32] + default)):
            ex.prefill_graph_runner = ex.make_prefill_graph_runner(capture=True, buckets=buckets)
            if name not in truths:
                truth = plain
                for i in range(args.settle):
                    llm.engine.proposer = ReplayProposer({tuple(prompt): truth}, 128, args.k, 1.0, vocab)
                    got = llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids
                    if got == truth:
                        break
                    truth = got
                print(f"{name}: truth settled after {i} replays, equal to decode's: {truth == plain}", flush=True)
                truths[name] = truth
            row = {}
            llm.engine.proposer = None
            row["no drafts"] = ms_per_token(llm, prompt, greedy)[0]
            llm.engine.proposer = ReplayProposer({tuple(prompt): truths[name]}, 128, args.k, 1.0, vocab)
            row["all right"], _, kept = ms_per_token(llm, prompt, greedy)
            for backoff in map(int, args.backoffs.split(",")):
                llm_engine.MAX_SPEC_BACKOFF = backoff
                llm.engine.proposer = ReplayProposer({tuple(prompt): truths[name]}, 128, args.k, 0.0, vocab)
                row[f"all wrong, backoff {backoff}"] = ms_per_token(llm, prompt, greedy)[0]
            llm_engine.MAX_SPEC_BACKOFF = 16
            base = row["no drafts"]
            print(f"round {round_} {args.shapes} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items())
                  + f" ms/token; all right x{base / row['all right']:.2f} ({kept:.3f} kept); "
                  + ", ".join(f"{k} x{v / base:.3f}" for k, v in row.items() if k.startswith("all wrong")), flush=True)
    llm.close()


if __name__ == "__main__":
    main()
