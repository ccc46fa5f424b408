"""TP=1 against TP=2 on one machine, in alternating pairs: issue 8's two ratios without
the spread between machines (8B TP=1 ran at 9,814-10,132 tok/s on different ones).

    PYTHONPATH=. python3 -m benchmarks.tp_scaling [--pairs 2] [--shapes qwen3-8b --model-dir /tmp/ck8]
        [--tp2-variant 'push=--push-all-reduce on'] [--tp2-variant 'warm=MINIVLLM_PDL=1 MINIVLLM_AR_WARM_MB=16']
        [--smoke] [any other benchmarks.throughput option]

Each run is ``benchmarks.throughput --engines minivllm --async on`` in a process of its
own (symmetric memory is set up once per process), in rounds: TP=1, TP=2, then TP=2 in
each ``--tp2-variant`` (a name, then throughput options and engine environment variables
that only that run gets), and again. Each TP=2 run against its round's TP=1 run gives
the throughput ratio (TP=2 over TP=1 completion tok/s, goal >= 1.6) and the batch-1
latency ratio (TP=2 over TP=1 ms/token, goal <= 0.65), so one call on two GPUs compares
the TP=2 options on the same machine. Prints every pair, then the medians beside the
goals; with ``$OUT`` set, writes ``$OUT/tp_scaling.json``. Exit status 1 if a run fails.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

GOALS = {"throughput": 1.6, "batch1": 0.65}
PLAIN = "plain"
_ENV_WORD = re.compile(r"([A-Z][A-Z0-9_]*)=(.*)")


@dataclass(frozen=True)
class Variant:
    """A TP=2 run's own options: ``benchmarks.throughput`` flags and engine environment."""

    name: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


def engine_env_names() -> frozenset[str]:
    """The environment variables the engine reads: a variant may set only these (a
    misspelt one would otherwise change nothing and be reported as a result)."""
    from minivllm.executor.distributed import TIMEOUT_ENV
    from minivllm.kernels._launch import PDL_ENV
    from minivllm.kernels.decode_attention import FUSED_MERGE_ENV
    from minivllm.kernels.gemv import L2_PREFETCH_ENV
    from minivllm.layers.all_reduce import WARM_ENV
    from minivllm.layers.attention import FUSE_QK_NORM_ROPE_ENV
    from minivllm.layers.fuse import COMPILE_ENV
    return frozenset({PDL_ENV, L2_PREFETCH_ENV, FUSED_MERGE_ENV, WARM_ENV, TIMEOUT_ENV, COMPILE_ENV,
                      FUSE_QK_NORM_ROPE_ENV})


def parse_variant(spec: str) -> Variant:
    """``NAME=WORDS``: WORDS split like a shell line; ``KEY=VALUE`` words are environment
    variables the engine reads, the others ``benchmarks.throughput`` options."""
    name, sep, words = spec.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name == PLAIN:
        raise ValueError(f"--tp2-variant {spec!r}: need NAME=OPTIONS with NAME of letters, digits, "
                         f"'_', '.', '-' and not {PLAIN!r}")
    known = engine_env_names()
    args, env = [], []
    for word in shlex.split(words):
        match = _ENV_WORD.fullmatch(word)
        if match is None:
            args.append(word)
        elif match[1] not in known:
            raise ValueError(f"--tp2-variant {name}: {match[1]} is not an environment variable the engine "
                             f"reads (known: {', '.join(sorted(known))})")
        else:
            env.append((match[1], match[2]))
    if not args and not env:
        raise ValueError(f"--tp2-variant {name}: no options given")
    return Variant(name, tuple(args), tuple(env))


