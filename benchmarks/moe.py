"""Qwen3-30B-A3B (Qwen3-MoE, random weights filled on the device: no checkpoint) against its
memory-bandwidth floors: batch-1 decode, offline throughput, and the routed experts of one
layer alone; in bf16, or (``--weights fp8``) in Qwen3-30B-A3B-FP8's format.

    PYTHONPATH=. python3 -m benchmarks.moe [--weights bf16|fp8] [--kv-cache-dtype auto|fp8]
        [--num-requests 256,1024] [--batch1-repeats 3] [--kernel-tokens 1,16,64,256]
        [--kernels auto|triton|torch] [--sweep] [--parts kernel,batch1,profile,offline] [--smoke]

``--weights fp8``: the config gains Qwen's FP8 ``quantization_config`` (a copy beside the
bf16 one, ``<model-dir>-fp8``, as ``benchmarks.fp8`` writes it): the decoder's linear layers
and experts in e4m3 with float32 128x128 block scales, the embedding, LM head, norms and
routers in bf16. ``--kv-cache-dtype fp8``: an e4m3 KV cache.

Every floor is bytes that must be read over the copy bandwidth measured in the run
(``benchmarks.gpu_timing``). A step of B tokens reads the dense weights (attention, norms,
router, B embedding rows, LM head), in each sparse layer the distinct experts its tokens
select (gate, up and down, H x I each), and the K/V of every sequence's context. A weight
counts the bytes it is stored in (``WeightFormat``): 2 a value in bf16; 1 a value in e4m3
plus 4 per 128 x 128 block (its scale); K/V at the cache's dtype. At batch B the expected
number of distinct experts of a layer is ``E (1 - (1 - k / E)^B)`` (E = 128 experts, k = 8
per token; exactly k at B = 1).

- batch-1: greedy, 128-token prompt, 256 new tokens, ms/token = wall / 256 (prefill
  included), median of ``--batch1-repeats``. Floor: one step at B = 1 at the mean context
  of its decode steps (128 + 256 / 2). Goal (``GOALS_MS_TOKEN``) <= 2.0 ms/token in bf16,
  <= 1.2 in FP8.
- offline: ``benchmarks.throughput``'s offline-N workload (N in ``--num-requests``), tok/s
  beside the floor's tok/s: the N_tok completion tokens in the fewest steps a schedule can
  have (``decode_batches``: each request one token a step, max_num_seqs at a time, first come
  first served), step s of B_s tokens reading weights(B_s), and token j of request i (prompt
  p_i, m_i new) reading the K/V of p_i + j positions:
  floor_s = (sum_s weights(B_s) + sum_i sum_{j < m_i} (p_i + j) kv_token) / bw.
  Requests of different lengths end the run in steps of fewer tokens, each of which still
  reads nearly every expert, so full steps of max_num_seqs tokens would be a floor no
  schedule reaches (docs/tuning.md, "Experts at few tokens"). Goal >= 0.70 of the floor's
  tok/s.
- kernel: one layer's ``Ops.moe`` (router GEMM, ``moe_topk``, then ``moe_gemv`` at a few
  tokens or ``moe_align`` + ``fused_moe``) at ``--kernel-tokens`` tokens on random inputs,
  timed in a CUDA graph (cycling over two copies of the weights, other tokens per call), in
  GB/s of the selected experts' weights against the copy bandwidth and against the torch
  loop over experts (``Ops.moe`` on the torch references, timed eagerly: it routes on the
  host). FP8: each expert quantized by ``quantize_fp8_block``, x in bf16. Checked first: the
  routing against a softmax top-k, the experts against the reference of the path taken
  (``fused_moe_reference``; FP8: ``moe_gemv_fp8_reference`` up to ``MOE_GEMV_MAX_TOKENS``
  tokens, else ``fused_moe_fp8_reference``) on that routing. Up to 16 tokens both Triton
  expert paths are also timed, each forced, to place the switch between them; ``--sweep``:
  and the per-pair GEMV with each stage's tiles of ``GEMV_SWEEP`` (the other at its default),
  and above ``MOE_GEMV_MAX_TOKENS`` tokens the grouped GEMM with each tiling of
  ``GROUPED_SWEEP`` (a prefill gives each expert hundreds of rows: ``--kernel-tokens 16384``).
  On a GPU the engine part also profiles decode steps kernel by kernel at batch 1 and at
  ``--max-num-seqs`` (``benchmarks.throughput.profile_decode``), and a prefill of 16 x 1,024
  tokens (``profile_prefill``): an offline run's prompts cost that many us a 1,000 tokens.

``--parts`` (default all of ``PARTS``): kernel, batch1, profile, offline; the engine is built
only for a part other than kernel.

Summary: ``$OUT/moe.json`` (``summary_name``: ``moe_fp8`` for FP8 weights, ``_kv_fp8`` added
for an FP8 KV cache), rewritten after each part. ``--smoke``: a tiny MoE on the CPU (FP8:
with every layer part on a 128 edge), kernels="torch", nothing timed in the kernel part (its
check runs; under ``TRITON_INTERPRET=1`` on the Triton kernels): every code path, no
meaningful number.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from benchmarks.fp8 import SMOKE_FP8_SHAPES, variant_path
from benchmarks.gpu_timing import copy_bandwidth_gbs, graph_us
from benchmarks.long_context import kv_bytes_per_token
from benchmarks.report import write_summary
from benchmarks.throughput import (Workload, bench_device, build_llm, median_run, met, offline_workload,
                                   profile_decode, profile_prefill, run_batch1, run_offline, sync)
from minivllm.config import FP8_WEIGHT_BLOCK, KERNEL_CHOICES, ModelConfig, cdiv
from minivllm.testing import SMOKE_MOE_SHAPES, SMOKE_SHAPES, write_random_config

if TYPE_CHECKING:
    from minivllm.ops.dispatch import ExpertScales

SHAPES_NAME = "qwen3-30b-a3b"
WEIGHTS = ("bf16", "fp8")
GOALS_MS_TOKEN = {"bf16": 2.0, "fp8": 1.2}
GOAL_FLOOR_FRACTION = 0.70
BATCH1_PROMPT, BATCH1_NEW = 128, 256   # run_batch1's (smoke: 8 and 8)
WEIGHT_COPIES, GRAPH_CALLS = 2, 4      # kernel part: 1.2 GB of experts a copy (FP8: 0.6), far beyond L2
TOL_BF16, TOL_FP32 = 1.6e-2, 1e-4      # as the kernel tests
# e4m3 experts against their references, as tests/kernels/test_moe_fp8.py bounds bf16 (the
# interpreter truncates bf16 casts; an act value may land on the neighbouring e4m3 value).
TOL_FP8 = 5e-2
PARTS = ("kernel", "batch1", "profile", "offline")
PATHS_MAX_TOKENS = 16                  # both expert paths timed, forced, up to this many tokens
FP8_SCALE_BYTES = 4                    # a float32 scale per 128 x 128 block of an e4m3 weight
KV_SCALE_BYTES = 2 * 4                 # a layer's K and V cache scales, float32 (read by an FP8 cache only)
# The tiny FP8 MoE of --smoke: every packed part, rank and expert matrix on a 128 edge.
SMOKE_FP8_MOE_SHAPES = {**SMOKE_FP8_SHAPES, **SMOKE_MOE_SHAPES, "moe_intermediate_size": 128}


# ---- bytes -------------------------------------------------------------------------

@dataclass(frozen=True)
class WeightFormat:
    """The bytes the model's weights are stored in: ``dtype_bytes`` a value of a weight in the
    model's dtype; with ``fp8`` the decoder's linear layers and experts in e4m3 (1 byte a value)
    with a float32 scale per 128 x 128 block (Qwen3-FP8's format), the embedding, LM head,
    norms and routers still in the model's dtype."""

    dtype_bytes: int
    fp8: bool = False

    def linear(self, n: int, k: int) -> int:
        """A decoder linear layer's (n, k) weight, with its block scales in FP8 (a packed layer
        counted whole: the engine scales it so, each part starting on a 128 edge)."""
        if not self.fp8:
            return n * k * self.dtype_bytes
        rows, cols = FP8_WEIGHT_BLOCK
        return n * k + cdiv(n, rows) * cdiv(k, cols) * FP8_SCALE_BYTES


def expected_distinct_experts(c: ModelConfig, batch: float) -> float:
    """E (1 - (1 - k / E)^B): the expected distinct experts of B tokens routed uniformly."""
    e, k = c.num_experts, c.num_experts_per_tok
    return e * (1 - (1 - k / e) ** batch)


def expert_bytes(c: ModelConfig, fmt: WeightFormat) -> int:
    """One expert of one layer: gate and up (2I, H) as the engine stacks them, down (H, I)."""
    h, i = c.hidden_size, c.moe_intermediate_size
    return fmt.linear(2 * i, h) + fmt.linear(h, i)


def expert_flops(c: ModelConfig, tokens: int) -> int:
    """Multiply-adds x 2 of one layer's experts for ``tokens`` tokens: each of the k chosen
    experts' gate, up and down projections."""
    return tokens * c.num_experts_per_tok * 3 * 2 * c.hidden_size * c.moe_intermediate_size


def sparse_layers(c: ModelConfig) -> int:
    return sum(c.is_sparse_layer(i) for i in range(c.num_hidden_layers))


def dense_bytes(c: ModelConfig, batch: int, fmt: WeightFormat) -> int:
    """What a step of ``batch`` tokens reads besides experts and K/V: every layer's attention
    and norms, the routers, dense MLPs, the final norm, the LM head, and ``batch`` embedding
    rows (part of the LM head when they are tied)."""
    h, d = c.hidden_size, c.head_dim
    attention = fmt.linear((c.num_attention_heads + 2 * c.num_key_value_heads) * d, h)
    attention += fmt.linear(h, c.num_attention_heads * d)
    mlp = fmt.linear(2 * c.intermediate_size, h) + fmt.linear(h, c.intermediate_size)
    linear = c.num_hidden_layers * attention + (c.num_hidden_layers - sparse_layers(c)) * mlp
    norms = c.num_hidden_layers * (2 * h + 2 * d) + h            # input/post-attention, q/k; the final one
    routers = sparse_layers(c) * c.num_experts * h
    embedding_rows = 0 if c.tie_word_embeddings else batch * h
    return linear + (norms + routers + c.vocab_size * h + embedding_rows) * fmt.dtype_bytes


def step_weight_bytes(c: ModelConfig, batch: int, fmt: WeightFormat) -> float:
    """Weights a step of ``batch`` tokens reads: dense ones plus the expected distinct experts."""
    experts = sparse_layers(c) * expected_distinct_experts(c, batch) * expert_bytes(c, fmt)
    return dense_bytes(c, batch, fmt) + experts


def all_weight_bytes(c: ModelConfig, fmt: WeightFormat) -> int:
    """Every parameter of the model (the whole embedding table once, every expert, the KV
    cache scales)."""
    embedding = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size * fmt.dtype_bytes
    experts = sparse_layers(c) * c.num_experts * expert_bytes(c, fmt)
    return dense_bytes(c, 0, fmt) + experts + embedding + c.num_hidden_layers * KV_SCALE_BYTES


def decode_batches(max_tokens: list[int], max_num_seqs: int) -> list[int]:
    """The tokens of each step when every request makes one token a step from its admission
    and at most ``max_num_seqs`` run at once, admitted first come first served (prefill
    chunks aside: the schedule with the fewest steps). A step cannot hold more tokens than
    requests still running, so a workload whose lengths differ ends in smaller steps, each of
    which still reads nearly every expert."""
    remaining, waiting = list(max_tokens), list(range(len(max_tokens)))[::-1]
    running: list[int] = []
    batches = []
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            running.append(waiting.pop())
        batches.append(len(running))
        for i in running:
            remaining[i] -= 1
        running = [i for i in running if remaining[i] > 0]
    return batches


def workload_kv_bytes(wl: Workload, kv_token: int) -> int:
    """K/V read by every decoded token: token j of request i attends over p_i + j positions."""
    return sum(m * p + m * (m - 1) // 2 for p, m in zip(wl.prompt_lens, wl.max_tokens)) * kv_token


# ---- engine runs ---------------------------------------------------------------------

def summary_name(args: argparse.Namespace) -> str:
    """``moe``, ``moe_fp8`` (FP8 weights), each with ``_kv_fp8`` for an FP8 KV cache."""
    return "moe" + ("_fp8" if args.weights == "fp8" else "") + ("_kv_fp8" if args.kv_cache_dtype != "auto" else "")


def model_dir(args: argparse.Namespace) -> str:
    """The config.json of Qwen3-30B-A3B (``--smoke``: a tiny float32 MoE), written once; with
    ``--weights fp8`` its Qwen3-FP8-format copy beside it."""
    if args.smoke:
        shapes = SMOKE_FP8_MOE_SHAPES if args.weights == "fp8" else {**SMOKE_SHAPES, **SMOKE_MOE_SHAPES}
        default = f"/tmp/minivllm-smoke-{SHAPES_NAME}{'-aligned' if args.weights == 'fp8' else ''}-config"
        path = write_random_config(args.model_dir or default, SHAPES_NAME, dtype="float32", **shapes)
    else:
        path = write_random_config(args.model_dir or f"/tmp/{SHAPES_NAME}-config", SHAPES_NAME)
    return variant_path(path, "fp8-weights") if args.weights == "fp8" else path


def batch1(llm: Any, args: argparse.Namespace, c: ModelConfig, fmt: WeightFormat, kv_token: int, gbs: float,
           id_limit: int) -> dict[str, Any]:
    """The median batch-1 run beside its floor (module doc)."""
    runs = [run_batch1(llm, 100 + 10 * r, SHAPES_NAME, args.smoke, id_limit) for r in range(args.batch1_repeats)]
    r = median_run(runs, SHAPES_NAME)
    plen, new = (8, 8) if args.smoke else (BATCH1_PROMPT, BATCH1_NEW)
    context = plen + new // 2
    step = step_weight_bytes(c, 1, fmt) + context * kv_token
    goal = GOALS_MS_TOKEN[args.weights]
    r.update(context=context, step_bytes=step, floor_ms=step / (gbs * 1e9) * 1e3, goal_ms=goal)
    r["floor_fraction"] = r["floor_ms"] / r["ms_per_token"]
    r["met"] = r["ms_per_token"] <= goal
    return r


def offline(llm: Any, args: argparse.Namespace, c: ModelConfig, fmt: WeightFormat, kv_token: int, gbs: float,
            wl: Workload, stream: int) -> dict[str, Any]:
    """The offline workload ``wl`` beside its floor (module doc)."""
    n = len(wl.prompt_lens)
    r = run_offline(llm, wl, stream=stream, label=SHAPES_NAME)
    batches = decode_batches(wl.max_tokens, args.max_num_seqs)
    tokens = sum(wl.max_tokens)
    weights = sum(step_weight_bytes(c, b, fmt) for b in batches)
    kv = workload_kv_bytes(wl, kv_token)
    floor_s = (weights + kv) / (gbs * 1e9)
    r.update(workload=f"offline-{n}", requests=n, tokens_per_step=r["completion_tokens"] / max(1, r["steps"]),
             floor_batch=max(batches), floor_steps=len(batches), floor_tokens_per_step=tokens / len(batches),
             distinct_experts=expected_distinct_experts(c, max(batches)), weight_bytes=weights,
             kv_bytes=kv, floor_tok_s=tokens / floor_s, goal_fraction=GOAL_FLOOR_FRACTION)
    r["floor_fraction"] = r["tok_s"] / r["floor_tok_s"]
    r["met"] = r["floor_fraction"] >= GOAL_FLOOR_FRACTION
    return r


def engine_part(args: argparse.Namespace, path: str, device: str, c: ModelConfig, gbs: float,
                results: dict[str, Any], summary: str) -> None:
    """Batch-1, then each offline workload, into ``results`` (the summary rewritten after each)."""
    llm = build_llm(args, path, device, kv_cache_dtype=args.kv_cache_dtype)
    executor = llm.engine.executor
    params = list(executor.model.parameters())
    fmt = WeightFormat(executor.dtype.itemsize, fp8=c.quantization is not None)
    kv_token = kv_bytes_per_token(c, executor.kv_dtype.itemsize)
    results["bytes"] = dict(dtype_bytes=fmt.dtype_bytes, fp8=fmt.fp8, kv_dtype_bytes=executor.kv_dtype.itemsize,
                            dense_batch1=dense_bytes(c, 1, fmt), expert=expert_bytes(c, fmt), kv_per_token=kv_token,
                            all_weights=all_weight_bytes(c, fmt),
                            parameters=sum(p.numel() * p.element_size() for p in params))
    print(f"weights ({args.weights}) {results['bytes']['all_weights'] / 1e9:.3f} GB by the formula, the executor's "
          f"parameters {results['bytes']['parameters'] / 1e9:.3f} GB; KV pool {llm.engine.num_blocks} blocks "
          f"of {executor.kv_dtype}", flush=True)
    workloads = [offline_workload(n, args.seed, args.smoke) for n in args.num_requests]
    if "batch1" in args.parts:
        results["batch1"] = batch1(llm, args, c, fmt, kv_token, gbs, workloads[0].id_limit)
        print_batch1(results["batch1"])
    if "profile" in args.parts and device == "cuda":  # decode steps at batch 1 and a full batch; a prefill
        results["decode_kernels"] = profile_decode(llm, workloads[0].id_limit)
        results["decode_kernels_full_batch"] = profile_decode(llm, workloads[0].id_limit, batch=args.max_num_seqs,
                                                              steps=16)
        results["prefill_kernels"] = profile_prefill(llm, workloads[0].id_limit)
    write_summary(summary, results)
    if "offline" in args.parts:
        results["offline"] = []
        for i, wl in enumerate(workloads):
            results["offline"].append(offline(llm, args, c, fmt, kv_token, gbs, wl, stream=1 + i))
            print_offline(results["offline"][-1])
            write_summary(summary, results)
    llm.close()


def print_batch1(r: dict[str, Any]) -> None:
    print(f"batch-1: {r['ms_per_token']:.3f} ms/token (floor {r['floor_ms']:.3f} ms at context {r['context']}: "
          f"{r['floor_fraction']:.2f} of the floor's speed; goal <= {r['goal_ms']} ms/token) "
          f"{met(r['ms_per_token'], r['goal_ms'], lower_is_better=True)}", flush=True)


def print_offline(r: dict[str, Any]) -> None:
    print(f"{r['workload']}: {r['tok_s']:,.0f} tok/s (floor {r['floor_tok_s']:,.0f} tok/s in {r['floor_steps']} steps "
          f"of up to {r['floor_batch']} tokens, {r['floor_tokens_per_step']:.0f} on average; steps run "
          f"{r['steps']}: {r['floor_fraction']:.2f} of the floor; goal >= {r['goal_fraction']:.2f}) "
          f"{met(r['floor_fraction'], r['goal_fraction'])}", flush=True)


# ---- the experts alone ---------------------------------------------------------------

@dataclass(frozen=True)
class KernelInputs:
    """One layer's random router and experts (``copies`` of them) and one x per call."""

    xs: list[torch.Tensor]        # (T, H) each
    router: torch.Tensor          # (E, H)
    w13s: list[torch.Tensor]      # (E, 2I, H) each, x's dtype or e4m3
    w2s: list[torch.Tensor]       # (E, H, I) each
    # e4m3 experts' block scales of each copy, (E, 2I/128, H/128) and (E, H/128, I/128); None: 16 bits
    scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def operands(self, call: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, router, w13, w2) of call ``call``: its own x, the weights of copy ``call % copies``."""
        copy = call % len(self.w13s)
        return self.xs[call], self.router, self.w13s[copy], self.w2s[copy]

    def scales_of(self, call: int) -> ExpertScales:
        """The scales that go with ``operands(call)``'s experts ((None, None): 16 bits)."""
        return (None, None) if self.scales is None else self.scales[call % len(self.scales)]


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked experts w (E, N, K) -> e4m3 (E, N, K) and float32 scales (E, N/128, K/128), each
    expert quantized as a checkpoint's linear layer is (``quantize_fp8_block``)."""
    from minivllm.kernels.fp8 import quantize_fp8_block

    pairs = [quantize_fp8_block(m, FP8_WEIGHT_BLOCK) for m in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def kernel_inputs(c: ModelConfig, tokens: int, calls: int, copies: int, device: str, dtype: torch.dtype,
                  seed: int, fp8: bool = False) -> KernelInputs:
    """Weights scaled so that activations stay O(1); the router as the dummy loader fills it;
    ``fp8``: the experts block-quantized to e4m3."""
    g = torch.Generator(device=device).manual_seed(seed)
    e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)

    xs, router = [randn(tokens, h) for _ in range(calls)], randn(e, h, scale=0.02)
    w13s = [randn(e, 2 * i, h, scale=h ** -0.5) for _ in range(copies)]
    w2s = [randn(e, h, i, scale=i ** -0.5) for _ in range(copies)]
    if not fp8:
        return KernelInputs(xs=xs, router=router, w13s=w13s, w2s=w2s)
    q13, q2 = [quantize_experts(w) for w in w13s], [quantize_experts(w) for w in w2s]
    return KernelInputs(xs=xs, router=router, w13s=[q for q, _ in q13], w2s=[q for q, _ in q2],
                        scales=[(s13, s2) for (_, s13), (_, s2) in zip(q13, q2)])


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, scales: ExpertScales) -> torch.Tensor:
    """The torch reference of the expert path ``Ops.moe`` takes: ``fused_moe_reference`` for
    16-bit experts; for e4m3 ones the GEMVs' (weight-only) up to ``MOE_GEMV_MAX_TOKENS``
    tokens, else the grouped GEMM's (W8A8)."""
    from minivllm.kernels.reference import fused_moe_fp8_reference, fused_moe_reference, moe_gemv_fp8_reference
    from minivllm.ops.dispatch import MOE_GEMV_MAX_TOKENS

    w13_scale, w2_scale = scales
    if w13_scale is None or w2_scale is None:
        return fused_moe_reference(x, w13, w2, weights, ids)
    fp8 = moe_gemv_fp8_reference if x.shape[0] <= MOE_GEMV_MAX_TOKENS else fused_moe_fp8_reference
    return fp8(x, w13, w2, weights, ids, w13_scale, w2_scale, "block")


def experts_tolerance(inp: KernelInputs, ref: torch.Tensor) -> float:
    """The max error allowed against ``ref``: by format (FP8 experts, fp32 or 16-bit x), scaled
    by the output's size where it exceeds 1."""
    x_dtype = inp.operands(0)[0].dtype
    base = TOL_FP8 if inp.scales is not None else TOL_FP32 if x_dtype == torch.float32 else TOL_BF16
    return base * max(1.0, ref.abs().max().item())


def check_experts(ops: Any, c: ModelConfig, inp: KernelInputs, call: int) -> tuple[int, float]:
    """(distinct experts, max error) of ``ops.moe`` on call ``call``'s inputs.

    Raises:
        AssertionError: the routing is not a top-k of the softmax, or the experts' output
            is off ``experts_reference`` on that routing by more than the tolerance.
    """
    from minivllm.kernels.reference import moe_topk_reference

    x, router, w13, w2 = inp.operands(call)
    k, norm = c.num_experts_per_tok, c.norm_topk_prob
    out = ops.moe(x, router, w13, w2, k, norm, scales=inp.scales_of(call))
    logits = F.linear(x, router).float()
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
    ref = experts_reference(x, w13, w2, weights, ids, inp.scales_of(call)).float()
    err = (out.float() - ref).abs().max().item()
    tol = experts_tolerance(inp, ref)
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
               timed: bool, copies: int = WEIGHT_COPIES, calls: int = GRAPH_CALLS,
               fp8: bool = False, sweep: bool = False) -> dict[str, Any]:
    """Checked, then (``timed``) the graph time of ``ops.moe`` and the eager torch loop's;
    ``fp8``: e4m3 experts with block scales; ``sweep``: also the per-pair GEMV with each
    stage's tiles of ``GEMV_SWEEP`` (the other stage at its default) up to
    ``PATHS_MAX_TOKENS`` tokens, the grouped GEMM's tiles of ``GROUPED_SWEEP`` above
    ``MOE_GEMV_MAX_TOKENS``."""
    from minivllm.ops.dispatch import MOE_GEMV_MAX_TOKENS, Ops

    inp = kernel_inputs(c, tokens, calls, copies, device, dtype, seed=tokens, fp8=fp8)
    checks = [check_experts(ops, c, inp, i) for i in range(calls)]
    distinct = statistics.mean(d for d, _ in checks)
    nbytes = distinct * expert_bytes(c, WeightFormat(dtype.itemsize, fp8=fp8))
    row: dict[str, Any] = dict(tokens=tokens, distinct_experts=distinct,
                               expected_distinct=expected_distinct_experts(c, tokens),
                               expert_bytes=nbytes, floor_us=nbytes / (gbs * 1e3),
                               max_err=max(e for _, e in checks))
    if timed:
        def operands(i: int) -> tuple[Any, ...]:
            return (*inp.operands(i), c.num_experts_per_tok, c.norm_topk_prob)

        torch_ops = Ops.build("torch", torch.device(device), dtype)
        us = graph_us(lambda i: ops.moe(*operands(i), scales=inp.scales_of(i)), calls)
        torch_us = eager_us(lambda i: torch_ops.moe(*operands(i), scales=inp.scales_of(i)), calls, device)
        row.update(graph_us=us, GBs=nbytes / us / 1e3, pct_copy=100 * nbytes / us / 1e3 / gbs,
                   tflops=expert_flops(c, tokens) / us / 1e6, torch_us=torch_us, speedup=torch_us / us)
        if ops.triton and tokens <= PATHS_MAX_TOKENS:
            row["paths_us"] = {name: graph_us(lambda i, f=f: f(*operands(i), scales=inp.scales_of(i)), calls)
                               for name, f in forced_paths().items()}
            if sweep:
                row["gemv_sweep"] = sweep_per_pair(operands, inp, calls)
        if ops.triton and sweep and tokens > MOE_GEMV_MAX_TOKENS:
            row["grouped_sweep"] = sweep_grouped(operands, inp, calls)
    return row


