"""Long context: prefill throughput at 16 x 8,192 tokens against transformers' SDPA forward,
and the decode step of those 16 sequences against its memory-bandwidth floor.

    PYTHONPATH=. python3 -m benchmarks.long_context [--num-prompts 16] [--prompt-len 8192] [--smoke]
        [--no-hf --load-format dummy]

Qwen3-0.6B shapes, random weights, bf16, prefix caching off, one step in flight, a KV pool
just large enough (so the HF model fits beside it).

- Prefill: ``generate`` of the prompts with max_tokens=1, median wall time of ``--repeats``
  runs on fresh prompts after a warm-up; tok/s = prompt tokens / wall. Beside it, HF's
  ``Qwen3ForCausalLM`` (SDPA) forward over the same prompts, ``use_cache=False`` and
  ``logits_to_keep=1`` (minivllm too computes logits only where it samples).
- Decode: the engine stepped by hand over fresh prompts; the step time is the median
  interval between ``step()`` returns over the steps that decode every sequence and
  prefill nothing (with one step in flight, the device's step period). Its floor: the
  K/V of the sequences at their mean context plus every weight once, over the copy
  bandwidth (``benchmarks.gpu_timing``).

Summary: ``$OUT/long_context.json``. ``--smoke``: a tiny model on the CPU.
``--load-format dummy`` (with ``--no-hf``): random weights filled on the device, no checkpoint written.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

from benchmarks.gpu_timing import copy_bandwidth_gbs
from benchmarks.report import write_summary
from benchmarks.throughput import (add_common_args, bench_device, met, model_path,
                                   require_checkpoint_unless_dummy, sync)

GOAL_FACTOR = 1.5  # prefill, times HF's SDPA forward
GOAL_DECODE_MS = 5.0


def random_prompts(args: argparse.Namespace, stream: int) -> list[list[int]]:
    rng = np.random.default_rng([args.seed, stream])
    return rng.integers(0, args.id_limit, (args.num_prompts, args.prompt_len)).tolist()


# ---- bytes -----------------------------------------------------------------------

def kv_bytes_per_token(c: Any, dtype_bytes: int) -> int:
    """K and V of one token over all layers."""
    return c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * dtype_bytes


def weight_bytes(c: Any, dtype_bytes: int) -> int:
    """Every weight a decode step reads once: the layers, the final norm and the LM head
    (a tied embedding is the LM head; an untied one is read only at B rows, not counted)."""
    h, d = c.hidden_size, c.head_dim
    qkv = h * (c.num_attention_heads + 2 * c.num_key_value_heads) * d
    o = c.num_attention_heads * d * h
    mlp = 3 * h * c.intermediate_size
    norms = 2 * h + 2 * d          # input/post-attention norms, q/k norms
    return (c.num_hidden_layers * (qkv + o + mlp + norms) + h + c.vocab_size * h) * dtype_bytes


# ---- (a) prefill ---------------------------------------------------------------

def minivllm_prefill(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    from minivllm import SamplingParams

    one = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True)
    ntok = args.num_prompts * args.prompt_len
    llm.generate(random_prompts(args, 100), one, use_tqdm=False)  # warm-up (compile, autotune)
    runs = []
    for r in range(args.repeats):
        prompts = random_prompts(args, 101 + r)
        steps0 = llm.engine.stats.num_steps
        t0 = time.perf_counter()
        outs = llm.generate(prompts, one, use_tqdm=False)
        wall = time.perf_counter() - t0
        if any(len(o.token_ids) != 1 for o in outs):
            raise RuntimeError("a prefill request did not end with exactly one token")
        runs.append(wall)
        print(f"minivllm prefill run {r}: {ntok} tokens in {wall * 1e3:.1f} ms = {ntok / wall:,.0f} tok/s "
              f"({llm.engine.stats.num_steps - steps0} steps)", flush=True)
    wall = statistics.median(runs)
    return dict(tokens=ntok, runs_s=runs, median_s=wall, tok_s=ntok / wall)


def hf_prefill(path: str, args: argparse.Namespace, device: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    ntok = args.num_prompts * args.prompt_len

    def forward_all(prompts: list[list[int]]) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for i in range(0, len(prompts), args.hf_batch):
                ids = torch.tensor(prompts[i:i + args.hf_batch], device=device)
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
        sync(device)
        return time.perf_counter() - t0

    forward_all(random_prompts(args, 100))  # warm-up
    runs = []
    for r in range(args.repeats):
        runs.append(forward_all(random_prompts(args, 101 + r)))
        print(f"HF SDPA forward run {r}: {ntok} tokens in {runs[-1] * 1e3:.1f} ms = "
              f"{ntok / runs[-1]:,.0f} tok/s", flush=True)
    model = None  # the weights freed before the caller builds the next model
    wall = statistics.median(runs)
    return dict(tokens=ntok, runs_s=runs, median_s=wall, tok_s=ntok / wall, batch=args.hf_batch)


# ---- (b) decode ----------------------------------------------------------------

def decode_step_times(llm: Any, args: argparse.Namespace) -> tuple[list[float], list[int]]:
    """Step the engine through 16 fresh requests; (ms between returns, decode index) of the
    full-decode steps after the first ``skip``."""
    from minivllm import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=1.0, max_tokens=args.decode_tokens, ignore_eos=True)
    for i, p in enumerate(random_prompts(args, 200)):
        eng.add_request(f"long-{i}", p, params)
    stamps, full = [time.perf_counter()], []
    while eng.has_unfinished_requests():
        eng.step()
        stamps.append(time.perf_counter())
        rec = eng.last_step
        full.append(rec is not None and rec.num_prefill_tokens == 0 and len(rec.scheduled) == args.num_prompts)
    skip = 3
    idx = [k for k in range(1, len(full)) if full[k] and full[k - 1]][skip:]
    return [(stamps[k + 1] - stamps[k]) * 1e3 for k in idx], idx


def minivllm_decode(llm: Any, args: argparse.Namespace, device: str) -> dict[str, Any]:
    dts, idx = decode_step_times(llm, args)
    if len(dts) < 5:
        raise RuntimeError(f"only {len(dts)} full decode steps were timed; raise --decode-tokens")
    c = llm.model_config
    dtype_bytes = 2 if device == "cuda" else 4
    kv_dtype_bytes = llm.engine.executor.kv_cache.element_size()   # 1 with an FP8 cache
    # Decode steps in the window feed tokens prompt_len .. prompt_len + decode_tokens - 2; the
    # window is the last len(dts) of them, so its mean context is about:
    ctx = args.prompt_len + args.decode_tokens - 1 - len(dts) / 2
    kv = args.num_prompts * ctx * kv_bytes_per_token(c, kv_dtype_bytes)
    model = llm.engine.executor.model
    params_b = sum(p.numel() * p.element_size() for p in model.parameters())
    wb = weight_bytes(c, dtype_bytes)
    if any(p.element_size() == 1 for p in model.parameters()):
        # FP8 weights: the parameters' own bytes, less an untied embedding (only B rows read)
        embedding = model.model.embed_tokens.weight
        wb = params_b - (0 if c.tie_word_embeddings else embedding.numel() * embedding.element_size())
    gbs = copy_bandwidth_gbs(device, (1 << 30) if device == "cuda" else (1 << 24))
    floor_ms = (kv + wb) / (gbs * 1e9) * 1e3
    ms = statistics.median(dts)
    print(f"decode, {args.num_prompts} sequences at context ~{ctx:,.0f}: median {ms:.3f} ms/step over "
          f"{len(dts)} steps (min {min(dts):.3f}, max {max(dts):.3f})")
    print(f"  floor {floor_ms:.3f} ms = (K/V {kv / 1e9:.2f} GB + weights {wb / 1e9:.3f} GB) / copy "
          f"{gbs:,.0f} GB/s (the executor's parameters: {params_b / 1e9:.3f} GB); "
          f"measured / floor = {ms / floor_ms:.2f}", flush=True)
    return dict(median_ms=ms, steps=len(dts), step_ms=dts, context=ctx, kv_bytes=kv, weight_bytes=wb,
                param_bytes=params_b, copy_gbs=gbs, floor_ms=floor_ms)


def print_targets(res: dict[str, Any]) -> None:
    """Prefill (and its ratio to HF's, stored as ``prefill.vs_hf``) and decode beside their goals."""
    mv = res["prefill"]["minivllm"]["tok_s"]
    print(f"prefill {res['shape']}: {mv:,.0f} tok/s")
    hf = res["prefill"].get("hf", {})
    if "tok_s" in hf:
        res["prefill"]["vs_hf"] = ratio = mv / hf["tok_s"]
        print(f"prefill vs HF SDPA forward ({hf['tok_s']:,.0f} tok/s): {ratio:.2f}x (goal >= {GOAL_FACTOR}x) "
              f"{met(ratio, GOAL_FACTOR)}")
    d = res["decode"]
    print(f"decode step, {res['shape']}: {d['median_ms']:.2f} ms (goal <= {GOAL_DECODE_MS:g} ms; floor "
          f"{d['floor_ms']:.2f} ms) {met(d['median_ms'], GOAL_DECODE_MS, lower_is_better=True)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--block-size", type=int, default=None,
                    help="tokens per KV cache block (default: the LLM's, 64 on CUDA)")
    args = ap.parse_args()
    require_checkpoint_unless_dummy(ap, args, hf=not args.no_hf, hf_off="--no-hf")
    if args.smoke:
        args.num_prompts, args.prompt_len, args.decode_tokens = 2, 64, 16
        args.max_num_batched_tokens, args.repeats, args.hf_batch = 64, 2, 1
    args.id_limit = 512 if args.smoke else 10000
    device = bench_device(args)
    from minivllm import LLM
    from minivllm.config import CacheConfig, cdiv
    from minivllm.llm import CUDA_BLOCK_SIZE

    if args.block_size is None:
        args.block_size = CUDA_BLOCK_SIZE if device == "cuda" else CacheConfig().block_size

    path = model_path(args)
    max_len = args.prompt_len + args.decode_tokens
    t0 = time.perf_counter()
    llm = LLM(path, device=device, seed=args.seed, skip_tokenizer_init=True, max_num_seqs=args.num_prompts,
              max_model_len=max_len, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False, async_scheduling=True, block_size=args.block_size,
              num_blocks=args.num_prompts * cdiv(max_len, args.block_size) + 64, load_format=args.load_format)
    print(f"start-up {time.perf_counter() - t0:.1f}s, KV pool {llm.engine.num_blocks} blocks", flush=True)
    res: dict[str, Any] = {"args": vars(args), "shape": f"{args.num_prompts} x {args.prompt_len:,}"}
    res["prefill"] = {"minivllm": minivllm_prefill(llm, args)}
    res["decode"] = minivllm_decode(llm, args, device)
    if not args.no_hf:
        res["prefill"]["hf"] = hf_prefill(path, args, device)
    print_targets(res)
    write_summary("long_context", res)


if __name__ == "__main__":
    main()
