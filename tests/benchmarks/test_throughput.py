"""``benchmarks.throughput``: each engine of several runs in a process of its own and the
parent merges their results into one summary; batch-1 keeps the median round with the
spread of every round; the CPU smoke run end to end, and its row of the generated page."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from benchmarks import report, throughput


def rounds(*ms: float) -> list[dict[str, Any]]:
    return [{"tokens": 8, "wall_s": m * 8e-3, "ms_per_token": m} for m in ms]


def test_batch1_reports_the_median_round_with_every_round_and_the_range(capsys) -> None:
    r = throughput.median_run(rounds(4.0, 1.0, 3.0, 5.0, 2.0), "async on")
    assert r["ms_per_token"] == 3.0 and r["wall_s"] == pytest.approx(3.0 * 8e-3)   # the median round, whole
    assert r["rounds_ms_per_token"] == [4.0, 1.0, 3.0, 5.0, 2.0]                   # in the order they ran
    assert (r["min"], r["max"]) == (1.0, 5.0)
    assert "median 3.000 ms/token over 5 rounds, min 1.000, max 5.000" in capsys.readouterr().out
    assert throughput.median_run(rounds(2.0, 1.0), "async on")["ms_per_token"] == 2.0  # upper median
    one = throughput.median_run(rounds(1.5), "async on")
    assert one["ms_per_token"] == one["min"] == one["max"] == 1.5 and one["rounds_ms_per_token"] == [1.5]


def test_batch1_runs_several_rounds_by_default() -> None:
    assert throughput.parse_args(["--smoke"]).batch1_repeats == 5
    with pytest.raises(SystemExit):
        throughput.parse_args(["--smoke", "--batch1-repeats", "0"])


def test_smoke_run_merges_the_engines_each_run_in_a_process_of_its_own(tmp_path: Path, monkeypatch) -> None:
    def in_this_process(*args: Any) -> dict[str, Any]:
        pytest.fail("an engine of several ran in the benchmark's own process")

    # Spawned children import the module afresh: only a run in this process meets these.
    monkeypatch.setattr(throughput, "run_hf", in_this_process)
    monkeypatch.setattr(throughput, "run_minivllm", in_this_process)
    monkeypatch.setenv(report.OUT_ENV, str(tmp_path / "out"))
    throughput.main(["--smoke", "--model-dir", str(tmp_path / "model"), "--async", "on", "--batch1-repeats", "3"])
    d = json.loads((tmp_path / "out" / "throughput.json").read_text())
    assert "error" not in d["hf"] and d["hf"]["tok_s"] > 0 and d["hf"]["requests"] == 4
    mv = d["minivllm"]["async on"]
    assert mv["offline"]["tok_s"] > 0 and d["minivllm"]["kv_blocks"] > 0
    assert mv["vs_hf"] == pytest.approx(mv["offline"]["tok_s"] / d["hf"]["tok_s"]) == d["ratio_minivllm_hf"]
    b = mv["batch1"]
    assert len(b["rounds_ms_per_token"]) == 3
    assert b["min"] <= b["ms_per_token"] <= b["max"]
    assert b["ms_per_token"] == statistics.median(b["rounds_ms_per_token"])
    assert (b["min"], b["max"]) == (min(b["rounds_ms_per_token"]), max(b["rounds_ms_per_token"]))
    page = report.render(report.load(tmp_path / "out"))
    assert f"| {b['ms_per_token']:.3f} ({b['min']:.3f}-{b['max']:.3f}, 3 rounds) |" in page
    assert "| HF transformers (4 requests) |" in page