# (block_n, block_k, num_warps, num_stages) of one per-pair GEMV stage that --sweep times. A
# program's tile is 2 x block_n rows in stage 1 (gate and up), k x block_n in stage 2.
GEMV_SWEEP = [(bn, bk, warps, stages) for bn in (1, 2, 4, 8, 16) for bk in (128, 256, 512)
              for warps, stages in ((4, 3), (8, 3), (4, 5))]


def sweep_per_pair(operands: Callable[[int], tuple[Any, ...]], inp: KernelInputs, calls: int) -> dict[str, Any]:
    """Graph us of the forced per-pair GEMV path with each stage's tiles swept in turn (as
    ``checked_sweep``); the other stage at its default."""
    from minivllm.kernels.moe_gemv import MoeGemvConfig

    per_pair = forced_paths()["per-pair GEMV"]
    out: dict[str, Any] = {}
    for stage in ("gate_up_config", "down_config"):
        tilings = {f"{bn}x{bk}w{warps}s{stages}":
                   {stage: MoeGemvConfig(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)}
                   for bn, bk, warps, stages in GEMV_SWEEP}
        out[stage] = checked_sweep(per_pair, tilings, operands, inp, calls,
                                   f"per-pair GEMV, {stage.removesuffix('_config')}")
    return out


