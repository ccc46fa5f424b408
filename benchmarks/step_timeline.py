"""Where offline-256's wall time goes, step by step: the workload of
``benchmarks.throughput`` run once through the engine's own loop, each ``step()``
call timed, grouped by what the step scheduled.

    python3 -m benchmarks.step_timeline [--shapes qwen3-0.6b] [--async on|off] [--smoke]

With one step in flight a call's time is mostly the wait for the step before it,
so a group's time is where the device (or the host, when it is slower) spent the
run, give or take one step. Groups: steps with prefill tokens, and decode-only
steps by batch size. ``$OUT/step_timeline.json`` keeps every step (batch size,
prefill and decode tokens, ms) for ``benchmarks.plots``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from benchmarks.throughput import (add_common_args, bench_device, build_llm, model_path, offline_workload,
                                   set_async_scheduling, write_summary)

BUCKETS = ((1, 8), (9, 32), (33, 64), (65, 128), (129, 192), (193, 256))


def timed_steps(llm: Any, prompts: list[list[int]], params: list[Any]) -> list[dict[str, Any]]:
    """Add every request, then call ``step()`` until done: one row per call, with the K/V
    tokens its plan's attention reads (every sequence's context up to its last fed token)."""
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"timeline-{i}", p, sp)
    submit, kv_tokens = eng.executor.submit, []

    def counting_submit(plan: Any) -> Any:
        kv_tokens.append(int((plan.start_positions.astype(np.int64) + plan.query_lens).sum()))
        return submit(plan)

    eng.executor.submit = counting_submit
    rows = []
    try:
        while eng.has_unfinished_requests():
            kv_tokens.append(0)  # a call that submits nothing
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            rec = eng.last_step
            rows.append(dict(ms=dt * 1e3, seqs=len(rec.scheduled), prefill=rec.num_prefill_tokens,
                             decode=rec.num_decode_tokens, kv_tokens=sum(kv_tokens)))
            kv_tokens.clear()
    finally:
        del eng.executor.submit  # the instance attribute; the class's method again
    return rows


def floor_ms(rows: list[dict[str, Any]], kv_bytes_per_token: int, weight_bytes: int, gbs: float) -> np.ndarray:
    """Per step, the time to read its K/V and the weights once at ``gbs`` GB/s."""
    kv = np.array([r["kv_tokens"] for r in rows], dtype=np.float64)
    return (kv * kv_bytes_per_token + weight_bytes) / (gbs * 1e9) * 1e3


def copy_gbs(device: str) -> float:
    """Device-to-device copy bandwidth (read + write counted), GB/s; 0 off CUDA."""
    import torch

    if device != "cuda":
        return 0.0
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * 10 * src.numel() / (start.elapsed_time(end) * 1e-3) / 1e9


def summarise(rows: list[dict[str, Any]], floor: np.ndarray) -> list[dict[str, Any]]:
    """Count, total seconds, mean ms and the bandwidth floor's seconds per group (see the
    module docstring)."""
    ms = np.array([r["ms"] for r in rows])
    prefill = np.array([r["prefill"] > 0 for r in rows])
    batch = np.array([r["decode"] for r in rows])
    groups = [("steps with prefill", prefill)]
    groups += [(f"decode, batch {lo}-{hi}", ~prefill & (batch >= lo) & (batch <= hi)) for lo, hi in BUCKETS]
    out = []
    for name, mask in groups:
        n = int(mask.sum())
        out.append(dict(group=name, steps=n, seconds=float(ms[mask].sum() / 1e3),
                        mean_ms=float(ms[mask].mean()) if n else 0.0,
                        decode_tokens=int(batch[mask].sum()), floor_seconds=float(floor[mask].sum() / 1e3)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the LLM's")
    ap.add_argument("--prefill-graphs", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--async", dest="async_mode", choices=("on", "off"), default="on")
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    args.tensor_parallel_size = 1
    device = bench_device(args)
    from minivllm import SamplingParams

    llm = build_llm(args, model_path(args), device)
    set_async_scheduling(llm, args.async_mode == "on")
    wl = offline_workload(args.num_requests, args.seed, args.smoke)
    warm = wl.prompts(stream=1000, n=64)
    llm.generate(warm, [SamplingParams(temperature=1.0, max_tokens=min(m, 16), ignore_eos=True)
                        for m in wl.max_tokens[:len(warm)]], use_tqdm=False)
    params = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True, output_kind="final_only")
              for m in wl.max_tokens]
    t0 = time.perf_counter()
    rows = timed_steps(llm, wl.prompts(stream=1), params)
    wall = time.perf_counter() - t0
    cfg = llm.model_config
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V, bf16
    weight_bytes = 2 * sum(p.numel() for p in llm.engine.executor.model.parameters())
    gbs = copy_gbs(device)
    floor = floor_ms(rows, kv_bytes, weight_bytes, gbs) if gbs else np.zeros(len(rows))
    table = summarise(rows, floor)
    print(f"offline-{args.num_requests} [async {args.async_mode}]: {len(rows)} steps in {wall:.2f} s "
          f"({sum(wl.max_tokens) / wall:,.0f} completion tok/s)")
    print(f"floor: each step's K/V ({kv_bytes:,} B per token) and weights ({weight_bytes / 1e9:.2f} GB) "
          f"read once at the copy bandwidth, {gbs:,.0f} GB/s (prefill FLOPs not counted)")
    print(f"{'group':24s} {'steps':>6s} {'seconds':>8s} {'mean ms':>8s} {'decode tok':>10s} {'floor s':>8s}")
    for g in table:
        print(f"{g['group']:24s} {g['steps']:6d} {g['seconds']:8.3f} {g['mean_ms']:8.2f} {g['decode_tokens']:10d} "
              f"{g['floor_seconds']:8.3f}")
    write_summary("step_timeline", {"args": vars(args), "wall_s": wall, "copy_gbs": gbs,
                                    "kv_bytes_per_token": kv_bytes, "weight_bytes": weight_bytes,
                                    "groups": table, "steps": rows})


if __name__ == "__main__":
    main()
