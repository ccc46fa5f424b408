"""Sampler time on the GPU at the Qwen3 vocabulary, bf16 logits: the all-torch reference
(``reference_sample``: float copy, full sort for filters, (S, V) noise) against the fused
path (``Sampler.forward``: argmax fast path, ``torch.topk`` floors and the Gumbel kernel).

    PYTHONPATH=. python3 -m benchmarks.sampler [--sweep]

S in {1, 8, 256} rows x V = 151936, four workloads (greedy; temperature 1.0 unseeded, the
offline benchmark's; per-request seeds; top_k=50 + top_p=0.9), ``do_bench`` medians (L2
flushed), and the host time of ``SamplingTensors.build``. Checked first, per case: seeded
rows give the reference's tokens, the kernel gives its torch reference's tokens, every
filtered token is one the reference filters keep, and the fused path makes no host sync
(``torch.cuda.set_sync_debug_mode("error")``). ``--sweep`` also times ``GumbelConfig``
variants (tuning). Summary: ``$OUT/sampler.json``. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch
import triton

from benchmarks.report import write_summary
from minivllm.kernels.gumbel_sample import GumbelConfig, gumbel_sample, gumbel_sample_reference
from minivllm.ops.dispatch import Ops
from minivllm.sampler.sampler import Sampler, SamplingTensors, apply_filters, filter_floor, reference_sample
from minivllm.sampling import SamplingParams

VOCAB = 151936
ROWS = (1, 8, 256)
CASES: dict[str, Callable[[int], SamplingParams]] = {
    "greedy": lambda i: SamplingParams(temperature=0.0),
    "temperature": lambda i: SamplingParams(temperature=1.0),
    "seeded": lambda i: SamplingParams(temperature=1.0, seed=1000 + i),
    "top_k50_top_p0.9": lambda i: SamplingParams(temperature=1.0, top_k=50, top_p=0.9),
}


def bench_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def build_us(params: list[SamplingParams], positions: list[int]) -> float:
    """Median host time of ``SamplingTensors.build`` (microseconds)."""
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        SamplingTensors.build(params, positions, VOCAB, "cuda")
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def check(case: str, params: list[SamplingParams], positions: list[int], logits: torch.Tensor,
          sampler: Sampler) -> list[str]:
    """The case's correctness checks; returns the failures (empty: all good)."""
    failures = []
    sampler(logits, SamplingTensors.build(params, positions, VOCAB, "cuda"), step_seed=1)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        t = SamplingTensors.build(params, positions, VOCAB, "cuda")
        new = sampler(logits, t, step_seed=1)
    except RuntimeError as e:
        failures.append(f"{case}: host sync on the sampling path ({e})")
        t = SamplingTensors.build(params, positions, VOCAB, "cuda")
        new = sampler(logits, t, step_seed=1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if case == "seeded" and not torch.equal(new, reference_sample(logits, t)):
        failures.append(f"{case}: seeded rows differ from the reference sampler in "
                        f"{int((new != reference_sample(logits, t)).sum())} of {len(new)} rows")
    if not t.all_greedy:
        ref = gumbel_sample_reference(logits, t.temperature, filter_floor(logits, t), t.greedy, t.seeded,
                                      t.seed_keys, 1)
        if not torch.equal(new, ref):
            failures.append(f"{case}: kernel differs from its torch reference in "
                            f"{int((new != ref).sum())} of {len(new)} rows")
    # bf16 logits tie a lot: the reference filters keep exactly k of the tied boundary
    # tokens, the fused ones all of them, so compare values, not token sets.
    scaled = logits.float() / t.temperature[:, None]
    kept = apply_filters(scaled, t) > -torch.inf
    lowest_kept = torch.where(kept, scaled, torch.inf).amin(dim=1)
    if not (scaled.gather(1, new[:, None])[:, 0] >= lowest_kept).all():
        failures.append(f"{case}: sampled a token the filters drop")
    return failures


def run_cases() -> tuple[list[dict], list[str]]:
    """Check and time every (rows, case); print one line each."""
    results, failures = [], []
    gen = torch.Generator("cuda").manual_seed(0)
    sampler = Sampler(Ops.build("triton", torch.device("cuda"), torch.bfloat16), torch.Generator("cuda").manual_seed(0))
    print(f"{'rows':>5} {'case':>18} {'torch ms':>9} {'fused ms':>9} {'speedup':>8} {'build us':>9}")
    for rows in ROWS:
        logits = (torch.randn(rows, VOCAB, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        positions = list(range(100, 100 + rows))
        for case, make in CASES.items():
            params = [make(i) for i in range(rows)]
            failures += check(case, params, positions, logits, sampler)
            t = SamplingTensors.build(params, positions, VOCAB, "cuda")
            ref = bench_ms(lambda: reference_sample(logits, t, gen))
            fused = bench_ms(lambda: sampler(logits, t, step_seed=1))
            host = build_us(params, positions)
            results.append(dict(rows=rows, case=case, reference_ms=ref, fused_ms=fused, speedup=ref / fused,
                                build_us=host))
            print(f"{rows:>5} {case:>18} {ref:>9.3f} {fused:>9.3f} {ref / fused:>7.1f}x {host:>9.1f}")
    return results, failures


def sweep() -> list[dict]:
    """Time the temperature-only kernel under other launch configs."""
    gen = torch.Generator("cuda").manual_seed(1)
    out = []
    configs = [GumbelConfig(block=b, num_warps=w, programs_per_sm=p, min_split_columns=m)
               for b in (1024, 2048, 4096) for w in (4, 8) for p in (4, 8, 16) for m in (2048, 8192)]
    for rows in ROWS:
        logits = (torch.randn(rows, VOCAB, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        temperature = torch.ones(rows, device="cuda")
        flags = torch.zeros(rows, dtype=torch.bool, device="cuda")
        keys = torch.zeros(rows, 2, dtype=torch.int64, device="cuda")
        for cfg in configs:
            us = 1e3 * bench_ms(lambda: gumbel_sample(logits, temperature, None, flags, flags, keys, 1,
                                                      config=cfg))
            gbs = logits.numel() * logits.element_size() / (us * 1e-6) / 1e9
            out.append(dict(rows=rows, config=cfg.__dict__, us=us, gbs=gbs))
            print(f"sweep rows {rows:>3} {cfg}: {us:8.1f} us  {gbs:7.0f} GB/s read")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="also time GumbelConfig variants")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks.sampler needs a CUDA device")
    with torch.inference_mode():
        results, failures = run_cases()
        swept = sweep() if args.sweep else []
    for f in failures:
        print("CHECK FAILED:", f)
    write_summary("sampler", {"vocab": VOCAB, "dtype": "bfloat16", "results": results, "sweep": swept,
                              "failures": failures})
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