# (block_m, block_n, block_k, num_warps, num_stages) of the grouped GEMM that --sweep times
# above MOE_GEMV_MAX_TOKENS: block_m is the alignment's (rows of one expert a block), the rest
# FusedMoeConfig's for both stages (FP8 experts step K by the 128-column group whatever block_k).
GROUPED_SWEEP = [(16, 64, 64, 4, 2)] + [(bm, bn, bk, warps, stages) for bm in (16, 64, 128) for bn in (64, 128)
                                        for bk in (64, 128) for warps, stages in ((4, 3), (8, 3))]


def sweep_grouped(operands: Callable[[int], tuple[Any, ...]], inp: KernelInputs, calls: int) -> dict[str, Any]:
    """Graph us of the forced grouped-GEMM path with each tiling of ``GROUPED_SWEEP`` (as
    ``checked_sweep``)."""
    from minivllm.kernels.fused_moe import FusedMoeConfig

    tilings = {f"m{bm} n{bn} k{bk} w{warps} s{stages}":
               dict(block_m=bm, config=FusedMoeConfig(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages))
               for bm, bn, bk, warps, stages in GROUPED_SWEEP}
    return checked_sweep(forced_paths()["grouped GEMM"], tilings, operands, inp, calls, "grouped GEMM")


def checked_sweep(path: Callable[..., torch.Tensor], tilings: dict[str, dict[str, Any]],
                  operands: Callable[[int], tuple[Any, ...]], inp: KernelInputs, calls: int,
                  what: str) -> dict[str, Any]:
    """``{"us": {name: graph us or None}, "best": name}`` of ``path`` with each of ``tilings``
    (its keyword arguments by name; None: more shared memory than the device has), each
    output first checked against the path's default output (the same sums in another order).

    Raises:
        AssertionError: a tiling's output off the default's by more than the tolerance.
    """
    from triton.runtime.errors import OutOfResources

    expected = path(*operands(0), scales=inp.scales_of(0)).float()
    tol = experts_tolerance(inp, expected)
    times: dict[str, float | None] = {}
    for name, tiles in tilings.items():
        try:
            got = path(*operands(0), scales=inp.scales_of(0), **tiles).float()
        except OutOfResources:
            times[name] = None
            continue
        err = (got - expected).abs().max().item()
        if not err <= tol:
            raise AssertionError(f"{what} with {name}: max error {err:.3g} > {tol:.3g}")
        times[name] = graph_us(lambda i, t=tiles: path(*operands(i), scales=inp.scales_of(i), **t), calls)
    fitted = sorted((kv for kv in times.items() if kv[1] is not None), key=lambda kv: kv[1])
    print(f"    {what} tiles swept: best {fitted[0][0]} {fitted[0][1]:.1f} us (of {len(times)}); "
          + ", ".join(f"{k} {v:.1f}" for k, v in fitted[1:6]), flush=True)
    return dict(us=times, best=fitted[0][0])


