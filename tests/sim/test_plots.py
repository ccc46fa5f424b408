"""Pictures of trace runs (sim/plot.py, python -m sim ... --plot), checked without eyes: the
files exist, the figures have their named panels, and the data behind every panel is the
engine's per-step records. The benchmarks' pictures: tests/benchmarks/test_plots.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from minivllm.engine.llm_engine import LLMEngine  # noqa: E402
from minivllm.engine.trace import Trace  # noqa: E402
from sim import plot  # noqa: E402
from sim.__main__ import main as sim_main  # noqa: E402
from sim.fake_executor import FakeExecutor  # noqa: E402
from sim.grammar import FakeGrammarBackend  # noqa: E402
from sim.oracle import FakeTextStream  # noqa: E402
from sim.runner import RunResult, run_trace  # noqa: E402
from sim.traces import generate_trace  # noqa: E402
from tests.sim.test_record_trace import feed_inputs  # noqa: E402

# A trace with preemptions, chunked prefills, aborts and prefix hits (asserted below).
SEED = 50
ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def recorded() -> tuple[Trace, RunResult]:
    trace = generate_trace(SEED)
    result = run_trace(trace, "record", timeline=True)
    assert result.ok, result.violations
    return trace.with_expects(result.expects), result


def column(result: RunResult, name: str) -> np.ndarray:
    assert result.timeline is not None
    return np.array([getattr(t, name) for t in result.timeline])


# ---- the timeline is the engine's own records --------------------------------------

def test_the_trace_shows_every_kind_of_decision(recorded) -> None:
    _, r = recorded
    assert r.preemptions > 0 and r.chunked_prefills > 0 and r.aborts > 0 and r.cached_tokens > 0
    assert column(r, "chunked_tokens").sum() > 0 and column(r, "cached_free_blocks").max() > 0


def test_timeline_equals_the_engines_records_step_by_step(recorded) -> None:
    """Drive a fresh engine over the same inputs here and compare every step's records, the
    queues and the pool with the runner's timeline."""
    trace, r = recorded
    engine = LLMEngine(trace.scheduler, trace.cache,
                       FakeExecutor(trace.vocab_size, trace.cache.block_size, trace.executor_num_blocks),
                       eos_token_id=trace.eos_token_id, text_streams=FakeTextStream,
                       grammar_backend=FakeGrammarBackend(trace.vocab_size, trace.eos_token_id))
    bm = engine.scheduler.block_manager
    assert r.timeline is not None and len(r.timeline) == r.steps == len(trace.expects)
    for t, expect in zip(r.timeline, trace.expects):
        feed_inputs(engine, trace, t.step)
        engine.step()
        rec = engine.last_step
        assert rec is not None and t.step == expect.step
        cached_free = sum(bm.block_hash[b] is not None for b in bm.free_blocks)
        reasons = list(rec.finish_reasons.values())
        assert (t.prefill_tokens + t.chunked_tokens, t.chunked_tokens, t.decode_tokens) == (
            rec.num_prefill_tokens, rec.num_chunked_tokens, rec.num_decode_tokens)
        assert t.prefill_tokens + t.chunked_tokens + t.decode_tokens == sum(rec.scheduled.values())
        assert (t.running, t.waiting) == (len(engine.scheduler.running), len(engine.scheduler.waiting))
        assert (t.used_blocks, t.cached_free_blocks, t.uncached_free_blocks) == (
            bm.num_blocks - bm.num_free_blocks, cached_free, bm.num_free_blocks - cached_free)
        assert (t.preempted, t.aborted, t.finished) == (
            len(rec.preempted), reasons.count("abort"), len(reasons) - reasons.count("abort"))
        assert t.cached_tokens == rec.num_cached_tokens
        assert (expect.free_blocks, len(expect.preempted)) == (t.cached_free_blocks + t.uncached_free_blocks,
                                                               t.preempted)
    # The step counters add up to the engine's totals.
    s = engine.stats
    assert column(r, "cached_tokens").sum() == s.num_cached_tokens == r.cached_tokens
    assert column(r, "preempted").sum() == s.num_preemptions
    assert (column(r, "prefill_tokens") + column(r, "chunked_tokens")).sum() == s.num_prefill_tokens
    assert (column(r, "finished") + column(r, "aborted")).sum() == len(r.outputs)


# ---- the figure -------------------------------------------------------------------

def panels(fig: Any) -> dict[str, Any]:
    return {ax.get_label(): ax for ax in fig.axes}


