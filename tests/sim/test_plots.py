"""Pictures of trace runs (sim/plot.py, python -m sim ... --plot) and of the benchmarks'
summaries (benchmarks/plots.py), checked without eyes: the files exist, the figures have
their named panels, and the data behind every panel is the engine's per-step records."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from benchmarks import plots as bench_plots  # noqa: E402
from minivllm.engine.llm_engine import LLMEngine  # noqa: E402
from sim import plot  # noqa: E402
from sim.__main__ import main as sim_main  # noqa: E402
from sim.fake_executor import FakeExecutor  # noqa: E402
from sim.grammar import FakeGrammarBackend  # noqa: E402
from sim.oracle import FakeTextStream  # noqa: E402
from sim.runner import RunResult, run_trace  # noqa: E402
from sim.traces import Trace, generate_trace  # noqa: E402
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


# ---- benchmarks ---------------------------------------------------------------------

def pct(p50: float | None, p99: float | None) -> dict[str, float | None]:
    """A percentile entry of serving.py's summary (None where no request gave a value)."""
    return {"p50": p50, "p99": p99, "mean": None if p50 is None or p99 is None else (p50 + p99) / 2}


SUMMARIES: dict[str, dict[str, Any]] = {
    "decode_attention": {"copy_gbs": 4221.0, "rows": [
        {"batch": 64, "context": 1024, "splits": 1, "bytes": 270_000_000, "eager_us": 76.5, "graph_us": 64.4},
        {"batch": 8, "context": 8192, "splits": 8, "bytes": 268_000_000, "eager_us": 79.6, "graph_us": 66.5}]},
    "throughput": {"workload": "offline-256", "hf": {"requests": 32, "tok_s": 1025.0},
                   "minivllm": {"kv_blocks": 9000,
                                "async on": {"offline": {"tok_s": 16200.0}, "batch1": {"ms_per_token": 2.2}},
                                "async off": {"offline": {"tok_s": 14900.0}, "batch1": {"ms_per_token": 2.5}}},
                   "ratio_minivllm_hf": 15.8},
    "serving": {"rates": [{"rate": "8", "ttft_ms": pct(30, 80), "tpot_ms": pct(8, 12), "output_tok_s": 4000.0},
                          {"rate": "inf", "ttft_ms": pct(900, 2500), "tpot_ms": pct(None, None),
                           "output_tok_s": 7500.0}],
                "offline": {"tok_s": 15500.0}},
    "all_reduce": {"args": {"world_size": 2, "dtype": "bfloat16"}, "rows": [
        {"rows": 1, "kb": 8.0, "nccl_us": 12.7, "one_shot_us": 6.7, "two_shot_us": 8.3},
        {"rows": 1024, "kb": 8192.0, "nccl_us": 53.3, "one_shot_us": 63.9, "two_shot_us": 36.2}]},
}


def bar_heights(ax: Any) -> list[float]:
    return [p.get_height() for c in ax.containers for p in c]


def test_benchmark_pictures_from_their_json(tmp_path: Path) -> None:
    for name, data in SUMMARIES.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    (tmp_path / "throughput_tp2.json").write_text(json.dumps(SUMMARIES["throughput"]))
    (tmp_path / "sampler.json").write_text("{}")  # not drawn
    assert bench_plots.main([str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "all_reduce.png", "decode_attention.png", "serving.png", "throughput.png", "throughput_tp2.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in tmp_path.glob("*.png"))

    da = SUMMARIES["decode_attention"]
    ax = panels(bench_plots.plot_decode_attention(da))["bandwidth"]
    want = [r["bytes"] / (r[k] * 1e-6) / 1e9 for k in ("eager_us", "graph_us") for r in da["rows"]]
    assert np.allclose(bar_heights(ax), want)
    assert [line.get_ydata()[0] for line in ax.lines] == [da["copy_gbs"]]

    ax = panels(bench_plots.plot_throughput(SUMMARIES["throughput"]))
    assert bar_heights(ax["throughput"]) == [1025.0, 14900.0, 16200.0]
    assert bar_heights(ax["batch1"]) == [2.5, 2.2]

    ax = panels(bench_plots.plot_all_reduce(SUMMARIES["all_reduce"]))["latency"]
    assert [list(line.get_ydata()) for line in ax.lines] == [[12.7, 53.3], [6.7, 63.9], [8.3, 36.2]]
    assert list(ax.lines[0].get_xdata()) == [8.0, 8192.0]

    ax = panels(bench_plots.plot_serving(SUMMARIES["serving"]))
    ttft = {line.get_label(): list(line.get_ydata()) for line in ax["ttft"].lines}
    assert ttft == {"p50": [30, 900], "p99": [80, 2500]}
    tpot = {line.get_label(): line.get_ydata() for line in ax["tpot"].lines}
    assert tpot["p50"][0] == 8 and np.isnan(tpot["p50"][1])  # no percentile: no point
    assert [list(line.get_ydata()) for line in ax["output_tok_s"].lines] == [[4000.0, 7500.0], [15500.0, 15500.0]]


def test_tp_scaling_figure_groups_tp_sizes_by_shapes(tmp_path: Path) -> None:
    def summary(shapes: str, tp: int, tok_s: float, ms: float, share: float | None) -> dict[str, Any]:
        mv: dict[str, Any] = {"async on": {"offline": {"tok_s": tok_s}, "batch1": {"ms_per_token": ms}}}
        if share is not None:
            mv["decode_kernels"] = {"allreduce_share": share}
        return {"args": {"shapes": shapes, "tensor_parallel_size": tp}, "minivllm": mv}

    runs = {"throughput.json": summary("small", 1, 100.0, 2.0, 0.0),
            "throughput_tp2.json": summary("small", 2, 80.0, 3.0, 0.25),
            "throughput_big.json": summary("big", 1, 50.0, 5.0, None),
            "throughput_big_tp2.json": summary("big", 2, 70.0, 4.0, 0.15)}
    for name, data in runs.items():
        (tmp_path / name).write_text(json.dumps(data))
    assert bench_plots.main([str(tmp_path)]) == 0
    assert (tmp_path / "tp_scaling.png").read_bytes()[:8] == PNG_MAGIC
    ax = panels(bench_plots.plot_tp_scaling([runs[n] for n in sorted(runs)]))
    # containers: TP=1 bars (shapes in file-name order: small, big), then TP=2 bars
    assert bar_heights(ax["throughput"]) == [100.0, 50.0, 80.0, 70.0]
    assert bar_heights(ax["batch1"]) == [2.0, 5.0, 3.0, 4.0]
    labels = [t.get_text() for t in ax["batch1"].texts]
    assert "4.00\n0.80x\nAR 15%" in labels and "3.00\n1.50x\nAR 25%" in labels


def test_one_tp_size_and_several_shapes_draw_throughput_by_shapes(tmp_path: Path) -> None:
    for shapes, tok_s in (("small", 100.0), ("big", 50.0)):
        data = {"args": {"shapes": shapes, "tensor_parallel_size": 1},
                "minivllm": {"async on": {"offline": {"tok_s": tok_s}, "batch1": {"ms_per_token": 1.0}}}}
        (tmp_path / f"throughput_{shapes}.json").write_text(json.dumps(data))
    assert bench_plots.main([str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "throughput_big.png", "throughput_by_shapes.png", "throughput_small.png"]
