"""Pictures of what the scheduler did (``python -m sim run|replay ... --plot``).

``plot_timeline`` draws one trace run: steps on the x-axis, five stacked panels
whose data are the run's ``TimelineStep`` records (the engine's own per-step
records, ``sim.runner``):

- ``blocks``: KV blocks in use, free but cached (hittable), free (stacked to the pool);
- ``sequences``: running and waiting sequences after each step;
- ``tokens``: tokens computed per step, split into prefill, chunked prefill and
  decode (stacked), against the token budget;
- ``events``: preemptions, aborts and finishes (markers at the step, height = count);
- ``prefix_hits``: prompt tokens served by the prefix cache.

A replay overlays the trace's recorded decisions (dashed) and marks the first
step that differs; a run with a violation marks the step of the first one.
``plot_summary`` draws distributions over many traces.

matplotlib (the ``plot`` extra) is imported inside the functions: importing this
module, or the simulator, needs none. Figures are ``matplotlib.figure.Figure``
objects drawn without pyplot (no global state, no display needed).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from sim.runner import RunResult, TimelineStep
from sim.traces import ExpectEvent, Trace

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# The panels of a trace figure, top to bottom (each axes' label), their titles and y units.
PANELS = ("blocks", "sequences", "tokens", "events", "prefix_hits")
PANEL_TITLES = {"blocks": "KV blocks", "sequences": "running and waiting sequences after each step",
                "tokens": "tokens computed per step", "events": "preemptions, aborts and finishes",
                "prefix_hits": "prompt tokens served by the prefix cache"}
PANEL_UNITS = {"blocks": "KV blocks", "sequences": "sequences", "tokens": "tokens", "events": "sequences",
               "prefix_hits": "tokens"}
SUMMARY_PANELS = ("steps", "preemptions", "prefix_hit_share")
# The stacked series of the blocks and tokens panels (each artist's label), bottom first.
BLOCK_SERIES = ("in use", "cached, free", "free")
TOKEN_SERIES = ("prefill", "chunked prefill", "decode")
EVENT_SERIES = ("preempted", "aborted", "finished")
COLORS = {"in use": "#4c72b0", "cached, free": "#55a868", "free": "#dddddd",
          "prefill": "#dd8452", "chunked prefill": "#f2c45a", "decode": "#4c72b0",
          "running": "#4c72b0", "waiting": "#c44e52", "preempted": "#c44e52", "aborted": "#8172b3",
          "finished": "#55a868", "prefix hits": "#55a868"}
MARKERS = {"preempted": "v", "aborted": "x", "finished": "o"}
# Event markers sit this far right of their step, so that kinds with equal counts stay apart.
EVENT_OFFSETS = {"preempted": -0.2, "aborted": 0.0, "finished": 0.2}
MISSING_MATPLOTLIB = "plotting needs matplotlib: pip install -e '.[plot]'"


@dataclass(frozen=True)
class Mark:
    """A step to point at (a replay's first differing step, a first violation)."""

    step: int
    label: str


def check_matplotlib() -> None:
    """Raise ``ImportError`` saying how to install matplotlib if it is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError(MISSING_MATPLOTLIB)


def new_figure(**kwargs: object) -> "Figure":
    """A matplotlib ``Figure`` without pyplot (``ImportError`` naming the extra if matplotlib is missing)."""
    check_matplotlib()
    from matplotlib.figure import Figure
    return Figure(**kwargs)  # type: ignore[arg-type]


def _column(timeline: Sequence[TimelineStep], name: str) -> np.ndarray:
    return np.array([getattr(t, name) for t in timeline], dtype=np.int64)


def _stack(ax: "Axes", edges: np.ndarray, series: dict[str, np.ndarray]) -> None:
    """Filled stairs, each on top of the ones before (label = series name)."""
    bottom = np.zeros(len(edges) - 1, dtype=np.int64)
    for label, values in series.items():
        ax.stairs(bottom + values, edges, baseline=bottom, fill=True, label=label, color=COLORS[label])
        bottom = bottom + values


def _draw_steps(axes: dict[str, "Axes"], timeline: Sequence[TimelineStep]) -> None:
    """The run's series on the five panels; step i spans [i - 0.5, i + 0.5]."""
    col = {f.name: _column(timeline, f.name) for f in dataclasses.fields(TimelineStep)}
    steps = col["step"]
    edges = np.append(steps, steps[-1] + 1) - 0.5
    _stack(axes["blocks"], edges, dict(zip(BLOCK_SERIES, (col["used_blocks"], col["cached_free_blocks"],
                                                          col["uncached_free_blocks"]))))
    for label in ("running", "waiting"):
        axes["sequences"].stairs(col[label], edges, baseline=None, label=label, color=COLORS[label], linewidth=1.5)
    _stack(axes["tokens"], edges, dict(zip(TOKEN_SERIES, (col["prefill_tokens"], col["chunked_tokens"],
                                                          col["decode_tokens"]))))
    for label in EVENT_SERIES:
        at = col[label] > 0
        axes["events"].scatter(steps[at] + EVENT_OFFSETS[label], col[label][at], marker=MARKERS[label],
                               color=COLORS[label], label=label, s=30)
    most = max(int(col[label].max()) for label in EVENT_SERIES)
    axes["events"].set_ylim(0, most + 1)
    axes["prefix_hits"].stairs(col["cached_tokens"], edges, fill=True, label="prefix hits",
                               color=COLORS["prefix hits"])


def plot_timeline(timeline: Sequence[TimelineStep], num_blocks: int, budget: int, title: str = "",
                  recorded: Sequence[ExpectEvent] = (), marks: Sequence[Mark] = ()) -> "Figure":
    """One trace run as five stacked panels (module docstring).

    Args:
        timeline: the run's steps, consecutive from its first (none: empty panels).
        num_blocks: the KV pool; budget: ``max_num_batched_tokens``.
        recorded: a replayed trace's expect events, drawn dashed over the run's
            blocks in use and tokens per step.
        marks: steps to mark with a vertical line on every panel.
    """
    fig = new_figure(figsize=(13, 11), layout="constrained")
    from matplotlib.ticker import MaxNLocator
    axes = dict(zip(PANELS, fig.subplots(len(PANELS), 1, sharex=True)))
    if timeline:
        _draw_steps(axes, timeline)
    axes["tokens"].axhline(budget, color="black", linestyle=":", linewidth=1, label=f"budget {budget}")
    if recorded:
        _overlay(axes["blocks"], axes["tokens"], recorded, num_blocks)
    for mark in marks:
        for name, ax in axes.items():
            ax.axvline(mark.step, color="red", linewidth=1.2, label=mark.label if name == "blocks" else None)
    titles = dict(PANEL_TITLES, blocks=f"KV blocks (pool {num_blocks})")
    most = max((t.prefill_tokens + t.chunked_tokens + t.decode_tokens for t in timeline), default=0)
    if budget > 2 * most:  # a budget far above the work would flatten it: leave the line off the scale
        titles["tokens"] += f" (budget {budget}, above the panel)"
        axes["tokens"].set_ylim(0, max(most, 1) * 1.15)
    for name, ax in axes.items():
        ax.set_label(name)
        ax.set(ylabel=PANEL_UNITS[name], title=titles[name])
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, max(ax.get_ylim()[1], 1))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1), fontsize="small")
    axes["blocks"].set_ylim(0, max(num_blocks, 1) * 1.02)
    axes["prefix_hits"].set_xlabel("step")
    axes["prefix_hits"].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title or f"{len(timeline)} steps")
    return fig


