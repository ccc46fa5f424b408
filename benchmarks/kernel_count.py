"""Kernels launched by one batch-1 decode step, and the batch-1 decode step time with CUDA graphs.

    PYTHONPATH=. python3 -m benchmarks.kernel_count [--steps 100] [--top 15] [--smoke]

Inside a CUDA graph the kernels are replayed, not launched one by one, so they
are counted on an engine built with ``enforce_eager=True`` (same kernels, no
graph): one sequence (128 random prompt tokens, greedy) is stepped until it
decodes, two more steps warm up, then single ``step()`` calls are profiled
(``torch.profiler``, CUDA activity; synchronous scheduling, so the profiled call
runs exactly one step to completion). Counted: the trace's ``kernel`` events
(plus memcpy and memset separately); two steps are profiled to show the count
is stable. Printed: the count and the top kernels by count (with their total time).

Then, on a second engine with CUDA graphs (max_num_seqs 1, so one graph): one
sequence decodes ``--steps`` (100) steps after a 5-step warm-up, per scheduling
mode; the step time is the median interval between ``step()`` returns. Both
engines have small fixed KV pools, so they share the GPU. With ``$OUT`` set,
``$OUT/kernel_count.json``. Under a minute on an H200.

``--smoke``: tiny model on the CPU; CPU ops stand in for kernels there.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from typing import Any

import numpy as np
import torch

from benchmarks.host_overlap import (device_categories, drain, profiler_activities, run_steps,
                                     step_until_full_decode, trace_events)
from benchmarks.throughput import (GOAL_MS_TOKEN, STRETCH_MS_TOKEN, add_common_args, bench_device, mode_name,
                                   model_path, modes_of, set_async_scheduling, sync, write_summary)
from minivllm.config import cdiv


def build(args: argparse.Namespace, device: str, eager: bool) -> Any:
    from minivllm import LLM

    t0 = time.perf_counter()
    b = args.batch
    llm = LLM(model_path(args), device=device, seed=args.seed, skip_tokenizer_init=True, max_num_seqs=b,
              max_model_len=args.prompt_len + args.steps + 64,
              max_num_batched_tokens=max(512, min(8192, b * args.prompt_len)),
              num_blocks=64 + b * (args.prompt_len + args.steps + 64) // 16, enforce_eager=eager)
    print(f"{'eager' if eager else 'graph'} engine start-up {time.perf_counter() - t0:.1f}s", flush=True)
    return llm


def prompt(args: argparse.Namespace, stream: int) -> list[int]:
    return np.random.default_rng([args.seed, stream]).integers(0, args.id_limit, args.prompt_len).tolist()


def count_step(eng: Any, device: str) -> dict[str, Any]:
    """Profile one synchronous step(); kernels (or CPU ops under --smoke) by name."""
    with torch.profiler.profile(activities=profiler_activities(device)) as prof:
        eng.step()
        sync(device)
    kernel_cat = "kernel" if device == "cuda" else "cpu_op"
    events = trace_events(prof, device_categories(device))
    kernels = [e for e in events if str(e.get("cat")).lower() == kernel_cat]
    by_name: collections.Counter = collections.Counter(str(e["name"])[:100] for e in kernels)
    time_us: collections.Counter = collections.Counter()
    for e in kernels:
        time_us[str(e["name"])[:100]] += float(e["dur"])
    return dict(kernels=len(kernels), memcpy=sum(1 for e in events if "memcpy" in str(e.get("cat")).lower()),
                memset=sum(1 for e in events if "memset" in str(e.get("cat")).lower()),
                kernel_time_us=sum(time_us.values()),
                top=[(name, n, time_us[name]) for name, n in by_name.most_common()])


def kernel_counts(args: argparse.Namespace, device: str) -> dict[str, Any]:
    from minivllm import SamplingParams

    llm = build(args, device, eager=True)
    set_async_scheduling(llm, False)
    eng = llm.engine
    # Long enough that the first admitted still decode when the last prefill chunk is done.
    greedy = SamplingParams(temperature=0, max_tokens=16 + 2 * args.batch * args.prompt_len // 8192, ignore_eos=True)
    llm.generate([prompt(args, 1)], greedy, use_tqdm=False)
    for i in range(args.batch):
        eng.add_request(f"count-{i}", prompt(args, 2 + 1000 * i), greedy)
    step_until_full_decode(eng, args.batch)
    run_steps(eng, 2, args.batch)
    counts = [count_step(eng, device) for _ in range(2)]
    drain(eng)
    what = "CUDA kernels" if device == "cuda" else "CPU ops (smoke: no GPU)"
    print(f"batch-{args.batch} decode step, eager: {counts[0]['kernels']} {what} "
          f"(second step: {counts[1]['kernels']}), {counts[0]['memcpy']} memcpy, {counts[0]['memset']} memset, "
          f"kernel time {counts[0]['kernel_time_us']:.0f} µs")
    print(f"top {args.top} by count:      count   total µs")
    for name, n, us in counts[0]["top"][:args.top]:
        print(f"  {n:5d} {us:9.1f}  {name}")
    return dict(first=counts[0], second={k: v for k, v in counts[1].items() if k != "top"})


def prefill_profile(args: argparse.Namespace, device: str) -> dict[str, Any]:
    """Profile one prefill step of ``--prefill-tokens`` (8192) tokens: prompts of ``--prompt-len``
    filling the step's budget; kernels by total time."""
    from minivllm import LLM, SamplingParams

    n = cdiv(args.prefill_tokens, args.prompt_len)
    llm = LLM(model_path(args), device=device, seed=args.seed, skip_tokenizer_init=True, max_num_seqs=max(n, 2),
              max_model_len=args.prompt_len + 64, max_num_batched_tokens=args.prefill_tokens,
              num_blocks=64 + (n + 1) * (args.prompt_len + 64) // 16, enforce_eager=True)
    set_async_scheduling(llm, False)
    eng = llm.engine
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for stream in (1, 2):  # the first run warms up (and compiles) at this shape
        for i in range(n):
            eng.add_request(f"prefill-{stream}-{i}", prompt(args, stream * 10_000 + i), one)
        if stream == 2:
            counts = count_step(eng, device)
        drain(eng)
    by_time = sorted(counts["top"], key=lambda t: -t[2])
    print(f"prefill step of {args.prefill_tokens} tokens ({n} prompts of {args.prompt_len}), eager: "
          f"{counts['kernels']} kernels, kernel time {counts['kernel_time_us']:.0f} µs")
    print(f"top {args.top} by time:      count   total µs")
    for name, k, us in by_time[:args.top]:
        print(f"  {k:5d} {us:9.1f}  {name}")
    return {k: v for k, v in counts.items() if k != "top"} | {"top": by_time[:args.top]}


def graph_step_time(args: argparse.Namespace, device: str) -> dict[str, Any]:
    from minivllm import SamplingParams

    llm = build(args, device, eager=False)
    eng = llm.engine
    results = {}
    for i, on in enumerate(modes_of(args.async_mode)):
        set_async_scheduling(llm, on)
        for j in range(args.batch):
            eng.add_request(f"graph-{i}-{j}", prompt(args, 10 + i + 1000 * j),
                            SamplingParams(temperature=0, ignore_eos=True,
                                           max_tokens=args.steps + 16 + 2 * args.batch * args.prompt_len // 8192))
        step_until_full_decode(eng, args.batch)
        run_steps(eng, 5, args.batch)
        stamps = [time.perf_counter()]
        for _ in range(args.steps):
            run_steps(eng, 1, args.batch)
            stamps.append(time.perf_counter())
        drain(eng)
        dts = np.diff(stamps) * 1e3
        results[mode_name(on)] = dict(median_ms=float(statistics.median(dts)), mean_ms=float(dts.mean()),
                                      steps=args.steps)
        graphs = "CUDA graphs" if device == "cuda" else "no graphs on the CPU"
        ms = results[mode_name(on)]["median_ms"]
        print(f"batch-{args.batch} decode step [{mode_name(on)}, {graphs}]: median {ms:.3f} ms, "
              f"mean {dts.mean():.3f} ms over {args.steps} steps "
              f"(goal <= {GOAL_MS_TOKEN} ms/token; stretch {STRETCH_MS_TOKEN})",
              flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together (default 1)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--async", dest="async_mode", choices=("on", "off", "both"), default="both")
    ap.add_argument("--prefill-tokens", type=int, default=0,
                    help="also profile one eager prefill step of this many tokens (e.g. 8192)")
    args = ap.parse_args()
    if args.smoke:
        args.prompt_len, args.steps = 8, 5
    args.id_limit = 512 if args.smoke else 10000
    device = bench_device(args)
    summary: dict[str, Any] = {"args": vars(args)}
    summary["eager_counts"] = kernel_counts(args, device)
    summary["graph_step"] = graph_step_time(args, device)
    if args.prefill_tokens:
        summary["prefill"] = prefill_profile(args, device)
    write_summary("kernel_count", summary)


if __name__ == "__main__":
    main()