def forced_paths() -> dict[str, Callable[..., torch.Tensor]]:
    """The two Triton expert paths ``Ops.moe`` chooses between by token count
    (``MOE_GEMV_MAX_TOKENS``), each forced, with the same routing kernels before them."""
    from minivllm.kernels.fused_moe import default_tiles, fused_moe
    from minivllm.kernels.moe_align import moe_align
    from minivllm.kernels.moe_gemv import moe_gemv
    from minivllm.kernels.moe_topk import moe_topk

    def grouped(x, router, w13, w2, k, norm, *, scales=(None, None), block_m=None, config=None):
        weights, ids = moe_topk(F.linear(x, router), k, norm)
        layer_m, layer_config = default_tiles(x.shape[0], k, w13.shape[0], w13.dtype)  # what is not given
        block_m, config = block_m or layer_m, config or layer_config
        return fused_moe(x, w13, w2, weights, moe_align(ids, w13.shape[0], block_m), config,
                         w13_scale=scales[0], w2_scale=scales[1])

    def per_pair(x, router, w13, w2, k, norm, *, scales=(None, None), **tiles):
        weights, ids = moe_topk(F.linear(x, router), k, norm)
        return moe_gemv(x, w13, w2, weights, ids, w13_scale=scales[0], w2_scale=scales[1], **tiles)

    return {"grouped GEMM": grouped, "per-pair GEMV": per_pair}


