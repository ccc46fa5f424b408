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
    """Add every request, then call ``step()`` until done: one row per call."""
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"timeline-{i}", p, sp)
    rows = []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        rec = eng.last_step
        rows.append(dict(ms=dt * 1e3, seqs=len(rec.scheduled), prefill=rec.num_prefill_tokens,
                         decode=rec.num_decode_tokens))
    return rows


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Count, total seconds and mean ms per group (see the module docstring)."""
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
                        decode_tokens=int(batch[mask].sum())))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
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
    table = summarise(rows)
    print(f"offline-{args.num_requests} [async {args.async_mode}]: {len(rows)} steps in {wall:.2f} s "
          f"({sum(wl.max_tokens) / wall:,.0f} completion tok/s)")
    print(f"{'group':24s} {'steps':>6s} {'seconds':>8s} {'mean ms':>8s} {'decode tok':>10s}")
    for g in table:
        print(f"{g['group']:24s} {g['steps']:6d} {g['seconds']:8.3f} {g['mean_ms']:8.2f} {g['decode_tokens']:10d}")
    write_summary("step_timeline", {"args": vars(args), "wall_s": wall,
                                    "groups": table, "steps": rows})


if __name__ == "__main__":
    main()
