"""GPU idle time per step at batch-256 decode, one step in flight vs synchronous.

    PYTHONPATH=. python3 -m benchmarks.host_overlap [--batch 256] [--window 50] [--smoke]

Workload: ``--batch`` (256) requests of 512 random prompt tokens, 192 new tokens
each (eos ignored, temperature 1), Qwen3-0.6B shapes, bf16, CUDA graphs on. The
192 (not 128) leaves room for both windows below inside the steps where all 256
sequences decode together. Per mode (async on, then off), on one engine, with
fresh prompts per mode (no prefix-cache hits between them):

1. add the requests and step until a step is a pure decode of all of them, then
   ``--warmup`` (5) more steps;
2. wall time: ``--window`` (50) ``step()`` calls timed with ``perf_counter``;
   wall ms/step = their time / window (the steady-state step period);
3. GPU idle: ``--window`` more steps under ``torch.profiler`` (CUDA activity
   only, so the profiler adds little host work), synchronised at the end. From
   the kernel, memcpy and memset events of the trace: busy = the length of the
   union of their intervals, span = last end - first start, idle = span - busy,
   both divided by the window's step count. Idle is the GPU waiting for the host:
   with one step in flight it is the host time exposed between GPU steps.

Every step of both windows is checked to be a pure decode of the whole batch
(RuntimeError otherwise). Prints one table and the target line
``host time exposed between GPU steps: X ms/step (goal <= 1 ms)`` for async on.
With ``$OUT`` set, ``$OUT/host_overlap.json``. About a minute on an H200
(start-up with graph capture, 2 x (prefill + ~200 steps)).

``--smoke``: the tiny model on the CPU, 4 requests; the profiler records CPU ops
there (no GPU), so the numbers only show that the code runs.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import numpy as np
import torch

from benchmarks.throughput import (add_common_args, bench_device, mode_name, model_path, modes_of,
                                   set_async_scheduling, sync, write_summary)

GOAL_IDLE_MS = 1.0
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


# ---- profiler traces (shared with kernel_count) --------------------------------

def profiler_activities(device: str) -> list[torch.profiler.ProfilerActivity]:
    """CUDA activity only on the GPU (kernel timing without CPU-op overhead); CPU for --smoke."""
    if device == "cuda":
        return [torch.profiler.ProfilerActivity.CUDA]
    return [torch.profiler.ProfilerActivity.CPU]


def device_categories(device: str) -> tuple[str, ...]:
    """Chrome-trace categories that count as device work (CPU ops stand in under --smoke)."""
    return GPU_CATEGORIES if device == "cuda" else ("cpu_op",)


def trace_events(prof: torch.profiler.profile, categories: tuple[str, ...]) -> list[dict[str, Any]]:
    """The complete ("X") events of the chrome trace whose category is in ``categories``.

    Raises:
        RuntimeError: none found (names the categories the trace does have).
    """
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    picked = [e for e in events if e.get("ph") == "X" and str(e.get("cat", "")).lower() in categories]
    if not picked:
        seen = sorted({str(e.get("cat")) for e in events})
        raise RuntimeError(f"the profile has no {categories} events; categories in it: {seen}")
    return picked


def span_and_busy_us(events: list[dict[str, Any]]) -> tuple[float, float]:
    """(last end - first start, length of the union of the events' intervals), in µs."""
    iv = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events)
    busy, (start, end) = 0.0, iv[0]
    for s, e in iv[1:]:
        if s > end:
            busy += end - start
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    return max(e for _, e in iv) - iv[0][0], busy


# ---- driving the engine --------------------------------------------------------

def is_full_decode(eng: Any, batch: int) -> bool:
    """The step just scheduled decodes every one of ``batch`` sequences and prefills nothing."""
    rec = eng.last_step
    return rec is not None and rec.num_prefill_tokens == 0 and len(rec.scheduled) == batch


def step_until_full_decode(eng: Any, batch: int, limit: int = 10_000) -> int:
    for n in range(1, limit + 1):
        eng.step()
        if is_full_decode(eng, batch):
            return n
    raise RuntimeError(f"no full decode step of {batch} sequences within {limit} steps")


def run_steps(eng: Any, n: int, batch: int) -> float:
    """``n`` full-decode ``step()`` calls; returns their wall time in seconds."""
    t0 = time.perf_counter()
    for k in range(n):
        eng.step()
        if not is_full_decode(eng, batch):
            raise RuntimeError(f"step {k} of the window is not a full decode of {batch} sequences: "
                               f"{len(eng.last_step.scheduled)} scheduled, "
                               f"{eng.last_step.num_prefill_tokens} prefill tokens")
    return time.perf_counter() - t0


def drain(eng: Any) -> None:
    while eng.has_unfinished_requests():
        eng.step()


