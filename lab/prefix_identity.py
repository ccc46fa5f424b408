"""Question: when a hybrid model's prefix-cache hit gives other greedy tokens than a miss, is
it the arithmetic (another order of sums in 16 bits) or a wrong state?

Runs the shared-prefix workload of ``benchmarks.hybrid`` (requests sharing a system prompt,
the first one alone first) three times: the prefix cache on; off; and off again with another
batching (one sequence a step), the control: what numerics alone change. For each pair it
prints how many outputs are identical, the top-5 rule at the first difference
(``benchmarks.hybrid.compare_greedy``) and the largest difference of the first token's top-5
log-probabilities (same context in every run: the prompt). A wrong state shows as the
cache's pair far outside the control's; in float32 both should be near zero::

    PYTHONPATH=. python3 lab/prefix_identity.py [--dtype float32|bfloat16] [--layers 8]
        [--requests 32] [--prefix-tokens 2000] [--shapes qwen3.5-9b] [--device cuda]

``--device cpu`` takes a tiny model (``benchmarks.hybrid.SMOKE_HYBRID``) and the torch
reference ops, or with ``--kernels triton`` and ``TRITON_INTERPRET=1`` the Triton kernels.
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.hybrid import SMOKE_HYBRID, compare_greedy
from minivllm import LLM, SamplingParams
from minivllm.testing import write_random_checkpoint, write_random_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3.5-9b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=8, help="layers of the model (the pattern repeats every 4)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--tail-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--kernels", default="auto", help="the LLM's kernels: auto, triton (TRITON_INTERPRET=1 on the CPU)")
    args = ap.parse_args()
    if args.device == "cpu":
        path = write_random_checkpoint(f"/tmp/prefix-identity-{args.shapes}-{args.dtype}", args.shapes,
                                       dtype=args.dtype, **SMOKE_HYBRID)
        vocab = SMOKE_HYBRID["vocab_size"]
    else:
        path = write_random_config(f"/tmp/prefix-identity-{args.shapes}-{args.layers}-{args.dtype}", args.shapes,
                                   dtype=args.dtype, num_hidden_layers=args.layers)
        vocab = 10000
    rng = np.random.default_rng(77)
    system = rng.integers(0, vocab, args.prefix_tokens).tolist()
    prompts = [system + rng.integers(0, vocab, args.tail_tokens).tolist() for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True, logprobs=5)
    runs = {}
    for name, caching, seqs in (("cache on", True, args.requests), ("cache off", False, args.requests),
                                ("cache off, one at a time", False, 1)):
        options = dict(block_size=args.block_size) if args.block_size else {}
        options["kernels"] = args.kernels
        llm = LLM(path, device=args.device, dtype=args.dtype, seed=0, skip_tokenizer_init=True,
                  max_num_seqs=seqs, max_model_len=args.prefix_tokens + args.tail_tokens + args.new_tokens + 64,
                  enable_prefix_caching=caching, load_format="auto" if args.device == "cpu" else "dummy",
                  **options)
        llm.generate(prompts[:1], params, use_tqdm=False)
        outs = llm.generate(prompts[1:], params, use_tqdm=False)
        runs[name] = ([list(o.token_ids) for o in outs], [o.logprobs for o in outs])
        print(f"{name}: cached tokens {sum(o.num_cached_tokens for o in outs):,} of "
              f"{sum(map(len, prompts[1:])):,}", flush=True)
        llm.close()
        del llm
    for a, b in (("cache on", "cache off"), ("cache off, one at a time", "cache off"),
                 ("cache on", "cache off, one at a time")):
        r = compare_greedy(*runs[a], *runs[b])
        print(f"{a} vs {b}: identical {r['identical_requests']} of {args.requests - 1}, first differences at "
              f"{sorted(r['first_difference_at'])}, outside the other's top-5: {r['top5_failures']}, "
              f"first token's top-5 log-probabilities differ by at most {r['first_logprob_max_diff']:.2e}",
              flush=True)


if __name__ == "__main__":
    main()