def stairs(ax: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each stairs artist's (own values, edges): a stacked one's values less its baseline."""
    out = {}
    for p in ax.patches:
        if type(p).__name__ == "StepPatch":
            values, edges, baseline = p.get_data()
            out[p.get_label()] = (np.asarray(values) - (0 if baseline is None else np.asarray(baseline)), edges)
    return out


def marks(ax: Any) -> list[float]:
    """The x of every vertical line (``axvline``) of an axes."""
    return [line.get_xdata()[0] for line in ax.lines
            if len(set(line.get_xdata())) == 1 and line.get_transform() != ax.transData]


def test_figure_panels_hold_the_timeline(recorded, tmp_path: Path) -> None:
    trace, r = recorded
    fig = plot.plot_run(trace, r)
    ax = panels(fig)
    assert list(ax) == list(plot.PANELS)
    n, steps = r.steps, column(r, "step")
    expected = {
        "blocks": {"in use": "used_blocks", "cached, free": "cached_free_blocks", "free": "uncached_free_blocks"},
        "sequences": {"running": "running", "waiting": "waiting"},
        "tokens": {"prefill": "prefill_tokens", "chunked prefill": "chunked_tokens", "decode": "decode_tokens"},
        "prefix_hits": {"prefix hits": "cached_tokens"},
    }
    for panel, series in expected.items():
        drawn = stairs(ax[panel])
        for label, field in series.items():
            values, edges = drawn[label]
            assert len(values) == n and np.array_equal(values, column(r, field)), (panel, label)
            assert np.array_equal(edges, np.append(steps, n) - 0.5)
    # The recorded decisions overlaid (a replay's expectations), equal to the run here.
    assert np.array_equal(stairs(ax["blocks"])["recorded in use"][0], column(r, "used_blocks"))
    total = column(r, "prefill_tokens") + column(r, "chunked_tokens") + column(r, "decode_tokens")
    assert np.array_equal(stairs(ax["tokens"])["recorded total"][0], total)
    budget = [line for line in ax["tokens"].lines if line.get_label().startswith("budget")]
    assert len(budget) == 1 and set(budget[0].get_ydata()) == {trace.scheduler.max_num_batched_tokens}
    scatter = {c.get_label(): c.get_offsets() for c in ax["events"].collections}
    for label in plot.EVENT_SERIES:
        counts = column(r, label)
        xy = np.asarray(scatter[label])
        assert len(xy) == (counts > 0).sum() and len(xy) > 0, label
        assert np.array_equal(xy[:, 0] - plot.EVENT_OFFSETS[label], steps[counts > 0])
        assert np.array_equal(xy[:, 1], counts[counts > 0])
    assert all(marks(a) == [] for a in fig.axes)  # nothing differs, nothing violated
    path = plot.save(fig, tmp_path / "sub" / "run.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_replay_that_diverges_marks_the_first_differing_step(recorded, tmp_path: Path) -> None:
    trace, _ = recorded
    k = 20
    bad = [dataclasses.replace(e, free_blocks=e.free_blocks + 1) if e.step == k else e for e in trace.expects]
    altered = trace.with_expects(bad)
    result = run_trace(altered, "replay", timeline=True)
    assert result.mismatch_step == k and not result.violations
    assert result.timeline is not None and len(result.timeline) == result.steps  # the run goes on to its end
    fig = plot.plot_run(altered, result)
    assert all(marks(a) == [k] for a in fig.axes)
    assert f"first differing step {k}" in panels(fig)["blocks"].get_legend_handles_labels()[1]
    # The same through the command line: exit 1, and the picture.
    path = altered.save(tmp_path / "altered.jsonl")
    out = tmp_path / "altered.png"
    assert sim_main(["replay", str(path), "--plot", str(out)]) == 1
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert sim_main(["replay", str(path), str(path), "--plot", str(out)]) == 2  # one trace per picture


def test_simulator_runs_without_matplotlib() -> None:
    """Plotting is the only thing that imports matplotlib: the simulator never does."""
    script = ("import sys; import sim.__main__ as m; import sim.plot; "
              "assert m.main(['run', '--traces', '3', '--quiet']) == 0; "
              "assert 'matplotlib' not in sys.modules, 'matplotlib imported'")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_empty_run_draws_empty_panels() -> None:
    trace = dataclasses.replace(generate_trace(1), events=())
    result = run_trace(trace, timeline=True)
    assert result.steps == 0
    fig = plot.plot_run(trace, result)
    assert list(panels(fig)) == list(plot.PANELS) and stairs(panels(fig)["blocks"]) == {}


def test_run_cli_writes_summary_trace_and_failing_trace_pictures(tmp_path: Path, monkeypatch) -> None:
    figs, failures = tmp_path / "figs", tmp_path / "failing"
    assert sim_main(["run", "--traces", "2", "--seed", "0", "--quiet", "--plot", str(figs),
                     "--out-dir", str(failures)]) == 0
    assert sorted(p.name for p in figs.iterdir()) == ["summary.png", "trace-0.png", "trace-1.png"]
    assert not failures.exists()

    # A failing trace: its JSONL and its picture (the first violation marked) side by side.
    import sim.__main__ as cli
    real = cli.run_trace

    def failing(trace: Trace, *args: Any, **kwargs: Any) -> RunResult:
        result = real(trace, *args, **kwargs)
        result.violations.append("step 3: injected")
        result.violation_step = 3
        return result

    monkeypatch.setattr(cli, "run_trace", failing)
    drawn = []
    monkeypatch.setattr(plot, "save", lambda fig, path: drawn.append((fig, path)) or Path(path))
    last = cli.PLOTTED_TRACES  # the first trace run without a timeline: re-run for its picture
    assert sim_main(["run", "--traces", str(last + 1), "--seed", "0", "--quiet", "--plot", str(figs),
                     "--out-dir", str(failures), "--max-failures", "100"]) == 1
    pictures = {Path(p): fig for fig, p in drawn}
    assert (failures / f"trace-{last}.jsonl").exists()
    assert all(marks(a) == [3] for a in pictures[failures / f"trace-{last}.png"].axes)
    assert figs / "summary.png" in pictures and figs / "trace-0.png" in pictures


def test_summary_histograms_count_every_trace() -> None:
    steps, preemptions = [5, 7, 7, 30, 120], [0, 0, 3, 1, 0]
    shares = [0.0, 0.5, float("nan"), 0.25, 1.0]
    fig = plot.plot_summary(steps, preemptions, shares)
    ax = panels(fig)
    assert list(ax) == list(plot.SUMMARY_PANELS)
    counts = {name: sum(p.get_height() for p in a.patches) for name, a in ax.items()}
    assert counts == {"steps": 5, "preemptions": 5, "prefix_hit_share": 4}  # NaN: no prompt work
    heights = [p.get_height() for p in ax["preemptions"].patches]
    assert heights == [3, 1, 0, 1]  # one bar per count 0..3
