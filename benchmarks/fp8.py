"""8-bit beside 16-bit in one run: the FP8 KV cache and FP8 weights against bf16 on the
same shapes, for speed and for accuracy.

    PYTHONPATH=. python3 -m benchmarks.fp8 [--parts offline,long_context,attention,accuracy] [--rounds 2] [--sweep]
        [--variants bf16,fp8-kv,fp8-weights,fp8-weights-channel] [--shapes qwen3-0.6b|qwen3-8b] [--smoke]

Variants: ``bf16`` (the model's dtype everywhere), ``fp8-kv`` (``kv_cache_dtype="fp8"``),
``fp8-weights`` (a Qwen3-FP8 checkpoint's format: the config gains Qwen's
``quantization_config``, e4m3 linear layers with 128x128 block scales) and
``fp8-weights-channel`` (``quantization="fp8"``: per-channel scales at load). Weights random,
filled on the device (``load_format="dummy"``) for the speed parts, a saved std-0.1
checkpoint for accuracy (``fp8-weights`` there: the checkpoint converted by
``fixtures/fp8_checkpoint.py``).

- offline: ``benchmarks.throughput``'s offline-N (default 256) and its batch-1 run, one
  engine per variant and round (a fresh process-wide pool each time: each engine sizes its
  KV pool from the memory left free), rounds alternating the order (A B, B A, ...); the
  median of the rounds per variant, beside its goals: fp8-kv >= 40,000 tok/s at Qwen3-0.6B;
  fp8-weights batch-1 <= 0.6 ms/token at Qwen3-0.6B, <= 2.6 at Qwen3-8B. On a GPU, round 0
  of each variant also profiles batch-1 decode steps (``benchmarks.throughput``'s
  ``profile_decode``: GPU time per step, the costliest kernels).
- long_context: ``benchmarks.long_context``'s decode step at 16 x 8,192 per variant, beside
  its floor (the K/V at the cache's bytes plus the weights, over the copy bandwidth); goal:
  fp8-kv <= 3.0 ms/step.
- attention: the decode attention kernel alone at the same shape over a bf16 and an e4m3
  cache: us a call and the K/V bytes a second against the copy bandwidth; ``--sweep``: also
  every tile config of ``ATTENTION_SWEEP`` on each cache, the fastest beside the default.
- accuracy: each variant against bf16 on a saved checkpoint (weights N(0, 0.1), bf16
  values): 16 prompts x 64 greedy tokens, the top-5 rule at the first difference and the
  mean KL(bf16 || variant) of next-token distributions on bf16's tokens
  (``minivllm.testing.agreement``, through the executors the engine builds).

Summary: ``$OUT/fp8.json``. ``--smoke``: a tiny model on the CPU (every code path, no
meaningful number).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.long_context import minivllm_decode
from benchmarks.report import write_summary
from benchmarks.throughput import (add_common_args, bench_device, build_llm, median_run, met, model_path,
                                   offline_workload, profile_decode, run_batch1, run_offline)
from minivllm.testing import (SHAPES, SMOKE_SHAPES, agreement, make_bf16_checkpoint, make_model_executor,
                              random_prompts, release_memory, write_random_config)

# Engine options of each variant; FP8_CHECKPOINT: the variant reads a Qwen3-FP8-format model.
FP8_CHECKPOINT = "fp8_checkpoint"
VARIANTS: dict[str, dict[str, Any]] = {
    "bf16": {}, "fp8-kv": {"kv_cache_dtype": "fp8"}, "fp8-weights": {FP8_CHECKPOINT: True},
    "fp8-weights-channel": {"quantization": "fp8"},
}
DEFAULT_VARIANTS = ("bf16", "fp8-kv", "fp8-weights")
# (part, measure) -> variant -> shapes -> (goal, lower is better)
GOALS: dict[tuple[str, str], dict[str, dict[str, tuple[float, bool]]]] = {
    ("offline", "tok_s"): {"fp8-kv": {"qwen3-0.6b": (40_000, False)}},
    ("offline", "batch1_ms"): {"fp8-weights": {"qwen3-0.6b": (0.6, True), "qwen3-8b": (2.6, True)}},
    ("long_context", "median_ms"): {"fp8-kv": {"qwen3-0.6b": (3.0, True)}},
}
# A tiny model whose every FP8 layer part starts on a 128 edge (heads of 128; 2 and 1 of them).
SMOKE_FP8_SHAPES = {**SMOKE_SHAPES, "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 2,
                    "num_key_value_heads": 1, "head_dim": 128}
# What Qwen3-FP8 checkpoints' config.json holds (fixtures/fp8_checkpoint.py writes the same).
QWEN_FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
PARTS = ("offline", "long_context", "attention", "accuracy")
# (block_n, num_warps, num_stages) of the decode attention kernel that --sweep times, each by
# pointers and, where the blocks of 64 hold whole tiles, by tensor-memory boxes
# (DecodeConfig.tma); over the e4m3 cache each also with fp16 dots (DecodeConfig.fp16_dots).
ATTENTION_SWEEP = [(bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
ATTENTION_SPLITS = (1, 2, 4, 8, 16)  # and the default tiles at these context splits


def engine_options(name: str) -> dict[str, Any]:
    """The LLM options of variant ``name``."""
    return {k: v for k, v in VARIANTS[name].items() if k != FP8_CHECKPOINT}


def variant_path(path: str, name: str, convert: bool = False) -> str:
    """The model directory variant ``name`` reads: ``path``, or for an FP8-checkpoint variant
    a copy beside it in Qwen3-FP8's format: its config.json with Qwen's quantization_config
    (``convert``: the weights converted too, ``fixtures/fp8_checkpoint.py``; else config only,
    for ``load_format="dummy"``)."""
    if not VARIANTS[name].get(FP8_CHECKPOINT):
        return path
    out = Path(path.rstrip("/") + "-fp8")
    if convert:
        from fixtures.fp8_checkpoint import convert_checkpoint

        if out.exists():
            shutil.rmtree(out)
        convert_checkpoint(path, out)
        return str(out)
    out.mkdir(exist_ok=True)
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = QWEN_FP8_CONFIG
    (out / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return str(out)


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
            llm = build_llm(args, variant_path(path, name), device, **engine_options(name))
            run = run_offline(llm, wl, stream=1 + r, label=f"{name}, round {r}")
            run["kv_blocks"] = llm.engine.num_blocks
            run["batch1"] = run_batch1(llm, 100 + r, f"{name}, round {r}", args.smoke, wl.id_limit)
            if device == "cuda" and r == 0:  # where a step's GPU time goes, kernel by kernel
                print(f"[{name}]", end=" ")
                run["decode_kernels"] = profile_decode(llm, wl.id_limit)
                print(f"[{name}]", end=" ")  # a full batch at about the workload's mean context
                run["decode_kernels_batch256"] = profile_decode(llm, wl.id_limit, batch=256, steps=16,
                                                                prompt_len=768)
            runs[name].append(run)
            llm.close()
            del llm
            release_memory()
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
        llm = LLM(variant_path(path, name), device=device, seed=args.seed, skip_tokenizer_init=True,
                  max_num_seqs=la.num_prompts,
                  max_model_len=max_len, max_num_batched_tokens=64 if args.smoke else 16384,
                  enable_prefix_caching=False, async_scheduling=True, block_size=block,
                  num_blocks=la.num_prompts * cdiv(max_len, block) + 64, load_format=args.load_format,
                  **engine_options(name))
        print(f"long context [{name}]: {la.num_prompts} x {la.prompt_len:,}", flush=True)
        out[name] = minivllm_decode(llm, la, device)
        llm.close()
        del llm
        release_memory()
    return out


# ---- the decode attention kernel alone ------------------------------------------------

def attention_part(args: argparse.Namespace, device: str) -> dict[str, Any]:
    """The decode attention kernel by itself at the long-context part's shape (its prompts x
    its length, the model's heads), over a bf16 cache and an e4m3 one of the same values:
    us a call (in a CUDA graph; on the CPU, the interpreter's wall time) and the K/V bytes
    it reads a second. Separates the kernel from the rest of a long-context step."""
    from minivllm.kernels.decode_attention import (
        DecodeConfig, num_sms, choose_num_splits, decode_attention, default_config,
    )
    from minivllm.kernels.fp8 import is_fp8_cache
    from minivllm.kernels.reference import quantize_kv_reference

    from benchmarks.gpu_timing import copy_bandwidth_gbs, graph_us

    numbers = SMOKE_FP8_SHAPES if args.smoke else SHAPES[args.shapes][1]
    heads, kv_heads, dim = numbers["num_attention_heads"], numbers["num_key_value_heads"], numbers["head_dim"]
    batch, context, block = (2, 64, 32) if args.smoke else (args.long_prompts, args.long_len, 64)
    gen = torch.Generator(device).manual_seed(args.seed)
    width = context // block
    shape = (batch * width, block, kv_heads, dim)
    q = torch.randn(batch, heads, dim, generator=gen, device=device).bfloat16()
    k, v = (torch.randn(shape, generator=gen, device=device).bfloat16() for _ in range(2))
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    tables = torch.randperm(batch * width, generator=gen, device=device).to(torch.int32).view(batch, width)
    one = torch.ones(1, device=device)
    caches = {"bf16": (k, v, {}),
              "fp8": (quantize_kv_reference(k, one), quantize_kv_reference(v, one), dict(k_scale=one, v_scale=one))}
    gbs = copy_bandwidth_gbs(device, 1 << 30 if device == "cuda" else 1 << 20)
    def timed(kc: torch.Tensor, vc: torch.Tensor, scales: dict[str, torch.Tensor],
              config: DecodeConfig | None = None, num_splits: int | None = None) -> float:
        def call(_: int) -> torch.Tensor:
            return decode_attention(q, kc, vc, lens, tables, dim ** -0.5, config, num_splits=num_splits, **scales)
        if device == "cuda":
            return graph_us(call, 1)
        call(0)
        t0 = time.perf_counter()
        call(0)
        return (time.perf_counter() - t0) * 1e6

    out = {}
    for name, (kc, vc, scales) in caches.items():
        us = timed(kc, vc, scales)
        kv = 2 * kc.numel() * kc.element_size()
        out[name] = dict(us=us, kv_bytes=kv, gbs=kv / us / 1e3, copy_fraction=kv / us / 1e3 / gbs)
        print(f"decode attention [{name} cache]: {batch} x {context:,}, {heads}/{kv_heads} heads of {dim}: "
              f"{us:.1f} us, K/V {kv / 1e9:.3f} GB = {out[name]['gbs']:,.0f} GB/s = "
              f"{100 * out[name]['copy_fraction']:.1f}% of copy {gbs:,.0f} GB/s", flush=True)
        if args.sweep:
            tiles = ATTENTION_SWEEP[:2] if args.smoke else ATTENTION_SWEEP
            grid = [(*c, dots, tma) for c in tiles for dots in ((False, True) if name == "fp8" else (False,))
                    for tma in (False, True) if not tma or block % c[0] == 0]
            times = {cfg: timed(kc, vc, scales, DecodeConfig(*cfg)) for cfg in grid}
            best = min(times, key=times.__getitem__)
            out[name]["sweep"] = [dict(block_n=c[0], num_warps=c[1], num_stages=c[2], fp16_dots=c[3], tma=c[4],
                                       us=t) for c, t in times.items()]
            print(f"  best of {len(grid)} tiles: block_n {best[0]}, {best[1]} warps, {best[2]} stages"
                  f"{', fp16 dots' if best[3] else ''}{', boxes' if best[4] else ''}: {times[best]:.1f} us "
                  f"(default {us:.1f})", flush=True)
            for tma in (False, True):
                mine = {c: t for c, t in times.items() if c[4] == tma}
                if mine:
                    b = min(mine, key=mine.__getitem__)
                    print(f"    best {'by boxes' if tma else 'by pointers'}: {b[:4]} {mine[b]:.1f} us", flush=True)
        if args.split_sweep:
            # The default tiles at other split counts (choose_num_splits picks from shapes).
            splits = {n: timed(kc, vc, scales, num_splits=n) for n in ATTENTION_SPLITS}
            picked = choose_num_splits(batch, kv_heads, width * block, num_sms(q.device),
                                       default_config(q.dtype, dim, is_fp8_cache(kc), block).block_n)
            out[name]["splits"] = [dict(num_splits=n, us=t) for n, t in splits.items()]
            out[name]["default_splits"] = picked
            print(f"  default tiles by splits (the default {picked}): "
                  + ", ".join(f"{n}: {t:.1f} us" for n, t in splits.items()), flush=True)
    return out


# ---- accuracy --------------------------------------------------------------------------

def accuracy_part(args: argparse.Namespace, device: str) -> dict[str, Any]:
    steps, n_prompts, plen = (4, 2, 8) if args.smoke else (64, 16, 32)
    bs = 16
    overrides = SMOKE_FP8_SHAPES if args.smoke else {}
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="minivllm-fp8-") as path:
        hf32 = make_bf16_checkpoint(path, std=0.1, device=device, **overrides)
        vocab = hf32.config.vocab_size
        del hf32
        release_memory()
        prompts = random_prompts(n_prompts, plen, vocab)
        width = -(-(plen + steps) // bs)
        dtype = "bfloat16" if device == "cuda" else "float32"

        def executor(name: str) -> Any:
            return make_model_executor(variant_path(path, name, convert=True), device=device, dtype=dtype,
                                       block_size=bs, num_blocks=width + 4, max_num_seqs=1,
                                       max_num_batched_tokens=max(plen + steps, 64), **engine_options(name))

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
            release_memory()
        reference.close()
        shutil.rmtree(path.rstrip("/") + "-fp8", ignore_errors=True)  # the converted copy beside it
    return out


# ---- main ------------------------------------------------------------------------------

MEASURES = (("offline", "tok_s", "offline tok/s", ",.0f"), ("offline", "batch1_ms", "batch-1 ms/token", ".3f"),
            ("long_context", "median_ms", "long-context decode ms/step", ".3f"))


def print_table(res: dict[str, Any], shapes: str) -> None:
    """Each variant's numbers beside bf16's, with the goals (recorded as ``goals`` in the
    variant's part: measure -> goal, met)."""
    for part, key, label, spec in MEASURES:
        if part not in res:
            continue
        for r in res[part].values():
            if part == "offline":
                r["batch1_ms"] = r["batch1"]["ms_per_token"]
        base = res[part].get("bf16", {}).get(key)
        for name, r in res[part].items():
            line = f"{label} [{name}]: {format(r[key], spec)}"
            if base and name != "bf16":
                line += f" (bf16 {format(base, spec)}; x{r[key] / base:.2f})"
            goal = GOALS.get((part, key), {}).get(name, {}).get(shapes)
            if goal is not None:
                value, lower = goal
                ok = r[key] <= value if lower else r[key] >= value
                r.setdefault("goals", {})[key] = dict(goal=value, met=ok)
                line += f" goal {'<=' if lower else '>='} {format(value, spec)} {met(r[key], value, lower)}"
            if part == "offline" and key == "tok_s":
                line += f"; KV pool {r['kv_blocks']} blocks"
            print(line, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=2, help="offline: rounds of every variant")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--long-prompts", type=int, default=16)
    ap.add_argument("--long-len", type=int, default=8192)
    ap.add_argument("--sweep", action="store_true", help="attention: also time the tiles of ATTENTION_SWEEP")
    ap.add_argument("--split-sweep", action="store_true", help="attention: also time the split counts of ATTENTION_SPLITS")
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
    path = None
    if {"offline", "long_context"} & set(args.parts):
        path = (write_random_config(f"/tmp/minivllm-smoke-fp8-{args.shapes}", args.shapes, dtype="float32",
                                    **SMOKE_FP8_SHAPES) if args.smoke else model_path(args))
    if "offline" in args.parts:
        res["offline"] = offline_part(args, path, device)
        write_summary("fp8", res)
    if "long_context" in args.parts:
        res["long_context"] = long_context_part(args, path, device)
        write_summary("fp8", res)
    if "attention" in args.parts:
        res["attention"] = attention_part(args, device)
        write_summary("fp8", res)
    if "accuracy" in args.parts:
        res["accuracy"] = accuracy_part(args, device)
    print_table(res, args.shapes)
    write_summary("fp8", res)
    print(f"benchmarks.fp8: {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
