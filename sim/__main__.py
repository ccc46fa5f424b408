"""``python -m sim``: fuzz the engine, record a trace, replay a trace.

    python -m sim run --traces 10000 --seed 0 [--config policy=mixed block_size=4] [--plot DIR]
    python -m sim record --seed 7 --out trace.jsonl
    python -m sim record --trace inputs.jsonl --out golden.jsonl
    python -m sim replay fixtures/traces/*.jsonl
    python -m sim replay trace.jsonl --plot trace.png

``--plot`` (needs matplotlib, the ``plot`` extra) draws what the scheduler did
(``sim.plot``): ``run`` writes DIR/summary.png (steps, preemptions and prefix
hits across the traces), DIR/trace-<seed>.png for the first few traces, and
each failing trace's figure next to its saved JSONL; ``replay`` draws its one
trace, marking the first step that differs from the recording.

Exit codes: 0 all good, 1 a violation or a replay mismatch, 2 bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence, TextIO

from sim.runner import RunResult, record_trace, run_trace
from sim.traces import OVERRIDE_KEYS, Trace, flatten_overrides, generate_trace, load

# Trace i of ``run --seed S`` is generated from seed S * SEED_STRIDE + i.
SEED_STRIDE = 1_000_000
MAX_PRINTED_VIOLATIONS = 5
# ``run --plot DIR``: the first this many traces get a figure of their own.
PLOTTED_TRACES = 5


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``--config`` values: JSON objects and/or ``key=value`` pairs (value parsed as JSON if it can be).

    Raises:
        ValueError: malformed item or unknown key.
    """
    out: dict[str, Any] = {}
    for item in items:
        item = item.strip()
        if item.startswith("{"):
            value = json.loads(item)
            if not isinstance(value, dict):
                raise ValueError(f"--config {item!r} is not a JSON object")
            out.update(flatten_overrides(value))
            continue
        for pair in item.split():
            key, sep, raw = pair.partition("=")
            if not sep:
                raise ValueError(f"--config item {pair!r} is not key=value")
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                value = raw
            out.update(flatten_overrides({key: value}))
    return out


class Progress:
    """A one-line text progress bar on a stream (redrawn at most ~10 times a second)."""

    def __init__(self, total: int, stream: TextIO, width: int = 30) -> None:
        self.total, self.stream, self.width = total, stream, width
        self.start = self.last = time.perf_counter()
        self.tty = stream.isatty()

    def update(self, done: int, steps: int, failures: int, force: bool = False) -> None:
        now = time.perf_counter()
        interval = 0.1 if self.tty else 10.0
        if not force and now - self.last < interval:
            return
        self.last = now
        frac = done / self.total if self.total else 1.0
        bar = "#" * int(frac * self.width)
        rate = steps / max(now - self.start, 1e-9)
        line = (f"[{bar:<{self.width}}] {done}/{self.total} traces  {rate:,.0f} steps/s  "
                f"{failures} failing")
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        if self.tty and force:
            self.stream.write("\n")
        self.stream.flush()


COUNTERS = ("steps", "requests", "rejected", "prefill_tokens", "decode_tokens", "cached_tokens",
            "completion_tokens", "preemptions", "chunked_prefills", "aborts")


