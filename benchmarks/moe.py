"""Qwen3-30B-A3B (Qwen3-MoE, random bf16 weights filled on the device: no checkpoint) against
its memory-bandwidth floors: batch-1 decode, offline throughput, and the routed experts of one
layer alone.

    PYTHONPATH=. python3 -m benchmarks.moe [--num-requests 256,1024] [--batch1-repeats 3]
        [--kernel-tokens 1,16,64,256] [--kernels auto|triton|torch] [--smoke]

Every floor is bytes that must be read over the copy bandwidth measured in the run
(``benchmarks.gpu_timing``). A step of B tokens reads the dense weights (attention, norms,
router, B embedding rows, LM head), in each sparse layer the distinct experts its tokens
select (3 H I weights each), and the K/V of every sequence's context. At batch B the
expected number of distinct experts of a layer is ``E (1 - (1 - k / E)^B)`` (E = 128
experts, k = 8 per token; exactly k at B = 1).

- batch-1: greedy, 128-token prompt, 256 new tokens, ms/token = wall / 256 (prefill
  included), median of ``--batch1-repeats``. Floor: one step at B = 1 at the mean context
  of its decode steps (128 + 256 / 2). Goal <= 2.0 ms/token.
- offline: ``benchmarks.throughput``'s offline-N workload (N in ``--num-requests``), tok/s
  beside the floor's tok/s: the N_tok completion tokens in full steps of B = min(max_num_seqs,
  N) rows (a smaller step reads more weight per token), and token j of request i (prompt p_i,
  m_i new) reading the K/V of p_i + j positions:
  floor_s = (N_tok / B * weights(B) + sum_i sum_{j < m_i} (p_i + j) kv_token) / bw.
  Goal >= 0.70 of the floor's tok/s.
- kernel: one layer's ``Ops.moe`` (router GEMM, ``moe_topk``, then ``moe_gemv`` at a few
  tokens or ``moe_align`` + ``fused_moe``) at ``--kernel-tokens`` tokens on random inputs, timed in a CUDA graph (cycling over two
  copies of the weights, other tokens per call), in GB/s of the selected experts' weights
  against the copy bandwidth and against the torch loop over experts (``moe_reference``,
  timed eagerly: it routes on the host). Checked first: the routing against a softmax top-k,
  the experts against ``fused_moe_reference`` on that routing (bf16 tolerance). Up to 16
  tokens both Triton expert paths are also timed, each forced, to place the switch between them.

Summary: ``$OUT/moe.json``, rewritten after each part. ``--smoke``: a tiny MoE on the CPU,
kernels="torch", nothing timed in the kernel part (its check runs; under
``TRITON_INTERPRET=1`` on the Triton kernels): every code path, no meaningful number.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks.gpu_timing import copy_bandwidth_gbs, graph_us
from benchmarks.long_context import kv_bytes_per_token
from benchmarks.qwen3_shapes import SMOKE_MOE_SHAPES, SMOKE_SHAPES, write_random_config
from benchmarks.report import write_summary
from benchmarks.throughput import (Workload, bench_device, build_llm, median_run, met, offline_workload,
                                   run_batch1, run_offline, sync)
from minivllm.config import ModelConfig

SHAPES_NAME = "qwen3-30b-a3b"
GOAL_MS_TOKEN = 2.0
GOAL_FLOOR_FRACTION = 0.70
BATCH1_PROMPT, BATCH1_NEW = 128, 256   # run_batch1's (smoke: 8 and 8)
WEIGHT_COPIES, GRAPH_CALLS = 2, 4      # kernel part: 1.2 GB of experts a copy, far beyond L2
TOL_BF16, TOL_FP32 = 1.6e-2, 1e-4      # as the kernel tests
PATHS_MAX_TOKENS = 16                  # both expert paths timed, forced, up to this many tokens


# ---- bytes -------------------------------------------------------------------------

def expected_distinct_experts(c: ModelConfig, batch: float) -> float:
    """E (1 - (1 - k / E)^B): the expected distinct experts of B tokens routed uniformly."""
    e, k = c.num_experts, c.num_experts_per_tok
    return e * (1 - (1 - k / e) ** batch)


def expert_bytes(c: ModelConfig, dtype_bytes: int) -> int:
    """One expert of one layer: gate, up and down, H x I each."""
    return 3 * c.hidden_size * c.moe_intermediate_size * dtype_bytes


def sparse_layers(c: ModelConfig) -> int:
    return sum(c.is_sparse_layer(i) for i in range(c.num_hidden_layers))


def dense_bytes(c: ModelConfig, batch: int, dtype_bytes: int) -> int:
    """What a step of ``batch`` tokens reads besides experts and K/V: every layer's attention
    and norms, the routers, dense MLPs, the final norm, the LM head, and ``batch`` embedding
    rows (part of the LM head when they are tied)."""
    h, d = c.hidden_size, c.head_dim
    attention = h * (c.num_attention_heads + 2 * c.num_key_value_heads) * d + c.num_attention_heads * d * h
    norms = 2 * h + 2 * d                                  # input/post-attention, q/k
    layers = c.num_hidden_layers * (attention + norms)
    layers += sparse_layers(c) * c.num_experts * h         # routers
    layers += (c.num_hidden_layers - sparse_layers(c)) * 3 * h * c.intermediate_size
    embedding_rows = 0 if c.tie_word_embeddings else batch * h
    return (layers + h + c.vocab_size * h + embedding_rows) * dtype_bytes


def step_weight_bytes(c: ModelConfig, batch: int, dtype_bytes: int) -> float:
    """Weights a step of ``batch`` tokens reads: dense ones plus the expected distinct experts."""
    experts = sparse_layers(c) * expected_distinct_experts(c, batch) * expert_bytes(c, dtype_bytes)
    return dense_bytes(c, batch, dtype_bytes) + experts


KV_SCALE_BYTES = 2 * 4  # a layer's K and V cache scales, float32 (read by an FP8 cache only)


def all_weight_bytes(c: ModelConfig, dtype_bytes: int) -> int:
    """Every parameter of the model (the whole embedding table once, every expert, the KV
    cache scales)."""
    embedding = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size * dtype_bytes
    experts = sparse_layers(c) * c.num_experts * expert_bytes(c, dtype_bytes)
    return dense_bytes(c, 0, dtype_bytes) + experts + embedding + c.num_hidden_layers * KV_SCALE_BYTES


def workload_kv_bytes(wl: Workload, kv_token: int) -> int:
    """K/V read by every decoded token: token j of request i attends over p_i + j positions."""
    return sum(m * p + m * (m - 1) // 2 for p, m in zip(wl.prompt_lens, wl.max_tokens)) * kv_token


# ---- engine runs ---------------------------------------------------------------------

def model_dir(args: argparse.Namespace) -> str:
    """The config.json of Qwen3-30B-A3B (``--smoke``: a tiny float32 MoE), written once."""
    if args.smoke:
        return write_random_config(args.model_dir or f"/tmp/minivllm-smoke-{SHAPES_NAME}-config", SHAPES_NAME,
                                   dtype="float32", **SMOKE_SHAPES, **SMOKE_MOE_SHAPES)
    return write_random_config(args.model_dir or f"/tmp/{SHAPES_NAME}-config", SHAPES_NAME)


def batch1(llm: Any, args: argparse.Namespace, c: ModelConfig, dtype_bytes: int, gbs: float,
           id_limit: int) -> dict[str, Any]:
    """The median batch-1 run beside its floor (module doc)."""
    runs = [run_batch1(llm, 100 + 10 * r, SHAPES_NAME, args.smoke, id_limit) for r in range(args.batch1_repeats)]
    r = median_run(runs, SHAPES_NAME)
    plen, new = (8, 8) if args.smoke else (BATCH1_PROMPT, BATCH1_NEW)
    context = plen + new // 2
    step = step_weight_bytes(c, 1, dtype_bytes) + context * kv_bytes_per_token(c, dtype_bytes)
    r.update(context=context, step_bytes=step, floor_ms=step / (gbs * 1e9) * 1e3, goal_ms=GOAL_MS_TOKEN)
    r["floor_fraction"] = r["floor_ms"] / r["ms_per_token"]
    r["met"] = r["ms_per_token"] <= GOAL_MS_TOKEN
    return r


def offline(llm: Any, args: argparse.Namespace, c: ModelConfig, dtype_bytes: int, gbs: float,
            wl: Workload, stream: int) -> dict[str, Any]:
    """The offline workload ``wl`` beside its floor (module doc)."""
    n = len(wl.prompt_lens)
    r = run_offline(llm, wl, stream=stream, label=SHAPES_NAME)
    batch = min(args.max_num_seqs, n)
    tokens = sum(wl.max_tokens)
    weights = tokens / batch * step_weight_bytes(c, batch, dtype_bytes)
    kv = workload_kv_bytes(wl, kv_bytes_per_token(c, dtype_bytes))
    floor_s = (weights + kv) / (gbs * 1e9)
    r.update(workload=f"offline-{n}", requests=n, tokens_per_step=r["completion_tokens"] / max(1, r["steps"]),
             floor_batch=batch, distinct_experts=expected_distinct_experts(c, batch), weight_bytes=weights,
             kv_bytes=kv, floor_tok_s=tokens / floor_s, goal_fraction=GOAL_FLOOR_FRACTION)
    r["floor_fraction"] = r["tok_s"] / r["floor_tok_s"]
    r["met"] = r["floor_fraction"] >= GOAL_FLOOR_FRACTION
    return r


def engine_part(args: argparse.Namespace, path: str, device: str, c: ModelConfig, gbs: float,
                results: dict[str, Any]) -> None:
    """Batch-1, then each offline workload, into ``results`` (the summary rewritten after each)."""
    llm = build_llm(args, path, device)
    params = list(llm.engine.executor.model.parameters())
    dtype_bytes = params[0].element_size()
    results["bytes"] = dict(dtype_bytes=dtype_bytes, dense_batch1=dense_bytes(c, 1, dtype_bytes),
                            expert=expert_bytes(c, dtype_bytes), kv_per_token=kv_bytes_per_token(c, dtype_bytes),
                            all_weights=all_weight_bytes(c, dtype_bytes),
                            parameters=sum(p.numel() * p.element_size() for p in params))
    print(f"weights {results['bytes']['all_weights'] / 1e9:.3f} GB by the formula, the executor's parameters "
          f"{results['bytes']['parameters'] / 1e9:.3f} GB; KV pool {llm.engine.num_blocks} blocks", flush=True)
    workloads = [offline_workload(n, args.seed, args.smoke) for n in args.num_requests]
    results["batch1"] = batch1(llm, args, c, dtype_bytes, gbs, workloads[0].id_limit)
    print_batch1(results["batch1"])
    write_summary("moe", results)
    results["offline"] = []
    for i, wl in enumerate(workloads):
        results["offline"].append(offline(llm, args, c, dtype_bytes, gbs, wl, stream=1 + i))
        print_offline(results["offline"][-1])
        write_summary("moe", results)
    llm.close()


def print_batch1(r: dict[str, Any]) -> None:
    print(f"batch-1: {r['ms_per_token']:.3f} ms/token (floor {r['floor_ms']:.3f} ms at context {r['context']}: "
          f"{r['floor_fraction']:.2f} of the floor's speed; goal <= {r['goal_ms']} ms/token) "
          f"{met(r['ms_per_token'], r['goal_ms'], lower_is_better=True)}", flush=True)


def print_offline(r: dict[str, Any]) -> None:
    print(f"{r['workload']}: {r['tok_s']:,.0f} tok/s (floor {r['floor_tok_s']:,.0f} tok/s at batch "
          f"{r['floor_batch']}, {r['distinct_experts']:.1f} distinct experts a layer: "
          f"{r['floor_fraction']:.2f} of it; goal >= {r['goal_fraction']:.2f}) "
          f"{met(r['floor_fraction'], r['goal_fraction'])}", flush=True)


# ---- the experts alone ---------------------------------------------------------------

@dataclass(frozen=True)
class KernelInputs:
    """One layer's random router and experts (``copies`` of them) and one x per call."""

    xs: list[torch.Tensor]        # (T, H) each
    router: torch.Tensor          # (E, H)
    w13s: list[torch.Tensor]      # (E, 2I, H) each
    w2s: list[torch.Tensor]       # (E, H, I) each


