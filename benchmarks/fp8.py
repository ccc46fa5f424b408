"""8-bit beside 16-bit in one run: the FP8 KV cache against the bf16 cache on the same
weights, for speed and for accuracy.

    PYTHONPATH=. python3 -m benchmarks.fp8 [--parts offline,long_context,accuracy] [--rounds 2]
        [--shapes qwen3-0.6b] [--smoke]

Variants (engine options over the same weights): ``bf16`` (the model's dtype everywhere) and
``fp8-kv`` (``kv_cache_dtype="fp8"``). Qwen3-0.6B shapes; weights random, filled on the device
(``load_format="dummy"``) for the speed parts, a saved std-0.1 checkpoint for accuracy.

- offline: ``benchmarks.throughput``'s offline-N (default 256) and its batch-1 run, one
  engine per variant and round (a fresh process-wide pool each time: each engine sizes its
  KV pool from the memory left free), rounds alternating the order (A B, B A, ...); the
  median of the rounds per variant, beside its goal: fp8-kv >= 40,000 tok/s.
- long_context: ``benchmarks.long_context``'s decode step at 16 x 8,192 per variant, beside
  its floor (the K/V at the cache's bytes plus the weights, over the copy bandwidth); goal:
  fp8-kv <= 3.0 ms/step.
- accuracy: each variant against bf16 on a saved checkpoint (weights N(0, 0.1), bf16
  values): 16 prompts x 64 greedy tokens, the top-5 rule at the first difference and the
  mean KL(bf16 || variant) of next-token distributions on bf16's tokens
  (``tests.model_utils.agreement``, through the executors the engine builds).

Summary: ``$OUT/fp8.json``. ``--smoke``: a tiny model on the CPU (every code path, no
meaningful number).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import tempfile
import time
from typing import Any

import torch

from benchmarks.accuracy import make_bf16_checkpoint, random_prompts
from benchmarks.long_context import minivllm_decode
from benchmarks.qwen3_shapes import SMOKE_SHAPES
from benchmarks.report import write_summary
from benchmarks.throughput import (add_common_args, bench_device, build_llm, median_run, met, model_path,
                                   offline_workload, run_batch1, run_offline)

VARIANTS: dict[str, dict[str, Any]] = {"bf16": {}, "fp8-kv": {"kv_cache_dtype": "fp8"}}
GOALS: dict[str, dict[str, tuple[float, bool]]] = {   # part -> variant -> (goal, lower is better)
    "offline": {"fp8-kv": (40_000, False)},
    "long_context": {"fp8-kv": (3.0, True)},
}
PARTS = ("offline", "long_context", "accuracy")


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """Round r runs the variants forward when r is even, backward when odd (A B, B A, ...),
    so neither side always runs first on a warming machine."""
    return [names if r % 2 == 0 else names[::-1] for r in range(rounds)]


# ---- offline and batch-1 ---------------------------------------------------------------

def offline_part(args: argparse.Namespace, path: str, device: str) -> dict[str, Any]:
    wl = offline_workload(args.num_requests, args.seed, args.smoke)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.variants}
    for r, order in enumerate(round_orders(args.variants, args.rounds)):
        for name in order:
            llm = build_llm(args, path, device, **VARIANTS[name])
            run = run_offline(llm, wl, stream=1 + r, label=f"{name}, round {r}")
            run["kv_blocks"] = llm.engine.num_blocks
            run["batch1"] = run_batch1(llm, 100 + r, f"{name}, round {r}", args.smoke, wl.id_limit)
            runs[name].append(run)
            llm.close()
            del llm
            release()
    out = {}
    for name, rs in runs.items():
        out[name] = dict(rounds=rs, tok_s=statistics.median(x["tok_s"] for x in rs),
                         kv_blocks=rs[0]["kv_blocks"],
                         batch1=median_run([x["batch1"] for x in rs], name))
    return out


# ---- long-context decode -------------------------------------------------------------

def long_context_part(args: argparse.Namespace, path: str, device: str) -> dict[str, Any]:
    from minivllm import LLM
    from minivllm.config import cdiv

    la = argparse.Namespace(num_prompts=args.long_prompts, prompt_len=args.long_len, decode_tokens=64,
                            seed=args.seed, id_limit=512 if args.smoke else 10000)
    max_len = la.prompt_len + la.decode_tokens
    block = 16 if args.smoke else 64
    out = {}
    for name in args.variants:
        llm = LLM(path, device=device, seed=args.seed, skip_tokenizer_init=True, max_num_seqs=la.num_prompts,
                  max_model_len=max_len, max_num_batched_tokens=64 if args.smoke else 16384,
                  enable_prefix_caching=False, async_scheduling=True, block_size=block,
                  num_blocks=la.num_prompts * cdiv(max_len, block) + 64, load_format=args.load_format,
                  **VARIANTS[name])
        print(f"long context [{name}]: {la.num_prompts} x {la.prompt_len:,}", flush=True)
        out[name] = minivllm_decode(llm, la, device)
        llm.close()
        del llm
        release()
    return out


# ---- accuracy --------------------------------------------------------------------------

def accuracy_part(args: argparse.Namespace, device: str) -> dict[str, Any]:
    from tests.model_utils import agreement, make_model_executor

    steps, n_prompts, plen = (4, 2, 8) if args.smoke else (64, 16, 32)
    bs = 16
    overrides = SMOKE_SHAPES if args.smoke else {}
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="minivllm-fp8-") as path:
        hf32 = make_bf16_checkpoint(path, std=0.1, device=device, **overrides)
        vocab = hf32.config.vocab_size
        del hf32
        release()
        prompts = random_prompts(n_prompts, plen, vocab)
        width = -(-(plen + steps) // bs)
        dtype = "bfloat16" if device == "cuda" else "float32"

        def executor(name: str) -> Any:
            return make_model_executor(path, device=device, dtype=dtype, block_size=bs, num_blocks=width + 4,
                                       max_num_seqs=1, max_num_batched_tokens=max(plen + steps, 64),
                                       **VARIANTS[name])

        reference = executor("bf16")
        for name in args.variants:
            if name == "bf16":
                continue
            ours = executor(name)
            a = agreement(reference, ours, prompts, steps, tuple(range(width)), bs)
            out[name] = dataclasses.asdict(a)
            print(f"accuracy [{name} vs bf16]: {a.identical}/{a.prompts} prompts identical over {steps} tokens, "
                  f"mean {a.mean_leading:.1f} leading tokens equal, top-5 rule broken in {a.top5_failures}; "
                  f"mean KL {a.mean_kl:.2e} (largest prompt {a.max_kl:.2e})", flush=True)
            ours.close()
            del ours
            release()
        reference.close()
    return out


# ---- main ------------------------------------------------------------------------------

def print_table(res: dict[str, Any]) -> None:
    """Each variant's numbers beside bf16's, with the goals."""
    for part, key, unit, spec in (("offline", "tok_s", "tok/s", ",.0f"), ("long_context", "median_ms", "ms/step", ".3f")):
        if part not in res:
            continue
        base = res[part].get("bf16", {}).get(key)
        for name, r in res[part].items():
            line = f"{part} [{name}]: {format(r[key], spec)} {unit}"
            if base and name != "bf16":
                line += f" (bf16 {format(base, spec)}; x{r[key] / base:.2f})"
            goal = GOALS.get(part, {}).get(name)
            if goal is not None:
                r["goal"], lower = goal
                r["met"] = (r[key] <= goal[0]) if lower else (r[key] >= goal[0])
                line += f" goal {'<=' if lower else '>='} {format(goal[0], spec)} {met(r[key], goal[0], lower)}"
            if part == "offline":
                line += f"; KV pool {r['kv_blocks']} blocks; batch-1 {r['batch1']['ms_per_token']:.3f} ms/token"
            print(line, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=2, help="offline: rounds of every variant")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--long-prompts", type=int, default=16)
    ap.add_argument("--long-len", type=int, default=8192)
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    args.variants = [v for v in args.variants.split(",") if v]
    if set(args.parts) - set(PARTS) or set(args.variants) - set(VARIANTS) or "bf16" not in args.variants:
        ap.error(f"--parts from {PARTS}; --variants from {tuple(VARIANTS)}, bf16 among them")
    # What build_llm reads and this benchmark fixes (the speed parts fill weights on the device).
    args.load_format = "dummy"
    args.max_num_seqs, args.max_num_batched_tokens, args.block_size = 256, None, None
    args.kernels, args.enforce_eager, args.tensor_parallel_size, args.disable_custom_all_reduce = (
        "auto", False, 1, False)
    if args.smoke:
        args.num_requests, args.max_num_seqs, args.rounds = min(args.num_requests, 6), 4, min(args.rounds, 2)
        args.long_prompts, args.long_len = 2, 48
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = bench_device(args)
    t0 = time.perf_counter()
    res: dict[str, Any] = {"args": vars(args)}
    path = model_path(args) if {"offline", "long_context"} & set(args.parts) else None
    if "offline" in args.parts:
        res["offline"] = offline_part(args, path, device)
        write_summary("fp8", res)
    if "long_context" in args.parts:
        res["long_context"] = long_context_part(args, path, device)
        write_summary("fp8", res)
    if "accuracy" in args.parts:
        res["accuracy"] = accuracy_part(args, device)
    print_table(res)
    write_summary("fp8", res)
    print(f"benchmarks.fp8: {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