def _summary(totals: dict[str, int], traces: int, seconds: float, failures: int) -> str:
    t = totals
    prompt_work = t["prefill_tokens"] + t["cached_tokens"]
    rows = [
        ("traces", f"{traces:,} ({t['async_traces']:,} with one step in flight)"),
        ("requests", f"{t['requests']:,} (+{t['rejected']:,} rejected at add)"),
        ("steps", f"{t['steps']:,}"),
        ("steps/s", f"{t['steps'] / max(seconds, 1e-9):,.0f}  ({seconds:.1f} s)"),
        ("tokens", f"{t['prefill_tokens'] + t['decode_tokens']:,} computed ({t['prefill_tokens']:,} prefill, "
                   f"{t['decode_tokens']:,} decode), {t['completion_tokens']:,} generated"),
        ("prefix-hit", f"{100.0 * t['cached_tokens'] / max(prompt_work, 1):.1f} % of prompt work "
                       f"({t['cached_tokens']:,} cached tokens)"),
        ("preemptions", f"{t['preemptions']:,}"),
        ("chunked prefills", f"{t['chunked_prefills']:,}"),
        ("aborts", f"{t['aborts']:,}"),
        ("violations", f"{t['violations']:,} in {failures:,} trace(s)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


class _Plots:
    """``run --plot DIR``: per-trace figures and the numbers behind the summary figure."""

    def __init__(self, out: Path) -> None:
        from sim import plot
        plot.check_matplotlib()
        self.plot, self.out = plot, out
        self.steps: list[int] = []
        self.preemptions: list[int] = []
        self.hit_share: list[float] = []

    def add(self, i: int, trace: Trace, result: RunResult) -> None:
        """Count trace ``i``'s run; draw it if it is one of the first ``PLOTTED_TRACES``."""
        if i < PLOTTED_TRACES:
            self.trace(trace, result, self.out / f"trace-{trace.seed}.png")
        self.steps.append(result.steps)
        self.preemptions.append(result.preemptions)
        prompt_work = result.prefill_tokens + result.cached_tokens
        self.hit_share.append(result.cached_tokens / prompt_work if prompt_work else float("nan"))

    def trace(self, trace: Trace, result: RunResult, path: Path) -> Path:
        """Draw one trace's run at ``path``."""
        if result.timeline is None:  # the run is deterministic: run it again, recording its steps
            result = run_trace(trace, timeline=True)
        return self.plot.save(self.plot.plot_run(trace, result), path)

    def summary(self, title: str) -> None:
        """Draw the distributions over every trace counted, at DIR/summary.png."""
        fig = self.plot.plot_summary(self.steps, self.preemptions, self.hit_share, title)
        path = self.plot.save(fig, self.out / "summary.png")
        print(f"figures written to {self.out}/ (summary: {path})")


def _run_seed(job: tuple[int, dict[str, Any]]) -> tuple[RunResult, bool]:
    """One trace in a worker of ``run --jobs N``: its counts and violations (the trace itself
    is not sent back; the caller generates a failing one again from its seed) and whether it
    ran with one step in flight."""
    seed, overrides = job
    trace = generate_trace(seed, overrides)
    result = run_trace(trace)
    counts = {k: getattr(result, k) for k in COUNTERS}
    return RunResult(seed=result.seed, violations=result.violations, **counts), trace.scheduler.async_scheduling


def _outcomes(args: argparse.Namespace, overrides: dict[str, Any], plotted: int,
              stack: contextlib.ExitStack) -> Iterator[tuple[int, Trace | None, RunResult, bool]]:
    """(index, trace or None, result, async) of each trace in order: in this process, or over
    ``args.jobs`` forked workers (the simulator imports no torch), which return results only."""
    seeds = (args.seed * SEED_STRIDE + i for i in range(args.traces))
    if args.jobs == 1:
        for i, seed in enumerate(seeds):
            trace = generate_trace(seed, overrides)
            yield i, trace, run_trace(trace, timeline=i < plotted), trace.scheduler.async_scheduling
        return
    pool = stack.enter_context(multiprocessing.get_context("fork").Pool(args.jobs))  # terminated on exit
    for i, (result, in_flight) in enumerate(pool.imap(_run_seed, ((s, overrides) for s in seeds), chunksize=8)):
        yield i, None, result, in_flight


def cmd_run(args: argparse.Namespace) -> int:
    overrides = parse_overrides(args.config)
    generate_trace(args.seed * SEED_STRIDE, overrides)  # bad overrides fail before the progress bar
    if args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs}: at least 1")
    if args.plot is not None and args.jobs > 1:
        raise ValueError("--plot draws the traces as they run, in this process: use it with --jobs 1")
    out_dir = Path(args.out_dir)
    plots = _Plots(Path(args.plot)) if args.plot is not None else None
    progress = Progress(args.traces, sys.stderr) if not args.quiet else None
    # Only totals are kept: holding every result would grow the heap the GC walks.
    totals = dict.fromkeys(COUNTERS + ("violations", "async_traces"), 0)
    failures = done = 0

    def count(i: int, trace: Trace | None, result: RunResult, in_flight: bool) -> bool:
        """Adds trace ``i``'s result to ``totals`` (and its figure to ``plots``); a failing trace
        is saved and its first violations printed. Returns whether it failed."""
        seed = args.seed * SEED_STRIDE + i
        for k in COUNTERS:
            totals[k] += getattr(result, k)
        totals["violations"] += len(result.violations)
        totals["async_traces"] += in_flight
        if plots is not None and trace is not None:
            plots.add(i, trace, result)
        if result.ok:
            return False
        trace = trace if trace is not None else generate_trace(seed, overrides)
        path = trace.save(out_dir / f"trace-{seed}.jsonl")
        print(f"\nVIOLATION in trace seed {seed} (run --seed {args.seed}, trace {i}); saved {path}", file=sys.stderr)
        if plots is not None:
            print(f"  its picture: {plots.trace(trace, result, path.with_suffix('.png'))}", file=sys.stderr)
        for v in result.violations[:MAX_PRINTED_VIOLATIONS]:
            print(f"  {v}", file=sys.stderr)
        return True

    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        for i, trace, result, in_flight in _outcomes(args, overrides, PLOTTED_TRACES if plots else 0, stack):
            failed = count(i, trace, result, in_flight)
            failures += failed
            done += 1
            if failed and failures >= args.max_failures:
                print(f"stopping after {failures} failing traces", file=sys.stderr)
                break
            if progress:
                progress.update(done, totals["steps"], failures)
    seconds = time.perf_counter() - start
    if progress:
        progress.update(done, totals["steps"], failures, force=True)
    print(_summary(totals, done, seconds, failures))
    if plots is not None:
        plots.summary(f"python -m sim run --traces {done} --seed {args.seed}: {failures} failing")
    if failures:
        print(f"FAILED: seed {args.seed}; failing traces saved under {out_dir}/ "
              f"(replay one with: python -m sim replay {out_dir}/trace-<seed>.jsonl)")
        return 1
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    if args.trace is not None:
        trace = load(args.trace)
    else:
        trace = generate_trace(args.seed, parse_overrides(args.config))
    recorded, result = record_trace(trace)
    path = recorded.save(args.out)
    print(f"recorded {result.steps} steps of {len(trace.events)} input events to {path}")
    for v in result.violations[:MAX_PRINTED_VIOLATIONS]:
        print(f"VIOLATION {v}", file=sys.stderr)
    return 1 if result.violations else 0


def cmd_replay(args: argparse.Namespace) -> int:
    if args.plot is not None:
        if len(args.files) != 1:
            raise ValueError("replay --plot draws one trace: give one file")
        from sim import plot
        plot.check_matplotlib()
    status = 0
    for name in args.files:
        trace = load(name)
        result = run_trace(trace, "replay" if trace.expects else "check", timeline=args.plot is not None)
        if args.plot is not None:
            fig = plot.plot_run(trace, result, source=Path(name).name)
            print(f"{name}: picture written to {plot.save(fig, args.plot)}")
        if result.mismatch is not None:
            print(f"{name}: MISMATCH at step {result.mismatch_step}: {result.mismatch}")
            status = 1
        for v in result.violations[:MAX_PRINTED_VIOLATIONS]:
            print(f"{name}: VIOLATION {v}")
        if result.violations:
            status = 1
        if result.ok:
            what = (f"all {result.steps} steps match" if trace.expects
                    else f"{result.steps} steps, no expectations; checks pass")
            print(f"{name}: OK, {what}")
    return status


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    config_help = ("force config values of generated traces: key=value pairs or a JSON object "
                   f"(repeatable); keys: {', '.join(sorted(OVERRIDE_KEYS))}")

    r = sub.add_parser("run", help="run random traces through the engine and check every step")
    r.add_argument("--traces", type=int, default=1000, help="number of traces (default 1000)")
    r.add_argument("--seed", type=int, default=0, help=f"run seed; trace i uses seed*{SEED_STRIDE}+i")
    r.add_argument("--config", action="append", default=[], metavar="KEY=VALUE|JSON", help=config_help)
    r.add_argument("--out-dir", default="sim_failures", help="where failing traces are saved")
    r.add_argument("--max-failures", type=int, default=10, help="stop after this many failing traces")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument("--jobs", type=int, default=1,
                   help="worker processes the traces are spread over (default 1; the totals do not depend on it)")
    r.add_argument("--plot", metavar="DIR", default=None,
                   help=f"write figures (needs matplotlib): DIR/summary.png, the first {PLOTTED_TRACES} "
                        "traces' DIR/trace-<seed>.png, a failing trace's next to its JSONL")
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("record", help="run one trace and save it with the engine's decisions per step")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--seed", type=int, help="generate the trace from this (trace) seed")
    src.add_argument("--trace", help="record an existing JSONL trace's inputs instead")
    c.add_argument("--config", action="append", default=[], metavar="KEY=VALUE|JSON", help=config_help)
    c.add_argument("--out", required=True, help="output JSONL file")
    c.set_defaults(func=cmd_record)

    p_replay = sub.add_parser("replay", help="re-run recorded traces; report the first step that differs")
    p_replay.add_argument("files", nargs="+", help="JSONL trace files")
    p_replay.add_argument("--plot", metavar="OUT.png", default=None,
                          help="draw the (one) trace's run, marking the first step that differs")
    p_replay.set_defaults(func=cmd_replay)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