def kernel_inputs(c: ModelConfig, tokens: int, calls: int, copies: int, device: str, dtype: torch.dtype,
                  seed: int) -> KernelInputs:
    """Weights scaled so that activations stay O(1); the router as the dummy loader fills it."""
    g = torch.Generator(device=device).manual_seed(seed)
    e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)

    return KernelInputs(xs=[randn(tokens, h) for _ in range(calls)], router=randn(e, h, scale=0.02),
                        w13s=[randn(e, 2 * i, h, scale=h ** -0.5) for _ in range(copies)],
                        w2s=[randn(e, h, i, scale=i ** -0.5) for _ in range(copies)])


def check_experts(ops: Any, c: ModelConfig, inp: KernelInputs, call: int) -> tuple[int, float]:
    """(distinct experts, max error) of ``ops.moe`` on call ``call``'s inputs.

    Raises:
        AssertionError: the routing is not a top-k of the softmax, or the experts' output
            is off ``fused_moe_reference`` on that routing by more than the tolerance.
    """
    from minivllm.kernels.reference import fused_moe_reference, moe_topk_reference

    x, w13, w2 = inp.xs[call], inp.w13s[call % len(inp.w13s)], inp.w2s[call % len(inp.w2s)]
    k, norm = c.num_experts_per_tok, c.norm_topk_prob
    out = ops.moe(x, inp.router, w13, w2, k, norm)
    logits = F.linear(x, inp.router).float()
    if ops.triton:
        from minivllm.kernels.moe_topk import moe_topk
        weights, ids = moe_topk(logits, k, norm)  # what ops.moe routed by (deterministic)
    else:
        weights, ids = moe_topk_reference(logits, k, norm)
    probs = torch.softmax(logits, dim=-1)
    chosen = probs.gather(1, ids.long())
    # Ties make the ids ambiguous, not the values: the chosen ones must be the k largest.
    top = torch.topk(probs, k, dim=-1).values
    if not torch.allclose(chosen.sort(dim=-1, descending=True).values, top, rtol=1e-5, atol=1e-7):
        raise AssertionError("the routed experts are not the top-k of the router's softmax")
    expect = chosen / chosen.sum(dim=-1, keepdim=True) if norm else chosen
    if not torch.allclose(weights, expect, rtol=1e-4, atol=1e-6):
        raise AssertionError("the routing weights are not the chosen experts' probabilities")
    ref = fused_moe_reference(x, w13, w2, weights, ids).float()
    err = (out.float() - ref).abs().max().item()
    tol = (TOL_FP32 if x.dtype == torch.float32 else TOL_BF16) * max(1.0, ref.abs().max().item())
    if not err <= tol:
        raise AssertionError(f"experts: max error {err:.3g} > {tol:.3g}")
    return int(torch.unique(ids).numel()), err


