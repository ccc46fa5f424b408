"""Qwen3.5 hybrid models (Gated DeltaNet + gated attention; random weights filled on the
device, no checkpoint) against their memory-bandwidth floors, and the prefix cache on them.

    PYTHONPATH=. python3 -m benchmarks.hybrid [--shapes qwen3.5-9b|qwen3.5-35b-a3b]
        [--parts batch1,offline,prefix,mtp] [--num-requests 256] [--batch1-repeats 3]
        [--prefix-requests 256] [--prefix-tokens 2000] [--mtp-batches 1,32] [--smoke]

Every floor is bytes that must be moved over the copy bandwidth measured in the run
(``benchmarks.gpu_timing``). A step of B tokens reads every weight of the dense part once
(``step_weight_bytes``: attention layers, DeltaNet layers, dense MLPs or, in a sparse layer,
router, shared expert and the expected distinct experts of B tokens, norms, the LM head, B
embedding rows), the K/V of each sequence's context in the attention layers, and reads and
writes each sequence's recurrent state in every DeltaNet layer (``state_traffic_bytes``: float32
(H, K, V) per layer and the conv's last inputs; 2 MB a layer at Qwen3.5-9B's shapes, which
at batch 256 outweighs the weights).

- batch-1: ``benchmarks.throughput``'s round (128-token prompt, 256 greedy tokens, prefill
  included), median of ``--batch1-repeats``. Floor: one step at B = 1 at the mean context.
  Goal: at least 0.85 of the floor's speed.
- offline: ``benchmarks.throughput``'s offline-N workload, tok/s beside the floor's tok/s: the
  completion tokens in the fewest steps a schedule can have (``benchmarks.moe.decode_batches``),
  each step's weights, every decoded token's K/V and its sequence's state traffic.
- prefix: ``--prefix-requests`` requests sharing a ``--prefix-tokens``-token system prompt
  (then 32 tokens of their own, 16 greedy tokens each), with the prefix cache on and off: the
  prompt tokens computed, wall time, the snapshots' memory (entries and bytes,
  ``executor/linear_state.py``), and whether both runs' outputs are identical: how many are,
  and for the others the top-5 rule at the first differing token (``compare_greedy``). The
  first request runs alone first (its snapshot then exists for all the others, as a server's
  warm system prompt).
- mtp: the cost of the model's MTP head as the proposer (``speculative_config`` method
  ``mtp``, ``executor/mtp.py``), per decode step, at each batch of ``--mtp-batches`` (prompts of
  128 tokens, 64 greedy tokens each): ms a step without the head (a plain engine), with the
  head only keeping its K/V up (no proposer), and drafting k = 1, 2, 3 tokens at every step
  (no backoff), each row timed after the same run once. Random weights: every draft is
  rejected, so each step still yields one token a sequence and the time is all cost; a real
  head's accepted drafts are the gain against it.

Summary: ``$OUT/hybrid_<shapes>.json``, or ``hybrid_<shapes>_<parts>.json`` when ``--parts``
is not the shapes' default (all for 9B; batch1,offline for 35B-A3B). ``--smoke``: a tiny
float32 hybrid on the CPU (the torch references), nothing compared with a floor.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from benchmarks.gpu_timing import copy_bandwidth_gbs
from benchmarks.moe import decode_batches, expected_distinct_experts
from benchmarks.report import write_summary
from benchmarks.throughput import (bench_device, build_llm, median_run, met, offline_workload, run_batch1,
                                   run_offline)
from minivllm.config import ModelConfig
from minivllm.executor.linear_state import state_bytes
from minivllm.testing import write_random_config

SHAPES_NAMES = ("qwen3.5-9b", "qwen3.5-35b-a3b")
PARTS = ("batch1", "offline", "prefix", "mtp")
# the parts a run of each shapes makes by default (``make bench``'s runs)
DEFAULT_PARTS = {"qwen3.5-9b": PARTS, "qwen3.5-35b-a3b": ("batch1", "offline")}
GOAL_BATCH1_FLOOR_FRACTION = 0.85
BATCH1_PROMPT, BATCH1_NEW = 128, 256
SMOKE_HYBRID: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, bos_token_id=1, eos_token_id=2,
)


# ---- bytes -------------------------------------------------------------------------

def _linear_layer_weights(c: ModelConfig) -> int:
    """Values of one DeltaNet layer: the packed in-projection (q, k, v, z, b, a), the conv's
    filters, A_log and dt_bias, the gated norm, out_proj."""
    h, key, value = c.hidden_size, c.linear_num_key_heads * c.linear_key_head_dim, \
        c.linear_num_value_heads * c.linear_value_head_dim
    in_proj = h * (2 * key + 2 * value + 2 * c.linear_num_value_heads)
    return in_proj + c.linear_conv_dim * c.linear_conv_kernel_dim + 2 * c.linear_num_value_heads \
        + c.linear_value_head_dim + value * h


def _attention_layer_weights(c: ModelConfig) -> int:
    """Values of one gated attention layer: q with its output gate (2 H D rows), k, v, o, q/k norms."""
    h, d = c.hidden_size, c.head_dim
    return h * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) * d + c.num_attention_heads * d * h + 2 * d


def _mlp_weights(c: ModelConfig, layer: int, batch: float) -> float:
    """Values a step of ``batch`` tokens reads of one layer's MLP: dense, or router, shared
    expert and its gate, and the expected distinct experts."""
    h = c.hidden_size
    if not c.is_sparse_layer(layer):
        return 3 * h * c.intermediate_size
    shared = 3 * h * c.shared_expert_intermediate_size + h if c.shared_expert_intermediate_size else 0
    return c.num_experts * h + shared + expected_distinct_experts(c, batch) * 3 * h * c.moe_intermediate_size


def step_weight_bytes(c: ModelConfig, batch: float, dtype_bytes: int) -> float:
    """Weights a step of ``batch`` tokens reads (module doc)."""
    values = c.num_linear_layers * _linear_layer_weights(c) + c.num_attention_layers * _attention_layer_weights(c)
    values += sum(_mlp_weights(c, i, batch) for i in range(c.num_hidden_layers))
    values += c.num_hidden_layers * 2 * c.hidden_size + c.hidden_size                  # layer norms, final norm
    values += c.vocab_size * c.hidden_size + (0 if c.tie_word_embeddings else batch * c.hidden_size)
    return values * dtype_bytes


def state_traffic_bytes(c: ModelConfig, dtype: torch.dtype) -> int:
    """One sequence's state traffic a step: its whole state (``linear_state.state_bytes``:
    every DeltaNet layer's float32 recurrent state and conv inputs), read and written."""
    return 2 * state_bytes(c, dtype)


