"""Figures of the benchmarks' JSON summaries, written as PNGs next to them.

    python -m benchmarks.plots DIR     # DIR: the summaries' folder (make bench: bench-results/ or $OUT)

Each benchmark draws its own figure when it writes its summary (``benchmarks.report.write_summary``);
this draws them again, e.g. where matplotlib was missing.

For each summary it knows in DIR it writes ``<name>.png`` beside ``<name>.json``:

- ``decode_attention``: paged decode-attention bandwidth per (batch, context),
  eager and CUDA graph, against the copy bandwidth (the ceiling). Layout:
  ``{"copy_gbs": float, "rows": [{"batch", "context", "splits", "bytes",
  "eager_us", "graph_us"}]}``, the rows of ``benchmarks/decode_attention.py``'s
  table;
- ``throughput`` (and ``throughput_tpN``): offline tok/s of HF ``generate`` and
  of minivllm per scheduling mode, and batch-1 ms/token (``benchmarks/throughput.py``);
- ``serving``: TTFT and TPOT p50 / p99 and output tok/s against the request rate,
  with the offline ``generate()`` rate (``benchmarks/serving.py``);
- ``all_reduce``: µs per tensor-parallel all-reduce against the message size, NCCL
  and the symmetric-memory kernels (``benchmarks/all_reduce.py``).

and, across files, ``tp_scaling.png`` when DIR holds throughput summaries of one
shapes at several ``--tensor-parallel-size``: offline tok/s and batch-1 ms/token
per TP size, grouped by shapes, with the all-reduce share of a decode step; or,
with one TP size and several shapes, the same bars as ``throughput_by_shapes.png``.

Needs matplotlib (the ``plot`` extra), imported only when a figure is drawn; no torch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MODES = ("async off", "async on")


def _bar_labels(ax: Any, bars: Any, fmt: str) -> None:
    ax.bar_label(bars, labels=[fmt.format(b.get_height()) for b in bars], fontsize="small", padding=2)


def plot_decode_attention(data: dict[str, Any]) -> "Figure":
    """Bandwidth (GB/s) of each (batch, context), eager and CUDA graph, with the copy ceiling."""
    from sim.plot import new_figure

    rows, copy = data["rows"], float(data["copy_gbs"])
    fig = new_figure(figsize=(9, 4.5), layout="constrained")
    ax = fig.subplots()
    ax.set_label("bandwidth")
    x = list(range(len(rows)))
    width = 0.38
    for k, (key, label) in enumerate((("eager_us", "eager"), ("graph_us", "CUDA graph"))):
        gbs = [r["bytes"] / (r[key] * 1e-6) / 1e9 for r in rows]
        bars = ax.bar([i + (k - 0.5) * width for i in x], gbs, width, label=label)
        ax.bar_label(bars, labels=[f"{100 * g / copy:.0f}%" for g in gbs], fontsize="small", padding=2)
    ax.axhline(copy, color="black", linestyle="--", linewidth=1, label=f"copy {copy:,.0f} GB/s")
    ax.set_xticks(x, [f"batch {r['batch']}\nctx {r['context']}" for r in rows])
    ax.set(ylabel="GB/s (K/V, q, out, tables read or written)", ylim=(0, copy * 1.3),
           title="paged decode attention vs copy bandwidth (labels: % of copy)")
    ax.legend(loc="upper center", ncols=3, fontsize="small")  # above the bars, clear of them
    return fig


def plot_throughput(data: dict[str, Any]) -> "Figure":
    """Offline tok/s of HF and minivllm (each mode), and minivllm's batch-1 ms/token."""
    from sim.plot import new_figure

    fig = new_figure(figsize=(10, 4.2), layout="constrained")
    tput, batch1 = fig.subplots(1, 2, width_ratios=(3, 2))
    tput.set_label("throughput")
    batch1.set_label("batch1")
    mv, hf = data.get("minivllm", {}), data.get("hf", {})
    names, values = [], []
    if "tok_s" in hf:
        names.append(f"HF generate\n({hf.get('requests', '?')} requests)")
        values.append(hf["tok_s"])
    modes = [m for m in MODES if m in mv]
    for m in modes:
        names.append(f"minivllm\n{m}")
        values.append(mv[m]["offline"]["tok_s"])
    bars = tput.bar(names, values, color=["#999999"] * ("tok_s" in hf) + ["#4c72b0"] * len(modes))
    _bar_labels(tput, bars, "{:,.0f}")
    ratio = data.get("ratio_minivllm_hf")
    shapes = data.get("args", {}).get("shapes")
    tput.set(ylabel="completion tokens / s",
             title=f"{data.get('workload', 'offline')}" + (f" [{shapes}]" if shapes else "")
             + (f": {ratio:.1f}x HF" if ratio else ""))
    ms = [mv[m]["batch1"]["ms_per_token"] for m in modes]
    bars = batch1.bar([f"minivllm\n{m}" for m in modes], ms, color="#55a868")
    _bar_labels(batch1, bars, "{:.2f}")
    batch1.set(ylabel="ms / token", title="batch-1 decode")
    return fig


