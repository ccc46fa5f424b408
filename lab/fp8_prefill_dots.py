"""The prefill kernel over an FP8 cache: its e4m3 tiles widened to bf16 (q's dtype) or to
fp16 (``PrefillConfig.fp16_dots``), against the same kernel over a bf16 cache.

    PYTHONPATH=. python3 lab/fp8_prefill_dots.py [--rounds 3]

Qwen3-0.6B attention shapes (16 / 8 heads of 128), blocks of 64, random pools and block
tables. Batches: 16 fresh prompts of 100..1,024 tokens; a step of offline-256 that mixes a
4,096-token chunk with 192 decode rows over contexts of 400..1,200 (the engine runs such a
step through the prefill kernel); 32 chunks of 64 over 960 cached tokens. Each variant in
a CUDA graph (``benchmarks.gpu_timing.graph_us``), the variants alternating over rounds;
every output first checked against the bf16-dot variant's.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import numpy as np
import torch

from benchmarks.gpu_timing import graph_us
from minivllm.kernels.prefill_attention import default_config, prefill_attention
from minivllm.kernels.reference import quantize_kv_reference

HEADS, KV_HEADS, DIM, BLOCK = 16, 8, 128, 64


def batches(rng: np.random.Generator) -> dict[str, list[tuple[int, int]]]:
    """Name -> (q_len, kv_len) per sequence."""
    fresh = [(int(n), int(n)) for n in rng.integers(100, 1025, 16)]
    mixed = [(4096, 4096)] + [(1, int(n)) for n in rng.integers(400, 1201, 192)]
    chunks = [(64, 1024)] * 32
    return {"varlen16": fresh, "mixed 4096 + 192 decode": mixed, "32x64+960": chunks}


def problem(seqs: list[tuple[int, int]], gen: torch.Generator) -> tuple:
    q_lens = torch.tensor([q for q, _ in seqs], dtype=torch.int32)
    kv_lens = torch.tensor([k for _, k in seqs], dtype=torch.int32, device="cuda")
    need = [-(-k // BLOCK) for _, k in seqs]
    width = max(need)
    pool = sum(need) + 8
    perm = torch.randperm(pool, generator=gen, device="cuda").to(torch.int32)
    tables = torch.full((len(seqs), width), -1, dtype=torch.int32, device="cuda")
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[at:at + n]
        at += n
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = q_lens.cumsum(0)
    q = torch.randn(int(cu[-1]), HEADS, DIM, generator=gen, device="cuda").bfloat16()
    k, v = (torch.randn(pool, BLOCK, KV_HEADS, DIM, generator=gen, device="cuda").bfloat16() for _ in range(2))
    return q, k, v, cu.to("cuda"), kv_lens, tables, int(q_lens.max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    one = torch.ones(1, device="cuda")
    for name, seqs in batches(np.random.default_rng(0)).items():
        q, k, v, cu, kv_lens, tables, max_q = problem(seqs, gen)
        k8, v8 = quantize_kv_reference(k, one), quantize_kv_reference(v, one)
        fp16 = default_config(q.dtype, DIM, max_q, fp8_cache=True)
        bf16_dots = dataclasses.replace(fp16, fp16_dots=False)
        variants = {
            "bf16 cache": (k, v, None, {}),
            "fp8 cache, bf16 dots": (k8, v8, bf16_dots, dict(k_scale=one, v_scale=one)),
            "fp8 cache, fp16 dots": (k8, v8, fp16, dict(k_scale=one, v_scale=one)),
        }

        def call(kc, vc, config, scales):
            return lambda _: prefill_attention(q, kc, vc, cu, kv_lens, tables, DIM ** -0.5, max_q, config=config,
                                               **scales)

        base = call(*variants["fp8 cache, bf16 dots"])(0)
        wide = call(*variants["fp8 cache, fp16 dots"])(0)
        torch.testing.assert_close(wide.float(), base.float(), atol=2e-2, rtol=2e-2)
        times: dict[str, list[float]] = {n: [] for n in variants}
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(variants)[::-1]
            for n in order:
                times[n].append(graph_us(call(*variants[n]), 1))
        kv_tokens = int(kv_lens.sum())
        print(f"{name}: {len(seqs)} sequences, {int(cu[-1]):,} new tokens, {kv_tokens:,} context tokens")
        for n, ts in times.items():
            print(f"  {n:22s} {statistics.median(ts):8.1f} us  (rounds {', '.join(f'{t:.1f}' for t in ts)})")


if __name__ == "__main__":
    main()