def eager_us(call: Callable[[int], Any], calls: int, device: str, repeats: int = 5) -> float:
    """Median wall us per call of ``call(0) .. call(calls - 1)`` run eagerly, after a warm-up."""
    times = []
    for r in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        for i in range(calls):
            call(i)
        sync(device)
        if r:
            times.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(times)


def kernel_row(ops: Any, c: ModelConfig, tokens: int, device: str, dtype: torch.dtype, gbs: float,
               timed: bool, copies: int = WEIGHT_COPIES, calls: int = GRAPH_CALLS) -> dict[str, Any]:
    """Checked, then (``timed``) the graph time of ``ops.moe`` and the eager torch loop's."""
    from minivllm.layers.moe import moe_reference

    inp = kernel_inputs(c, tokens, calls, copies, device, dtype, seed=tokens)
    checks = [check_experts(ops, c, inp, i) for i in range(calls)]
    distinct = statistics.mean(d for d, _ in checks)
    nbytes = distinct * expert_bytes(c, dtype.itemsize)
    row: dict[str, Any] = dict(tokens=tokens, distinct_experts=distinct,
                               expected_distinct=expected_distinct_experts(c, tokens),
                               expert_bytes=nbytes, floor_us=nbytes / (gbs * 1e3),
                               max_err=max(e for _, e in checks))
    if timed:
        def operands(i: int) -> tuple[Any, ...]:
            return (inp.xs[i], inp.router, inp.w13s[i % copies], inp.w2s[i % copies], c.num_experts_per_tok,
                    c.norm_topk_prob)

        us = graph_us(lambda i: ops.moe(*operands(i)), calls)
        torch_us = eager_us(lambda i: moe_reference(*operands(i)), calls, device)
        row.update(graph_us=us, GBs=nbytes / us / 1e3, pct_copy=100 * nbytes / us / 1e3 / gbs,
                   torch_us=torch_us, speedup=torch_us / us)
        if ops.triton and tokens <= PATHS_MAX_TOKENS:
            row["paths_us"] = {name: graph_us(lambda i, f=f: f(*operands(i)), calls)
                               for name, f in forced_paths().items()}
    return row