def plot_serving(data: dict[str, Any]) -> "Figure":
    """TTFT and TPOT percentiles and output tok/s against the request rate (``inf``: all at once)."""
    from sim.plot import new_figure

    rows = data["rates"]
    labels = [str(r["rate"]) for r in rows]
    x = list(range(len(rows)))
    fig = new_figure(figsize=(13, 4.2), layout="constrained")
    axes = fig.subplots(1, 3)
    for ax, key, title in ((axes[0], "ttft_ms", "time to first token"),
                           (axes[1], "tpot_ms", "time per output token")):
        ax.set_label(key.removesuffix("_ms"))
        for pct, style in (("p50", "o-"), ("p99", "s--")):
            ys = [math.nan if r[key][pct] is None else r[key][pct] for r in rows]
            ax.plot(x, ys, style, label=pct)
        ax.set(ylabel="ms", title=title, xlabel="request rate (req/s)")
        ax.set_xticks(x, labels)
        ax.legend(fontsize="small")
    tok = axes[2]
    tok.set_label("output_tok_s")
    tok.plot(x, [r["output_tok_s"] for r in rows], "o-", label="server")
    offline = data.get("offline", {}).get("tok_s")
    if offline is not None:
        tok.axhline(offline, color="black", linestyle="--", linewidth=1, label="offline generate()")
    tok.set(ylabel="output tokens / s", title="throughput", xlabel="request rate (req/s)", ylim=(0, None))
    tok.set_xticks(x, labels)
    tok.legend(fontsize="small")
    return fig


def plot_all_reduce(data: dict[str, Any]) -> "Figure":
    """µs per all-reduce against the message size: NCCL and the one- and two-shot kernels."""
    from sim.plot import new_figure

    rows = data["rows"]
    kb = [r["kb"] for r in rows]
    fig = new_figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.subplots()
    ax.set_label("latency")
    ax.plot(kb, [r["nccl_us"] for r in rows], "o-", label="NCCL", color="#4c72b0")
    if all("one_shot_us" in r for r in rows):
        ax.plot(kb, [r["one_shot_us"] for r in rows], "s-", label="one-shot (symmetric memory)", color="#dd8452")
    if all("two_shot_us" in r for r in rows):
        ax.plot(kb, [r["two_shot_us"] for r in rows], "^-", label="two-shot (symmetric memory)", color="#55a868")
    a = data.get("args", {})
    ax.set(xscale="log", xlabel="message (KB)", ylabel="µs per all-reduce (in a CUDA graph)", ylim=(0, None),
           title=f"all-reduce over {a.get('world_size', '?')} GPUs, {a.get('dtype', '')}")
    ax.legend(loc="upper left", fontsize="small")
    return fig


PLOTTERS: dict[str, Callable[[dict[str, Any]], "Figure"]] = {
    "all_reduce": plot_all_reduce,
    "decode_attention": plot_decode_attention,
    "throughput": plot_throughput,
    "serving": plot_serving,
}


