"""benchmarks/fp8_gemm.py on the CPU (Triton interpreter): the smoke run end to end, its
summary and its section of the page; the timed path with the timing stubbed (every weight
copy called, the byte and FLOP arithmetic); a wrong kernel output stops the run."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import (conftest sets it too)

import pytest  # noqa: E402
import torch  # noqa: E402

from benchmarks import fp8_gemm as bench  # noqa: E402
from benchmarks import report  # noqa: E402


def section_rows(page: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in page.splitlines()
            if line.startswith("| fp8_gemm |")]


def test_smoke_run_checks_every_row_and_the_page_shows_them(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    bench.main(["--smoke"])
    d = json.loads((tmp_path / "fp8_gemm.json").read_text())
    assert d["copy_gbs"] is None and d["meta"]["command"]
    rows = d["rows"]
    assert [(r["gemm"], r["mode"], r["M"]) for r in rows] == [
        (name, mode, m) for name, _, _ in bench.SMOKE_GEMMS for mode in ("block", "channel") for m in bench.SMOKE_ROWS]
    for r in rows:
        res = r["results"]
        assert set(res) == {"fp8_gemm", "scaled_mm", "cublas_bf16"} | ({"fp8_gemv"} if r["M"] == 1 else set())
        for name, e in res.items():
            if name == "scaled_mm" and r["mode"] == "block":  # torch._scaled_mm takes no block scales on the CPU
                assert e["unsupported"].startswith("NotImplementedError: ")
            else:
                assert e["max_err"] >= 0 and "us" not in e, (r, name)     # checked, untimed
    assert "unsupported: NotImplementedError" in capsys.readouterr().out
    page = report.render(report.load(tmp_path))
    assert "## fp8_gemm: " in page and "## fp8: " not in page
    cells = section_rows(page)
    assert len(cells) == len(rows)
    assert cells[0][:5] == ["fp8_gemm", "smoke qkv", "block", "1", "128 x 64"]
    assert cells[0][-2:] == ["unsupported", "-"]     # _scaled_mm refused; fp8_gemv checked, untimed


def test_timed_rows_cycle_over_the_weight_copies(tmp_path: Path, monkeypatch) -> None:
    calls: list[int] = []

    def fake_graph_us(call, copies):
        for i in range(copies):
            call(i)
            calls.append(i)
        return 10.0

    monkeypatch.setattr(bench, "graph_us", fake_graph_us)
    monkeypatch.setattr(bench, "L2_FLUSH_BYTES", 3 * 128 * 64)   # 3 copies of the 128 x 64 weight
    [row] = bench.run_gemms([("tiny qkv", 128, 64)], ["channel"], (1,), "cpu", copy_gbs=100.0)
    assert row["weight_copies"] == 3 and calls == [0, 1, 2] * 4   # four contenders at M = 1
    fp8 = row["results"]["fp8_gemm"]
    assert row["fp8_bytes"] == 128 * 64 + 128 * 4 + 64 * 2       # e4m3 W, float32 scales, bf16 x
    assert fp8["GBs"] == pytest.approx(row["fp8_bytes"] / 10e-6 / 1e9)
    assert fp8["pct_copy"] == pytest.approx(fp8["GBs"])           # of 100 GB/s
    assert fp8["TFLOPs"] == pytest.approx(2 * 128 * 64 / 10e-6 / 1e12)
    assert row["results"]["cublas_bf16"]["GBs"] == pytest.approx((2 * 128 * 64 + 64 * 2) / 10e-6 / 1e9)
    assert all(e["x_cublas"] == 1.0 for e in row["results"].values())
    report.write_summary("fp8_gemm", {"copy_gbs": 100.0, "rows": [row]}, path=tmp_path / "fp8_gemm.json")
    page = report.render(report.load(tmp_path))
    assert "% of copy (100 GB/s)" in page
    assert section_rows(page) == [["fp8_gemm", "tiny qkv", "channel", "1", "128 x 64", "10.00", f"{fp8['GBs']:,.0f}",
                                   f"{fp8['pct_copy']:.1f}", f"{fp8['TFLOPs']:.1f}", "10.00", "1.00", "10.00", "10.00"]]


def test_a_wrong_kernel_output_raises() -> None:
    w = bench.make_weights(128, 64, "block", 1, "cpu", seed=0)
    fp8_gemm = bench.CONTENDERS[0]
    assert fp8_gemm.name == "fp8_gemm"
    bench.bench_row("tiny qkv", 16, w, "cpu", None, (fp8_gemm,))
    wrong = dataclasses.replace(fp8_gemm, run=lambda x, w, c: fp8_gemm.run(x, w, c) * 1.05)
    with pytest.raises(AssertionError, match="fp8_gemm at tiny qkv M=16 block: .* off the reference"):
        bench.bench_row("tiny qkv", 16, w, "cpu", None, (wrong,))
    nan = dataclasses.replace(fp8_gemm, run=lambda x, w, c: torch.full_like(fp8_gemm.run(x, w, c), float("nan")))
    with pytest.raises(AssertionError, match="2048 of 2048 elements"):
        bench.bench_row("tiny qkv", 16, w, "cpu", None, (nan,))


def test_only_scaled_mm_may_be_unsupported() -> None:
    """An error of a kernel under test stops the run; only torch._scaled_mm's is a report."""
    w = bench.make_weights(128, 64, "block", 1, "cpu", seed=0)

    def refuses(x, w, c):
        raise RuntimeError("no kernel image for this device\nmore")

    for c in bench.CONTENDERS:
        row_or_error = dataclasses.replace(c, run=refuses)
        if c.may_be_unsupported:
            row = bench.bench_row("tiny qkv", 1, w, "cpu", None, (row_or_error,))
            assert row["results"][c.name] == {"unsupported": "RuntimeError: no kernel image for this device"}
        else:
            with pytest.raises(RuntimeError):
                bench.bench_row("tiny qkv", 1, w, "cpu", None, (row_or_error,))
    assert [c.name for c in bench.CONTENDERS if c.may_be_unsupported] == ["scaled_mm"]


def test_arguments_are_checked(monkeypatch) -> None:
    for argv in (["--modes", "block,tensor"], ["--models", "0.6b,70b"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SystemExit):
        bench.parse_args(["--smoke"])


def test_sweep_checks_every_tile_config_and_names_the_fastest(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    bench.main(["--smoke", "--sweep", "--modes", "block"])
    rows = json.loads((tmp_path / "fp8_gemm.json").read_text())["rows"]
    gemv_tiles, gemm_tiles = bench.SMOKE_SWEEP
    for r in rows:
        swept = {n for n in r["results"] if "[" in n}
        assert len(swept) == (len(gemv_tiles) if r["M"] == 1 else 0) + len(gemm_tiles), r
        assert {n for n in swept if n.startswith("fp8_gemm[")} == {"fp8_gemm[16x64 w4 s2]", "fp8_gemm[32x32 w4 s2]"}
        assert all(r["results"][n]["max_err"] >= 0 for n in swept)   # each checked against its reference
        assert r["best"] == {}                                      # untimed: nothing to rank
    assert "| fp8_gemm |" in report.render(report.load(tmp_path))
    timed = {"results": {"fp8_gemv": {"us": 9.0}, "fp8_gemv[8x256 w4 s2]": {"us": 6.0},
                         "fp8_gemv[16x128 w4 s3]": {"us": 3.0}, "fp8_gemm": {"us": 5.0}}}
    assert bench.best_of_sweep(timed) == {"fp8_gemv": {"tiles": "[16x128 w4 s3]", "us": 3.0, "default_us": 9.0,
                                                       "x_default": 3.0}}