def forced_paths() -> dict[str, Callable[..., torch.Tensor]]:
    """The two Triton expert paths ``Ops.moe`` chooses between by token count
    (``MOE_GEMV_MAX_TOKENS``), each forced, with the same routing kernels before them."""
    from minivllm.kernels.fused_moe import fused_moe
    from minivllm.kernels.moe_align import moe_align
    from minivllm.kernels.moe_gemv import moe_gemv
    from minivllm.kernels.moe_topk import moe_topk

    def grouped(x, router, w13, w2, k, norm):
        weights, ids = moe_topk(F.linear(x, router).float(), k, norm)
        return fused_moe(x, w13, w2, weights, moe_align(ids, w13.shape[0]))

    def per_pair(x, router, w13, w2, k, norm):
        weights, ids = moe_topk(F.linear(x, router).float(), k, norm)
        return moe_gemv(x, w13, w2, weights, ids)

    return {"grouped GEMM": grouped, "per-pair GEMV": per_pair}


def print_kernel_row(r: dict[str, Any], gbs: float) -> None:
    head = (f"experts at {r['tokens']:>4} tokens: {r['distinct_experts']:5.1f} distinct (expected "
            f"{r['expected_distinct']:5.1f}), {r['expert_bytes'] / 1e6:7.1f} MB, floor {r['floor_us']:7.1f} us, "
            f"max error {r['max_err']:.2e}")
    if "graph_us" not in r:
        print(head + " (untimed)", flush=True)
        return
    print(f"{head}; graph {r['graph_us']:7.1f} us = {r['GBs']:6,.0f} GB/s = {r['pct_copy']:4.1f}% of copy "
          f"{gbs:,.0f} GB/s; torch loop {r['torch_us']:8.1f} us (x{r['speedup']:.1f})", flush=True)
    for name, us in r.get("paths_us", {}).items():
        print(f"    {name:>14} forced: graph {us:7.1f} us = {100 * r['expert_bytes'] / us / 1e3 / gbs:4.1f}% of copy",
              flush=True)


