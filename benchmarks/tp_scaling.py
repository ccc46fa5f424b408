"""TP=2 against TP=1 on one machine, in alternating pairs: the throughput and batch-1 ratios
of tensor parallelism without the spread between machines.

    PYTHONPATH=. python3 -m benchmarks.tp_scaling [--pairs 2] [--shapes qwen3-8b --model-dir DIR]
        [any other benchmarks.throughput option]

Each run is ``benchmarks.throughput --engines minivllm --async on`` in a process of its own
(symmetric memory is set up once per process), TP=1 then TP=2, ``--pairs`` times. Per pair:
TP=2 over TP=1 offline tok/s (goal >= 1.6) and batch-1 ms/token (goal <= 0.65); then the
medians. Summary: ``$OUT/tp_scaling.json``. Exit status 1 if a run fails.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks.report import OUT_ENV, write_summary

GOALS = {"throughput": 1.6, "batch1": 0.65}
SET_HERE = ("--tensor-parallel-size", "--engines", "--async")


def run_throughput(tp: int, passthrough: list[str], timeout_s: float) -> dict[str, float]:
    """One ``benchmarks.throughput`` run at ``tp`` ranks: its offline tok/s and batch-1 ms/token."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "benchmarks.throughput", "--engines", "minivllm", "--async", "on",
               "--tensor-parallel-size", str(tp), *passthrough]
        proc = subprocess.run(cmd, env={**os.environ, OUT_ENV: out}, timeout=timeout_s,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"TP={tp} run failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                               f"{proc.stderr[-3000:]}")
        [path] = glob.glob(os.path.join(out, "throughput*.json"))
        with open(path) as f:
            summary = json.load(f)
    result = summary["minivllm"]["async on"]
    return {"tok_s": result["offline"]["tok_s"], "ms_per_token": result["batch1"]["ms_per_token"]}


def pair_ratios(one: dict[str, float], two: dict[str, float]) -> dict[str, float]:
    """TP=2 over TP=1: throughput (higher is better) and batch-1 latency (lower is better)."""
    return {"throughput": two["tok_s"] / one["tok_s"], "batch1": two["ms_per_token"] / one["ms_per_token"]}


def measure(pairs: int, passthrough: list[str], timeout_s: float) -> dict[str, Any]:
    """``pairs`` rounds of TP=1 then TP=2: every pair and the median ratios."""
    runs = []
    for i in range(pairs):
        one = run_throughput(1, passthrough, timeout_s)
        two = run_throughput(2, passthrough, timeout_s)
        ratios = pair_ratios(one, two)
        runs.append({"tp1": one, "tp2": two, **ratios})
        print(f"pair {i + 1}: TP=1 {one['tok_s']:,.0f} tok/s {one['ms_per_token']:.2f} ms/token | "
              f"TP=2 {two['tok_s']:,.0f} tok/s {two['ms_per_token']:.2f} ms/token | "
              f"throughput {ratios['throughput']:.3f}x, batch-1 {ratios['batch1']:.3f}x", flush=True)
    return {"pairs": runs, "median": {key: statistics.median(r[key] for r in runs) for key in GOALS}}


def report_line(result: dict[str, Any]) -> str:
    med = result["median"]
    tput_ok = "met" if med["throughput"] >= GOALS["throughput"] else "not met"
    b1_ok = "met" if med["batch1"] <= GOALS["batch1"] else "not met"
    return (f"median over {len(result['pairs'])} pair(s): throughput {med['throughput']:.3f}x "
            f"(goal >= {GOALS['throughput']}x: {tput_ok}), "
            f"batch-1 {med['batch1']:.3f}x (goal <= {GOALS['batch1']}x: {b1_ok})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--run-timeout", type=float, default=240, help="seconds per throughput run")
    args, passthrough = ap.parse_known_args()
    if args.pairs < 1:
        raise SystemExit("--pairs must be >= 1")
    for option in SET_HERE:
        if any(word == option or word.startswith(option + "=") for word in passthrough):
            raise SystemExit(f"{option} is set by this benchmark")
    try:
        result = measure(args.pairs, passthrough, args.run_timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(e, file=sys.stderr)
        raise SystemExit(1)
    print(report_line(result))
    write_summary("tp_scaling", {"args": vars(args), "passthrough": passthrough, **result})


if __name__ == "__main__":
    main()
