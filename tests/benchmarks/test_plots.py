"""Pictures of the benchmarks' summaries (benchmarks/plots.py, python -m benchmarks.plots),
checked without eyes: the files exist, the figures have their named panels, and the bars and
lines hold the numbers of the JSON they were drawn from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from benchmarks import plots as bench_plots  # noqa: E402
from tests.sim.test_plots import PNG_MAGIC, panels  # noqa: E402


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