def kernel_part(args: argparse.Namespace, device: str, c: ModelConfig, gbs: float) -> list[dict[str, Any]]:
    """One row per ``--kernel-tokens`` (module doc); on the CPU under the torch reference or,
    with Triton's interpreter, the Triton kernels, checked but untimed."""
    from minivllm.envs import triton_interpreted
    from minivllm.layers.ops import Ops

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    kernels = "triton" if device == "cuda" or triton_interpreted() else "torch"
    ops = Ops.build(kernels, torch.device(device), dtype)
    print(f"experts of one layer: {c.num_experts} x (2 x {c.moe_intermediate_size}) x {c.hidden_size}, "
          f"top-{c.num_experts_per_tok}, {dtype}, kernels {kernels}", flush=True)
    rows = []
    for tokens in args.kernel_tokens:
        rows.append(kernel_row(ops, c, tokens, device, dtype, gbs, timed=device == "cuda",
                               copies=WEIGHT_COPIES if device == "cuda" else 1,
                               calls=GRAPH_CALLS if device == "cuda" else 1))
        print_kernel_row(rows[-1], gbs)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()  # the engine sizes its KV pool from the memory left free
    return rows


# ---- main ------------------------------------------------------------------------------

def int_list(text: str) -> list[int]:
    """"256,1024" -> [256, 1024]; each a positive int."""
    values = [int(v) for v in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive ints, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int_list, default=[256, 1024], help="offline workloads, a comma list")
    ap.add_argument("--batch1-repeats", type=int, default=3)
    ap.add_argument("--kernel-tokens", type=int_list, default=[1, 16, 64, 256])
    ap.add_argument("--kernels", choices=("auto", "triton", "torch"), default="auto",
                    help="the engine's fused ops (ExecutorConfig.kernels); --smoke: torch")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--model-dir", default=None, help="where config.json is written once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny MoE on the CPU: checks the code paths only")
    args = ap.parse_args(argv)
    # What build_llm reads and this benchmark fixes: one GPU, weights filled on the device.
    args.tensor_parallel_size, args.disable_custom_all_reduce, args.load_format = 1, False, "dummy"
    if args.smoke:
        args.kernels, args.max_num_seqs = "torch", min(args.max_num_seqs, 4)
        args.num_requests = [max(2, n // 64) for n in args.num_requests]
        args.kernel_tokens = sorted({min(t, 4) for t in args.kernel_tokens})
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = bench_device(args)
    path = model_dir(args)
    c = ModelConfig.from_hf_json(path)
    gbs = copy_bandwidth_gbs(device, (1 << 30) if device == "cuda" else (1 << 24))
    print(f"{SHAPES_NAME}{' (smoke: tiny)' if args.smoke else ''} on {device}: copy bandwidth {gbs:,.0f} GB/s",
          flush=True)
    results: dict[str, Any] = {"args": vars(args), "shapes": SHAPES_NAME, "copy_gbs": gbs}
    results["kernel"] = kernel_part(args, device, c, gbs)
    write_summary("moe", results)
    engine_part(args, path, device, c, gbs, results)


if __name__ == "__main__":
    main()