def _overlay(blocks: "Axes", tokens: "Axes", recorded: Sequence[ExpectEvent], num_blocks: int) -> None:
    """The trace's recorded blocks in use and tokens per step, dashed (where they differ from
    the run, the run's fills show through)."""
    rec = sorted(recorded, key=lambda e: e.step)
    x = np.array([e.step for e in rec])
    edges = np.append(x, x[-1] + 1) - 0.5
    used = np.array([num_blocks - e.free_blocks for e in rec])
    blocks.stairs(used, edges, baseline=None, color="black", linestyle="--", linewidth=1,
                  label="recorded in use")
    if rec[0].prefill_tokens is not None:
        total = np.array([(e.prefill_tokens or 0) + (e.decode_tokens or 0) for e in rec])
        tokens.stairs(total, edges, baseline=None, color="black", linestyle="--", linewidth=1,
                      label="recorded total")


def plot_run(trace: Trace, result: RunResult, source: str = "") -> "Figure":
    """``plot_timeline`` of a run of ``trace`` made with ``timeline=True``: a replay's
    expectations overlaid and its first differing step marked, a first violation marked.
    ``source`` names the trace in the title (default: its seed)."""
    if result.timeline is None:
        raise ValueError("plot_run needs a run made with timeline=True")
    marks = []
    if result.mismatch_step is not None:
        marks.append(Mark(result.mismatch_step, f"first differing step {result.mismatch_step}"))
    if result.violation_step is not None:
        marks.append(Mark(result.violation_step, f"first violation, step {result.violation_step}"))
    cfg = trace.scheduler
    source = source or (f"trace seed {trace.seed}" if trace.fake_model == "hash" else "recorded trace")
    title = (f"{source}: {cfg.policy}, {'async' if cfg.async_scheduling else 'sync'}, "
             f"block size {trace.cache.block_size}, {cfg.max_num_seqs} seats, {result.requests} requests, "
             f"{result.steps} steps")
    return plot_timeline(result.timeline, trace.num_blocks, cfg.max_num_batched_tokens, title,
                         trace.expects, marks)


def save(fig: "Figure", path: str | Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (creating its folder); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def plot_summary(steps: Sequence[int], preemptions: Sequence[int], hit_share: Sequence[float],
                 title: str = "") -> "Figure":
    """Distributions over traces: steps per trace, preemptions per trace, and the share of
    prompt work served by the prefix cache (traces with prompt work only; NaN = none).

    Each panel is a histogram whose bar heights add up to the traces it counts.
    """
    fig = new_figure(figsize=(12, 3.8), layout="constrained")
    axes = fig.subplots(1, len(SUMMARY_PANELS))
    shares = np.asarray(hit_share, dtype=np.float64)
    shares = 100 * shares[~np.isnan(shares)]
    data = {"steps": (np.asarray(steps), "steps per trace"),
            "preemptions": (np.asarray(preemptions), "preemptions per trace"),
            "prefix_hit_share": (shares, "prefix-cache share of prompt work (%)")}
    for ax, name in zip(axes, SUMMARY_PANELS):
        values, xlabel = data[name]
        ax.set_label(name)
        if name == "preemptions" and len(values):
            bins: int | np.ndarray = np.arange(values.max() + 2) - 0.5 if values.max() < 40 else 40
        else:
            bins = 40
        ax.hist(values, bins=bins, color="#4c72b0")
        ax.set(xlabel=xlabel, ylabel="traces", title=f"{name.replace('_', ' ')} ({len(values)} traces)")
    if title:
        fig.suptitle(title)
    return fig