def plot_tp_scaling(summaries: list[dict[str, Any]]) -> "Figure":
    """Offline tok/s and batch-1 ms/token per (shapes, TP size), from throughput summaries
    (async on where present); each TP > 1 bar is labelled with its ratio to TP=1 and the
    all-reduce share of a batch-1 decode step."""
    from sim.plot import new_figure

    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for d in summaries:
        args, mv = d.get("args", {}), d.get("minivllm", {})
        mode = next((m for m in ("async on", "async off") if m in mv), None)
        if mode is not None:
            runs.setdefault(args.get("shapes", "?"), {})[int(args.get("tensor_parallel_size", 1))] = dict(
                mv[mode], allreduce=mv.get("decode_kernels", {}).get("allreduce_share"))
    fig = new_figure(figsize=(10, 4.2), layout="constrained")
    tput, batch1 = fig.subplots(1, 2)
    tput.set_label("throughput")
    batch1.set_label("batch1")
    sizes = sorted({tp for by_tp in runs.values() for tp in by_tp})
    width = 0.8 / max(1, len(sizes))
    for i, tp in enumerate(sizes):
        shapes = [s for s in runs if tp in runs[s]]
        xs = [list(runs).index(s) + i * width for s in shapes]
        for ax, key, fmt in ((tput, ("offline", "tok_s"), "{:,.0f}"), (batch1, ("batch1", "ms_per_token"), "{:.2f}")):
            values = [runs[s][tp][key[0]][key[1]] for s in shapes]
            bars = ax.bar(xs, values, width, label=f"TP={tp}")
            labels = []
            for s, v in zip(shapes, values):
                base = runs[s].get(1)
                text = fmt.format(v)
                if tp != 1 and base is not None:
                    text += f"\n{v / base[key[0]][key[1]]:.2f}x"
                    if ax is batch1 and runs[s][tp]["allreduce"] is not None:
                        text += f"\nAR {100 * runs[s][tp]['allreduce']:.0f}%"
                labels.append(text)
            ax.bar_label(bars, labels=labels, fontsize="small", padding=2)
    for ax, ylabel, title in ((tput, "completion tokens / s", "offline-256"),
                              (batch1, "ms / token", "batch-1 decode (AR: all-reduce share)")):
        ax.set_xticks([j + width * (len(sizes) - 1) / 2 for j in range(len(runs))], list(runs))
        ax.set(ylabel=ylabel, title=title)
        ax.margins(y=0.25)
        ax.legend()
    return fig


def plotter_for(path: Path) -> Callable[[dict[str, Any]], "Figure"] | None:
    """The plotter of a summary file (``throughput_tp2.json``, ``throughput_llama-3.2-1b.json``
    are throughput summaries, ``serving_engine_process.json`` a serving one), or None."""
    stem = path.stem
    for family in ("throughput", "serving"):  # throughput_tp2, serving_engine_process, ...
        if stem.startswith(family + "_"):
            stem = family
    return PLOTTERS.get(stem)


def plot_file(path: str | Path) -> Path | None:
    """Write ``<name>.png`` beside the summary ``<name>.json``; None for a summary without a
    plotter. Raises ``ImportError`` (naming the ``plot`` extra) without matplotlib."""
    from sim.plot import save

    path = Path(path)
    plotter = plotter_for(path)
    if plotter is None:
        return None
    with open(path) as f:
        return save(plotter(json.load(f)), path.with_suffix(".png"))


def figure_beside(path: str | Path) -> None:
    """What a benchmark calls after writing its summary: ``plot_file``, saying what it
    wrote, or, without matplotlib (the GPU machine may lack it), how to draw it later."""
    try:
        png = plot_file(path)
    except ImportError as e:
        print(f"no figure ({e}); `python -m benchmarks.plots {Path(path).parent}` draws it later")
    else:
        if png is not None:
            print(f"figure written to {png}")


def plot_dir(directory: str | Path) -> list[Path]:
    """Write ``<name>.png`` beside each known ``<name>.json`` in ``directory``; the PNGs written."""
    from sim.plot import save

    written = [png for path in sorted(Path(directory).glob("*.json")) if (png := plot_file(path))]
    summaries = []
    for path in sorted(Path(directory).glob("throughput*.json")):
        with open(path) as f:
            summaries.append(json.load(f))
    tp_sizes = {int(d.get("args", {}).get("tensor_parallel_size", 1)) for d in summaries}
    shapes = {d.get("args", {}).get("shapes") for d in summaries}
    if len(tp_sizes) > 1:
        written.append(save(plot_tp_scaling(summaries), Path(directory) / "tp_scaling.png"))
    elif len(shapes) > 1:  # one TP size, several models: the same bars, grouped by shapes
        written.append(save(plot_tp_scaling(summaries), Path(directory) / "throughput_by_shapes.png"))
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("directory", help="the benchmarks' $OUT folder (holds <name>.json)")
    args = ap.parse_args(argv)
    try:
        written = plot_dir(args.directory)
    except (ImportError, OSError, KeyError, ValueError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    if not written:
        print(f"no benchmark summary in {args.directory} ({', '.join(PLOTTERS)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