def measure_mode(llm: Any, args: argparse.Namespace, device: str, on: bool, stream: int) -> dict[str, Any]:
    """One mode: fill the batch, warm up, time a window, profile a window, drain."""
    from minivllm import SamplingParams

    eng = llm.engine
    set_async_scheduling(llm, on)
    rng = np.random.default_rng([args.seed, stream])
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True,
                            output_kind=args.output_kind)
    for i in range(args.batch):
        eng.add_request(f"overlap-{stream}-{i}", rng.integers(0, args.id_limit, args.prompt_len).tolist(), params)
    filled = step_until_full_decode(eng, args.batch)
    run_steps(eng, args.warmup, args.batch)
    wall = run_steps(eng, args.window, args.batch)
    with torch.profiler.profile(activities=profiler_activities(device)) as prof:
        run_steps(eng, args.window, args.batch)
        sync(device)
    drain(eng)
    events = trace_events(prof, device_categories(device))
    span, busy = span_and_busy_us(events)
    n = args.window
    dtoh = sum(1 for e in events if "dtoh" in str(e.get("name", "")).lower())
    # The profiler slows the host (its own records), so the idle time inside the profiled
    # window overstates what an unprofiled run exposes: that is the unprofiled wall time
    # per step minus the GPU's busy time per step (the kernels take the same time either way).
    r = dict(wall_ms_per_step=wall * 1e3 / n, gpu_busy_ms_per_step=busy / 1e3 / n,
             gpu_idle_ms_per_step=(span - busy) / 1e3 / n,
             exposed_host_ms_per_step=max(0.0, wall * 1e3 / n - busy / 1e3 / n), span_ms=span / 1e3, steps=n,
             device_events=len(events), dtoh_copies=dtoh, steps_to_fill=filled)
    print(f"[{mode_name(on)}] filled in {filled} steps; window of {n}: wall {r['wall_ms_per_step']:.2f} ms/step; "
          f"profiled: {len(events)} device events ({len(events) / n:.0f}/step, {dtoh} DtoH copies), "
          f"span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms", flush=True)
    if device == "cuda" and len(events) < 100 * n:
        print(f"WARNING: only {len(events) / n:.0f} device events per step: the trace may lack the kernels "
              "inside CUDA-graph replays, which would overstate the idle time")
    return r


def print_table(results: dict[str, dict[str, Any]], batch: int, output_kind: str) -> None:
    print(f"\nbatch-{batch} decode ({output_kind}), per step   wall ms   GPU busy ms   idle (profiled) ms"
          "   exposed host ms")
    for name, r in results.items():
        print(f"  {name:27s} {r['wall_ms_per_step']:8.2f} {r['gpu_busy_ms_per_step']:13.2f} "
              f"{r['gpu_idle_ms_per_step']:20.2f} {r['exposed_host_ms_per_step']:17.2f}")
    if "async on" in results:
        idle = results["async on"]["exposed_host_ms_per_step"]
        print(f"host time exposed between GPU steps: {idle:.2f} ms/step (goal <= {GOAL_IDLE_MS:g} ms) "
              f"{'MET' if idle <= GOAL_IDLE_MS else 'not met'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--async", dest="async_mode", choices=("on", "off", "both"), default="both")
    ap.add_argument("--output-kind", choices=("final_only", "delta"), default="final_only",
                    help="final_only: as offline generate(); delta: an output per request per step, "
                         "as the server streams")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.prompt_len, args.max_tokens, args.warmup, args.window = 4, 16, 24, 2, 5
    args.id_limit = 512 if args.smoke else 10000
    if args.max_tokens <= args.warmup + 2 * args.window + 2:
        ap.error("--max-tokens must exceed --warmup + 2 * --window (+ the fill steps)")
    device = bench_device(args)
    from minivllm import LLM, SamplingParams
    from minivllm.config import cdiv

    seq_len = args.prompt_len + args.max_tokens
    t0 = time.perf_counter()
    llm = LLM(model_path(args), device=device, seed=args.seed, skip_tokenizer_init=True,
              max_num_seqs=args.batch, max_model_len=cdiv(seq_len, 256) * 256,
              max_num_batched_tokens=64 if args.smoke else 8192,
              num_blocks=args.batch * cdiv(seq_len, 16) + 64)
    print(f"start-up {time.perf_counter() - t0:.1f}s, KV pool {llm.engine.num_blocks} blocks", flush=True)
    warm = np.random.default_rng([args.seed, 99]).integers(0, args.id_limit, (args.batch, 32)).tolist()
    llm.generate(warm, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    results = {mode_name(on): measure_mode(llm, args, device, on, stream=1 + i)
               for i, on in enumerate(modes_of(args.async_mode))}
    print_table(results, args.batch, args.output_kind)
    write_summary("host_overlap", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
