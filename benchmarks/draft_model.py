"""A draft model's cost: one model's shapes drafting for another's (default Qwen3-0.6B for
Qwen3-8B), random weights, batch 1.

    PYTHONPATH=. python3 -m benchmarks.draft_model [--shapes qwen3-8b] [--draft-shapes qwen3-0.6b]
        [--k 4] [--new-tokens 128] [--load-format dummy] [--smoke]

Random weights make acceptance meaningless, so this measures the cost of a drafted step
(the draft's k + 1 decode steps and the target scoring 1 + k tokens) against a step
without drafts, both in the same process. Every step drafts (the engine's back-off after
rounds that keep nothing is held off here, for the measurement only). The speedup a
given acceptance implies follows: with each draft kept with probability a, independently,
a step yields (1 - a^(k+1)) / (1 - a) tokens, so the speedup is that many times the
plain step's time over the drafted step's.

Summary: ``$OUT/draft_model[_<shapes>].json``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from benchmarks.report import write_summary
from benchmarks.throughput import add_common_args, bench_device, model_path, sync


def implied_speedup(accept: float, k: int, plain_ms: float, drafted_ms: float) -> float:
    """Tokens per drafted step at per-draft acceptance ``accept``, times the plain step's
    time over the drafted step's."""
    tokens = k + 1 if accept == 1 else (1 - accept ** (k + 1)) / (1 - accept)
    return tokens * plain_ms / drafted_ms


def ms_per_step(llm: Any, prompt: list[int], new_tokens: int, device: str, rounds: int) -> tuple[float, float]:
    """Median ms per engine step over ``rounds`` batch-1 greedy runs, and tokens per step."""
    from minivllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    times, per_step = [], []
    for _ in range(rounds):
        steps = llm.engine.stats.num_steps
        sync(device)
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        sync(device)
        wall = time.perf_counter() - t0
        n = llm.engine.stats.num_steps - steps - 1  # the prefill's step
        times.append(wall * 1e3 / max(n, 1))
        per_step.append(len(out.token_ids) / max(n, 1))
    return float(np.median(times)), float(np.median(per_step))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.set_defaults(shapes="qwen3-8b")
    ap.add_argument("--draft-shapes", default="qwen3-0.6b")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    if args.smoke:
        args.new_tokens = min(args.new_tokens, 16)
    from minivllm import LLM

    device = bench_device(args)
    path = model_path(args)
    draft = model_path(argparse.Namespace(**{**vars(args), "shapes": args.draft_shapes, "model_dir": None}))
    prompt = np.random.default_rng(args.seed).integers(0, 500, 128).tolist()
    opts = dict(device=device, dtype=args.dtype, seed=args.seed, skip_tokenizer_init=True,
                load_format=args.load_format, max_model_len=256 if args.smoke else 1024)
    summary: dict[str, Any] = dict(shapes=args.shapes, draft_shapes=args.draft_shapes, k=args.k, dtype=args.dtype)
    with LLM(path, **opts) as llm:
        plain_ms, _ = ms_per_step(llm, prompt, args.new_tokens, device, args.rounds)
    print(f"{args.shapes} without drafts: {plain_ms:.3f} ms/step", flush=True)
    t0 = time.perf_counter()
    with LLM(path, speculative_config={"model": draft, "num_speculative_tokens": args.k}, **opts) as llm:
        print(f"start-up with the draft model {time.perf_counter() - t0:.1f}s", flush=True)
        llm.engine._spec_outcome = lambda useful: None  # every step drafts (the measurement only)
        drafted_ms, tokens = ms_per_step(llm, prompt, args.new_tokens, device, args.rounds)
        s = llm.engine.stats
        accepted = s.num_accepted_tokens / max(s.num_draft_tokens, 1)
    print(f"{args.draft_shapes} drafting k={args.k}: {drafted_ms:.3f} ms/step (x{drafted_ms / plain_ms:.2f} a plain "
          f"step), {tokens:.2f} tokens/step at the measured acceptance {accepted:.3f}", flush=True)
    summary.update(plain_ms_per_step=plain_ms, drafted_ms_per_step=drafted_ms, measured_acceptance=accepted,
                   tokens_per_drafted_step=tokens)
    for a in (0.6, 0.8):
        summary[f"implied_speedup_at_{a}"] = x = implied_speedup(a, args.k, plain_ms, drafted_ms)
        print(f"implied batch-1 speedup at acceptance {a}: x{x:.2f}", flush=True)
    write_summary("draft_model" + ("" if args.shapes == "qwen3-8b" else f"_{args.shapes}"), summary)


if __name__ == "__main__":
    main()