def print_kernel_row(r: dict[str, Any], gbs: float) -> None:
    head = (f"experts at {r['tokens']:>4} tokens: {r['distinct_experts']:5.1f} distinct (expected "
            f"{r['expected_distinct']:5.1f}), {r['expert_bytes'] / 1e6:7.1f} MB, floor {r['floor_us']:7.1f} us, "
            f"max error {r['max_err']:.2e}")
    if "graph_us" not in r:
        print(head + " (untimed)", flush=True)
        return
    print(f"{head}; graph {r['graph_us']:7.1f} us = {r['GBs']:6,.0f} GB/s = {r['pct_copy']:4.1f}% of copy "
          f"{gbs:,.0f} GB/s, {r['tflops']:5.1f} TFLOP/s; torch loop {r['torch_us']:8.1f} us (x{r['speedup']:.1f})",
          flush=True)
    for name, us in r.get("paths_us", {}).items():
        print(f"    {name:>14} forced: graph {us:7.1f} us = {100 * r['expert_bytes'] / us / 1e3 / gbs:4.1f}% of copy",
              flush=True)


def kernel_part(args: argparse.Namespace, device: str, c: ModelConfig, gbs: float) -> list[dict[str, Any]]:
    """One row per ``--kernel-tokens`` (module doc); on the CPU under the torch reference or,
    with Triton's interpreter, the Triton kernels, checked but untimed. x in bf16 on CUDA and
    for e4m3 experts (the FP8 expert kernels take 16-bit x), else float32."""
    from minivllm.envs import triton_interpreted
    from minivllm.ops.dispatch import Ops

    fp8 = args.weights == "fp8"
    dtype = torch.bfloat16 if device == "cuda" or fp8 else torch.float32
    kernels = "triton" if device == "cuda" or triton_interpreted() else "torch"
    ops = Ops.build(kernels, torch.device(device), dtype)
    print(f"experts of one layer: {c.num_experts} x (2 x {c.moe_intermediate_size}) x {c.hidden_size}, "
          f"top-{c.num_experts_per_tok}, {'e4m3 with 128x128 block scales, x in ' if fp8 else ''}{dtype}, "
          f"kernels {kernels}", flush=True)
    rows = []
    for tokens in args.kernel_tokens:
        rows.append(kernel_row(ops, c, tokens, device, dtype, gbs, timed=device == "cuda",
                               copies=WEIGHT_COPIES if device == "cuda" else 1,
                               calls=GRAPH_CALLS if device == "cuda" else 1, fp8=fp8, sweep=args.sweep))
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
    ap.add_argument("--weights", choices=WEIGHTS, default="bf16",
                    help="fp8: Qwen3-30B-A3B-FP8's format (e4m3 linear layers and experts, 128x128 block scales)")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                    help="the KV cache's dtype (CacheConfig.kv_cache_dtype): the model's, or e4m3")
    ap.add_argument("--num-requests", type=int_list, default=[256, 1024], help="offline workloads, a comma list")
    ap.add_argument("--batch1-repeats", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="kernels: also the per-pair GEMV's tiles (GEMV_SWEEP)")
    ap.add_argument("--kernel-tokens", type=int_list, default=[1, 16, 64, 256])
    ap.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto",
                    help="the engine's fused ops (ExecutorConfig.kernels); --smoke: torch")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--model-dir", default=None,
                    help="where config.json is written once (--weights fp8: its FP8 copy in <model-dir>-fp8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--smoke", action="store_true", help="tiny MoE on the CPU: checks the code paths only")
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    if not args.parts or set(args.parts) - set(PARTS):
        ap.error(f"--parts: a comma list from {PARTS}, got {','.join(args.parts)!r}")
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
    summary = summary_name(args)
    gbs = copy_bandwidth_gbs(device, (1 << 30) if device == "cuda" else (1 << 24))
    print(f"{SHAPES_NAME}{' (smoke: tiny)' if args.smoke else ''} on {device}, {args.weights} weights, "
          f"KV cache {args.kv_cache_dtype}: copy bandwidth {gbs:,.0f} GB/s", flush=True)
    results: dict[str, Any] = {"args": vars(args), "shapes": SHAPES_NAME, "weights": args.weights,
                               "copy_gbs": gbs}
    if "kernel" in args.parts:
        results["kernel"] = kernel_part(args, device, c, gbs)
        write_summary(summary, results)
    if set(args.parts) - {"kernel"}:
        engine_part(args, path, device, c, gbs, results, summary)


if __name__ == "__main__":
    main()