def run_throughput(tp: int, passthrough: list[str], timeout_s: float,
                   env: tuple[tuple[str, str], ...] = ()) -> dict[str, float]:
    """One ``benchmarks.throughput`` run at ``tp`` ranks: its offline tok/s and batch-1 ms/token."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "benchmarks.throughput", "--engines", "minivllm", "--async", "on",
               "--tensor-parallel-size", str(tp), *passthrough]
        proc = subprocess.run(cmd, env={**os.environ, **dict(env), "OUT": out}, timeout=timeout_s,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            env_words = " ".join(f"{k}={v}" for k, v in env)
            raise RuntimeError(f"TP={tp} run failed (exit {proc.returncode}): {env_words} {' '.join(cmd)}\n"
                               f"{proc.stderr[-3000:]}")
        [path] = glob.glob(os.path.join(out, "throughput*.json"))
        with open(path) as f:
            summary = json.load(f)
    result = summary["minivllm"]["async on"]
    return {"tok_s": result["offline"]["tok_s"], "ms_per_token": result["batch1"]["ms_per_token"]}


def pair_ratios(one: dict[str, float], two: dict[str, float]) -> dict[str, float]:
    """TP=2 over TP=1: throughput (higher is better) and batch-1 latency (lower is better)."""
    return {"throughput": two["tok_s"] / one["tok_s"], "batch1": two["ms_per_token"] / one["ms_per_token"]}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"pairs": runs, "median": {key: statistics.median(r[key] for r in runs) for key in GOALS}}


def measure(pairs: int, passthrough: list[str], timeout_s: float,
            variants: tuple[Variant, ...] = ()) -> dict[str, Any]:
    """``pairs`` rounds of TP=1, TP=2, TP=2 in each variant. The plain TP=2 pairs at the
    top level (as before variants), each variant's under ``variants``."""
    everyone = (Variant(PLAIN), *variants)
    runs: dict[str, list[dict[str, Any]]] = {v.name: [] for v in everyone}
    for i in range(pairs):
        one = run_throughput(1, passthrough, timeout_s)
        for variant in everyone:
            two = run_throughput(2, [*passthrough, *variant.args], timeout_s, variant.env)
            ratios = pair_ratios(one, two)
            runs[variant.name].append({"tp1": one, "tp2": two, **ratios})
            label = "" if variant.name == PLAIN else f" [{variant.name}]"
            print(f"pair {i + 1}{label}: TP=1 {one['tok_s']:,.0f} tok/s {one['ms_per_token']:.2f} ms/token | "
                  f"TP=2 {two['tok_s']:,.0f} tok/s {two['ms_per_token']:.2f} ms/token | "
                  f"throughput {ratios['throughput']:.3f}x, batch-1 {ratios['batch1']:.3f}x", flush=True)
    result = summarise(runs[PLAIN])
    if variants:
        result["variants"] = {v.name: {"args": list(v.args), "env": dict(v.env), **summarise(runs[v.name])}
                              for v in variants}
    return result


def report_line(label: str, summary: dict[str, Any]) -> str:
    med = summary["median"]
    tput_ok = "met" if med["throughput"] >= GOALS["throughput"] else "not met"
    b1_ok = "met" if med["batch1"] <= GOALS["batch1"] else "not met"
    return (f"{label}median over {len(summary['pairs'])} pair(s): throughput {med['throughput']:.3f}x "
            f"(goal >= {GOALS['throughput']}x: {tput_ok}), "
            f"batch-1 {med['batch1']:.3f}x (goal <= {GOALS['batch1']}x: {b1_ok})")


def report(result: dict[str, Any]) -> None:
    print(report_line("", result))
    for name, summary in result.get("variants", {}).items():
        print(report_line(f"[{name}] ", summary))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--run-timeout", type=float, default=240, help="seconds per throughput run")
    ap.add_argument("--tp2-variant", action="append", default=[], metavar="NAME=OPTIONS",
                    help="another TP=2 run per round: throughput options and MINIVLLM_* variables (repeatable)")
    args, passthrough = ap.parse_known_args()
    if args.pairs < 1:
        raise SystemExit("--pairs must be >= 1")
    try:
        variants = tuple(parse_variant(spec) for spec in args.tp2_variant)
    except ValueError as e:
        raise SystemExit(str(e))
    if len({v.name for v in variants}) != len(variants):
        raise SystemExit("--tp2-variant names must differ")
    for banned in ("--tensor-parallel-size", "--engines", "--async"):
        if banned in passthrough or any(banned in v.args for v in variants):
            raise SystemExit(f"{banned} is set by this benchmark")
    try:
        result = measure(args.pairs, passthrough, args.run_timeout, variants)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(e, file=sys.stderr)
        raise SystemExit(1)
    report(result)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "tp_scaling.json"), "w") as f:
            json.dump({"args": vars(args), "passthrough": passthrough, **result}, f, indent=1)


if __name__ == "__main__":
    main()
