"""Speculative decoding: what trying costs and what it gains, each beside the same run's
numbers without drafts.

    PYTHONPATH=. python3 -m benchmarks.speculative [--shapes qwen3-0.6b] [--load-format dummy]
        [--batches 1,16] [--ks 1,2,4,8] [--accepts 0.5,0.7,0.9,1.0] [--new-tokens 128]
        [--offline 256] [--max-backoff N] [--smoke]

- **The gain, as a curve.** Each batch runs greedy once without drafts (its recorded
  continuations are the truth), then once per (k, acceptance) with a benchmark-only
  proposer that replays the recorded continuation, each draft right with probability
  ``acceptance`` (independently; a wrong one is the true token + 1): tokens/s, the measured
  acceptance (accepted / drafted) and the share of outputs equal to the truth. In float32
  the drafted runs give the run without drafts token for token; in bf16 the scoring forward
  may round a near-tie of random weights otherwise, so the truth is first settled: the
  drafted run's own output, replayed until it reproduces itself (``--settle``).
- **The cost of trying.** Drafts that are always wrong (acceptance 0, k = 4) at batch 1:
  ms/token against no drafts; and offline-N (``benchmarks.throughput``'s workload,
  sampled) with n-gram lookup on, finding nothing in random token ids, against it off.

Summary: ``$OUT/speculative[_<shapes>].json``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from benchmarks.report import write_summary
from benchmarks.throughput import add_common_args, bench_device, model_path, offline_workload, sync
from minivllm.config import SpeculativeConfig
from minivllm.spec.ngram import NgramProposer
from minivllm.testing import ReplayProposer


def timed(llm: Any, prompts: list[list[int]], params: Any, device: str) -> tuple[list[Any], float, Any]:
    before = llm.engine.stats.num_draft_tokens, llm.engine.stats.num_accepted_tokens, llm.engine.stats.num_steps
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    wall = time.perf_counter() - t0
    s = llm.engine.stats
    return outs, wall, (s.num_draft_tokens - before[0], s.num_accepted_tokens - before[1], s.num_steps - before[2])


def curve(llm: Any, args: argparse.Namespace, device: str, vocab: int) -> list[dict[str, Any]]:
    from minivllm import SamplingParams

    rows = []
    rng = np.random.default_rng(args.seed)
    plen = 8 if args.smoke else 128
    greedy = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    for batch in args.batches:
        prompts = [rng.integers(0, min(vocab, 10000), plen).tolist() for _ in range(batch)]
        llm.engine.proposer = None
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
        outs, base_wall, _ = timed(llm, prompts, greedy, device)
        truth = {tuple(p): o.token_ids for p, o in zip(prompts, outs)}
        # In bf16 the scoring forward may round a near-tie otherwise than decode's, and a
        # replayed continuation that drifted from the model's would make every later draft
        # wrong: replay the drafted run's own output until it reproduces itself.
        for _ in range(args.settle):
            llm.engine.proposer = ReplayProposer(truth, plen, max(args.ks), 1.0, vocab)
            settled = llm.generate(prompts, greedy, use_tqdm=False)
            if all(o.token_ids == truth[tuple(p)] for p, o in zip(prompts, settled)):
                break
            truth = {tuple(p): o.token_ids for p, o in zip(prompts, settled)}
        llm.engine.proposer = None
        ntok = sum(len(o.token_ids) for o in outs)
        base = dict(batch=batch, k=0, accept=None, tok_s=ntok / base_wall, ms_per_token=1e3 * base_wall / args.new_tokens)
        rows.append(base)
        print(f"batch {batch:3d} no drafts: {base['tok_s']:,.0f} tok/s, {base['ms_per_token']:.3f} ms/token", flush=True)
        for k in args.ks:
            for accept in [0.0] + args.accepts if k == 4 else args.accepts:
                llm.engine.proposer = ReplayProposer(truth, plen, k, accept, vocab)
                got, wall, (drafted, kept, steps) = timed(llm, prompts, greedy, device)
                # Identical in float32 (tests_gpu/test_speculative_gpu.py); in bf16 the scoring
                # forward (prefill kernels) may round a near-tie the other way than decode's.
                same = sum(g.token_ids == truth[tuple(p)] for g, p in zip(got, prompts)) / batch
                r = dict(batch=batch, k=k, accept=accept, tok_s=ntok / wall, ms_per_token=1e3 * wall / args.new_tokens,
                         speedup=base_wall / wall, measured_acceptance=kept / drafted if drafted else 0.0,
                         tokens_per_step=ntok / max(steps, 1) / batch, identical=same)
                rows.append(r)
                print(f"batch {batch:3d} k {k} accept {accept:.1f}: {r['tok_s']:,.0f} tok/s x{r['speedup']:.2f} "
                      f"({r['ms_per_token']:.3f} ms/token), kept {r['measured_acceptance']:.2f} of drafts, "
                      f"{r['tokens_per_step']:.2f} tokens per step, {same:.0%} identical", flush=True)
    llm.engine.proposer = None
    return rows


def offline_cost(llm: Any, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """offline-N sampled, n-gram lookup (k 4) on and off, alternating: tok/s each."""
    from minivllm import SamplingParams

    wl = offline_workload(args.offline, args.seed, args.smoke)
    params = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True) for m in wl.max_tokens]
    ngram = NgramProposer(SpeculativeConfig(num_speculative_tokens=4))
    result: dict[str, list[float]] = {"off": [], "ngram": []}
    llm.generate(wl.prompts(stream=99, n=32), SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
                 use_tqdm=False)
    for round_ in range(args.offline_rounds):
        for name in ("off", "ngram"):
            llm.engine.proposer = ngram if name == "ngram" else None
            outs, wall, (drafted, _, _) = timed(llm, wl.prompts(stream=2 * round_ + (name == "ngram")), params, device)
            tok_s = sum(len(o.token_ids) for o in outs) / wall
            result[name].append(tok_s)
            print(f"offline-{args.offline} n-gram {name}: {tok_s:,.0f} tok/s ({drafted} drafts scored)", flush=True)
    llm.engine.proposer = None
    off, on = float(np.median(result["off"])), float(np.median(result["ngram"]))
    return dict(requests=args.offline, off_tok_s=off, ngram_tok_s=on, ratio=on / off, rounds=result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--accepts", default="0.5,0.7,0.9,1.0")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--offline", type=int, default=256, help="requests of the offline cost run (0: skip it)")
    ap.add_argument("--offline-rounds", type=int, default=2)
    ap.add_argument("--settle", type=int, default=3,
                    help="replays of the drafted run's own output that settle the truth (bf16)")
    ap.add_argument("--max-backoff", type=int, default=None,
                    help="most steps between proposal rounds after misses (default the engine's; 0: draft "
                         "every step, so a bf16 truth settles where rejected drafts would reshape the steps)")
    ap.add_argument("--dtype", default="auto",
                    help="float32: the scoring forward gives the decode forward's tokens (in bf16 random "
                         "weights' near-ties may round otherwise, and the replayed truth drifts)")
    args = ap.parse_args()
    args.batches = [int(x) for x in args.batches.split(",")]
    args.ks = [int(x) for x in args.ks.split(",")]
    args.accepts = [float(x) for x in args.accepts.split(",")]
    if args.smoke:
        args.new_tokens = min(args.new_tokens, 16)
        args.offline = min(args.offline, 8)
    from minivllm import LLM

    device = bench_device(args)
    path = model_path(args)
    t0 = time.perf_counter()
    # A proposer is set per run (the engine reads it every step); the config only sizes nothing.
    smoke = dict(max_num_batched_tokens=64) if args.smoke else {}
    llm = LLM(path, device=device, dtype=args.dtype, seed=args.seed, skip_tokenizer_init=True,
              load_format=args.load_format,
              max_model_len=64 if args.smoke else 4096, **smoke,
              speculative_config={"method": "ngram", "num_speculative_tokens": max(args.ks)})
    print(f"start-up {time.perf_counter() - t0:.1f}s", flush=True)
    if args.max_backoff is not None:
        llm.engine.max_spec_backoff = args.max_backoff
    vocab = llm.model_config.vocab_size
    rows = curve(llm, args, device, vocab)
    summary: dict[str, Any] = dict(shapes=args.shapes, dtype=args.dtype, new_tokens=args.new_tokens,
                                   max_backoff=llm.engine.max_spec_backoff, curve=rows)
    b1 = {r["accept"]: r for r in rows if r["batch"] == 1 and r["k"] in (0, 4)}
    if 0.0 in b1 and None in b1:
        summary["cost_always_wrong_batch1"] = b1[0.0]["ms_per_token"] / b1[None]["ms_per_token"]
        print(f"batch-1, k 4, every draft wrong: x{summary['cost_always_wrong_batch1']:.3f} ms/token of no drafts")
    if args.offline:
        summary["offline_ngram_finding_nothing"] = offline_cost(llm, args, device)
        print(f"offline-{args.offline}, n-gram finding nothing: x{summary['offline_ngram_finding_nothing']['ratio']:.3f}")
    llm.close()
    write_summary("speculative" + ("" if args.shapes == "qwen3-0.6b" else f"_{args.shapes}")
                  + ("" if args.dtype == "auto" else f"_{args.dtype}"), summary)


if __name__ == "__main__":
    main()