def kv_token_bytes(c: ModelConfig, dtype_bytes: int) -> int:
    """K and V of one token over the attention layers."""
    return c.num_attention_layers * 2 * c.num_key_value_heads * c.head_dim * dtype_bytes


# ---- parts ---------------------------------------------------------------------------

def batch1(llm: Any, args: argparse.Namespace, c: ModelConfig, dtype: torch.dtype, gbs: float) -> dict[str, Any]:
    runs = [run_batch1(llm, 100 + 10 * r, args.shapes, args.smoke, _id_limit(args)) for r in range(args.batch1_repeats)]
    r = median_run(runs, args.shapes)
    plen, new = (8, 8) if args.smoke else (BATCH1_PROMPT, BATCH1_NEW)
    context = plen + new // 2
    step = (step_weight_bytes(c, 1, dtype.itemsize) + state_traffic_bytes(c, dtype)
            + context * kv_token_bytes(c, dtype.itemsize))
    r.update(context=context, step_bytes=step, floor_ms=step / (gbs * 1e9) * 1e3,
             goal_floor_fraction=GOAL_BATCH1_FLOOR_FRACTION)
    r["floor_fraction"] = r["floor_ms"] / r["ms_per_token"]
    r["met"] = r["floor_fraction"] >= GOAL_BATCH1_FLOOR_FRACTION
    print(f"batch-1 [{args.shapes}]: {r['ms_per_token']:.3f} ms/token (floor {r['floor_ms']:.3f} ms: "
          f"{r['floor_fraction']:.2f} of the floor's speed; goal >= {GOAL_BATCH1_FLOOR_FRACTION}) "
          f"{met(r['floor_fraction'], GOAL_BATCH1_FLOOR_FRACTION)}", flush=True)
    return r


def offline(llm: Any, args: argparse.Namespace, c: ModelConfig, dtype: torch.dtype, gbs: float) -> dict[str, Any]:
    wl = offline_workload(args.num_requests, args.seed, args.smoke)
    r = run_offline(llm, wl, stream=1, label=args.shapes)
    batches = decode_batches(wl.max_tokens, args.max_num_seqs)
    tokens = sum(wl.max_tokens)
    weights = sum(step_weight_bytes(c, b, dtype.itemsize) for b in batches)
    kv = sum(m * p + m * (m - 1) // 2 for p, m in zip(wl.prompt_lens, wl.max_tokens)) * kv_token_bytes(c, dtype.itemsize)
    states = tokens * state_traffic_bytes(c, dtype)
    floor_s = (weights + kv + states) / (gbs * 1e9)
    r.update(workload=f"offline-{args.num_requests}", floor_steps=len(batches), weight_bytes=weights, kv_bytes=kv,
             state_bytes=states, floor_tok_s=tokens / floor_s)
    r["floor_fraction"] = r["tok_s"] / r["floor_tok_s"]
    print(f"offline-{args.num_requests} [{args.shapes}]: {r['tok_s']:,.0f} tok/s (floor {r['floor_tok_s']:,.0f} tok/s: "
          f"weights {weights / 1e9:.0f} GB, K/V {kv / 1e9:.0f} GB, states {states / 1e9:.0f} GB; "
          f"{r['floor_fraction']:.2f} of the floor)", flush=True)
    return r


def prefix(args: argparse.Namespace, path: str, device: str, c: ModelConfig) -> dict[str, Any]:
    """The shared-system-prompt workload with the prefix cache on, then off (module doc)."""
    from minivllm import SamplingParams

    n, plen = (6, 32) if args.smoke else (args.prefix_requests, args.prefix_tokens)
    rng = np.random.default_rng([args.seed, 77])
    system = rng.integers(0, _id_limit(args), plen).tolist()
    prompts = [system + rng.integers(0, _id_limit(args), 8 if args.smoke else 32).tolist() for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=4 if args.smoke else 16, ignore_eos=True, logprobs=5)
    result: dict[str, Any] = {"requests": n, "shared_tokens": plen}
    outputs, logprobs = {}, {}
    for caching in (True, False):
        llm = build_llm(args, path, device, enable_prefix_caching=caching)
        llm.generate(prompts[:1], params, use_tqdm=False)
        stats0 = llm.engine.stats.num_cached_tokens
        t0 = time.perf_counter()
        outs = llm.generate(prompts[1:], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        cached = sum(o.num_cached_tokens for o in outs)
        prompt_tokens = sum(map(len, prompts[1:]))
        slots, snapshots = llm.engine.executor.state_pool()
        entry = state_bytes(c, llm.engine.executor.dtype)
        row = dict(wall_s=wall, prompt_tokens=prompt_tokens, cached_tokens=cached,
                   computed_prompt_tokens=prompt_tokens - cached, stats_cached=llm.engine.stats.num_cached_tokens - stats0,
                   state_slots=slots, snapshots=snapshots, state_entry_bytes=entry, snapshot_bytes=snapshots * entry)
        outputs[caching] = [list(o.token_ids) for o in outs]
        logprobs[caching] = [o.logprobs for o in outs]
        name = "cache_on" if caching else "cache_off"
        result[name] = row
        print(f"prefix [{args.shapes}] {name}: {n - 1} requests in {wall:.2f}s, prompt tokens computed "
              f"{row['computed_prompt_tokens']:,} of {prompt_tokens:,}; snapshots {snapshots} of "
              f"{entry / 1e6:.1f} MB = {row['snapshot_bytes'] / 1e9:.2f} GB", flush=True)
        llm.close()
        del llm
    result["identical_outputs"] = outputs[True] == outputs[False]
    result.update(compare_greedy(outputs[True], logprobs[True], outputs[False], logprobs[False]))
    result["speedup"] = result["cache_off"]["wall_s"] / result["cache_on"]["wall_s"]
    print(f"prefix [{args.shapes}]: x{result['speedup']:.2f} with the cache, outputs identical: "
          f"{result['identical_requests']} of {n - 1} requests; at the first difference, tokens outside the "
          f"other's top-5: {result['top5_failures']}; first token's top-5 log-probabilities differ by at most "
          f"{result['first_logprob_max_diff']:.4f}", flush=True)
    return result


def compare_greedy(a: list[list[int]], a_logprobs: list[Any], b: list[list[int]],
                   b_logprobs: list[Any]) -> dict[str, Any]:
    """Two greedy runs of the same prompts, with their top-5 log-probabilities per token: how
    many outputs are identical; at each output's first differing token, how many runs chose a
    token outside the other's top-5 (bf16 kernels that sum in another order may flip a near
    tie, which the rule allows; a wrong state does not keep to it); and how far apart the two
    runs' log-probabilities of the first token are (same context in both: the prompt)."""
    identical, failures, first_diff, max_diff = 0, 0, [], 0.0
    for x, xl, y, yl in zip(a, a_logprobs, b, b_logprobs, strict=True):
        common = set(xl[0]) & set(yl[0])
        max_diff = max([max_diff] + [abs(xl[0][t] - yl[0][t]) for t in common])
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
        if k is None:
            identical += 1
            continue
        first_diff.append(k)
        failures += x[k] not in yl[k] or y[k] not in xl[k]
    return {"identical_requests": identical, "top5_failures": failures, "first_difference_at": first_diff,
            "first_logprob_max_diff": max_diff}


def mtp(args: argparse.Namespace, device: str) -> dict[str, Any]:
    """Decode-step cost of the MTP head (module doc)."""
    from minivllm import SamplingParams

    small = SMOKE_HYBRID if args.smoke else {}
    path = write_random_config(f"/tmp/{args.shapes}{'-smoke' if args.smoke else ''}-mtp-config", args.shapes,
                               mtp_num_hidden_layers=1, **small)
    args = argparse.Namespace(**{**vars(args), "load_format": "dummy"})  # no checkpoint has the head
    plen, new = (8, 6) if args.smoke else (128, 64)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    rng = np.random.default_rng([args.seed, 55])
    batches = [int(b) for b in args.mtp_batches.split(",")]
    prompts = {b: [rng.integers(0, _id_limit(args), plen).tolist() for _ in range(b)] for b in batches}
    rows: dict[str, dict[int, float]] = {}

    def ms_per_step(llm: Any, b: int) -> float:
        llm.generate(prompts[b], params, use_tqdm=False)  # the same run once first: kernels compiled, graphs used
        steps0 = llm.engine.stats.num_steps
        t0 = time.perf_counter()
        llm.generate(prompts[b], params, use_tqdm=False)
        return (time.perf_counter() - t0) / (llm.engine.stats.num_steps - steps0) * 1e3

    plain = build_llm(args, path, device)
    rows["no head"] = {b: ms_per_step(plain, b) for b in batches}
    plain.close()
    del plain
    llm = build_llm(args, path, device, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    llm.engine.max_spec_backoff = 0
    proposer = llm.engine.proposer
    llm.engine.proposer = None
    rows["head keeps up, no drafts"] = {b: ms_per_step(llm, b) for b in batches}
    llm.engine.proposer = proposer
    for k in (1, 2, 3):
        proposer.num_speculative_tokens = k
        rows[f"k={k}"] = {b: ms_per_step(llm, b) for b in batches}
    drafted = llm.engine.stats.num_draft_tokens
    llm.close()
    del llm
    base = rows["no head"]
    for name, row in rows.items():
        print(f"mtp [{args.shapes}] {name}: " + ", ".join(f"batch {b} {ms:.2f} ms/step (x{ms / base[b]:.2f})"
                                                         for b, ms in row.items()), flush=True)
    return {"ms_per_step": {name: {str(b): ms for b, ms in row.items()} for name, row in rows.items()},
            "draft_tokens": drafted, "prompt_tokens": plen, "new_tokens": new}


def _id_limit(args: argparse.Namespace) -> int:
    return SMOKE_HYBRID["vocab_size"] if args.smoke else 10000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", choices=SHAPES_NAMES, default=SHAPES_NAMES[0])
    ap.add_argument("--parts", default=None, help="comma list of " + ",".join(PARTS) +
                    " (default: all for qwen3.5-9b, batch1,offline for qwen3.5-35b-a3b)")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--batch1-repeats", type=int, default=3)
    ap.add_argument("--prefix-requests", type=int, default=256)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--mtp-batches", default="1,32", help="batch sizes of the mtp part, comma list")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    args.parts = ([p for p in args.parts.split(",") if p] if args.parts is not None
                  else list(DEFAULT_PARTS[args.shapes]))
    if set(args.parts) - set(PARTS):
        ap.error(f"--parts: expected a comma list of {PARTS}")
    # what build_llm reads
    args.block_size, args.kernels, args.enforce_eager = None, "auto", False
    args.tensor_parallel_size, args.disable_custom_all_reduce = 1, False
    args.load_format = "auto" if args.smoke else "dummy"
    if args.smoke:
        args.num_requests, args.max_num_seqs, args.batch1_repeats = min(args.num_requests, 6), 4, 1
        args.mtp_batches = "2"
    return args


def summary_name(shapes: str, parts: list[str]) -> str:
    """``hybrid_qwen3_5_9b`` for the shapes' default parts, else the parts run follow
    (``hybrid_qwen3_5_9b_prefix``): a run of some parts keeps the summary of the others."""
    name = "hybrid_" + shapes.replace(".", "_").replace("-", "_")
    if sorted(parts) != sorted(DEFAULT_PARTS[shapes]):
        name += "".join("_" + p for p in PARTS if p in parts)
    return name


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = bench_device(args)
    if args.smoke:
        from minivllm.testing import write_random_checkpoint
        path = write_random_checkpoint(f"/tmp/minivllm-smoke-{args.shapes}", args.shapes, dtype="float32",
                                       **SMOKE_HYBRID, **({"num_experts": 4, "num_experts_per_tok": 2,
                                                           "moe_intermediate_size": 32,
                                                           "shared_expert_intermediate_size": 32}
                                                          if "a3b" in args.shapes else {}))
    else:
        path = write_random_config(f"/tmp/{args.shapes}-config", args.shapes)
    c = ModelConfig.from_hf_json(path)
    results: dict[str, Any] = {"shapes": args.shapes, "args": vars(args)}
    gbs = copy_bandwidth_gbs(device, 1 << 30 if device == "cuda" else 1 << 20)
    results["copy_gbs"] = gbs
    name = summary_name(args.shapes, args.parts)
    if {"batch1", "offline"} & set(args.parts):
        llm = build_llm(args, path, device)
        dtype = llm.engine.executor.dtype
        results["bytes"] = dict(step_weights_batch1=step_weight_bytes(c, 1, dtype.itemsize),
                                state_per_seq_step=state_traffic_bytes(c, dtype),
                                kv_per_token=kv_token_bytes(c, dtype.itemsize))
        print(f"[{args.shapes}] batch-1 step weights {results['bytes']['step_weights_batch1'] / 1e9:.2f} GB, "
              f"state {results['bytes']['state_per_seq_step'] / 1e6:.1f} MB a sequence a step; "
              f"copy {gbs:.0f} GB/s", flush=True)
        if "batch1" in args.parts:
            results["batch1"] = batch1(llm, args, c, dtype, gbs)
            write_summary(name, results)
        if "offline" in args.parts:
            results["offline"] = offline(llm, args, c, dtype, gbs)
            write_summary(name, results)
        llm.close()
        del llm
    if "prefix" in args.parts:
        results["prefix"] = prefix(args, path, device, c)
        write_summary(name, results)
    if "mtp" in args.parts:
        results["mtp"] = mtp(args, device)
    write_summary(name, results)


if __name__ == "__main__":
    main()
