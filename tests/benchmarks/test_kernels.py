"""The kernel benchmarks' code paths on the CPU (Triton interpreter, tiny shapes, timing
stubbed), so that GPU time is never spent on a Python error in a sweep."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import (conftest sets it too)

import pytest  # noqa: E402

from minivllm.kernels.gemv import GemvConfig  # noqa: E402
from minivllm.kernels.prefill_attention import PrefillConfig  # noqa: E402


def test_gemv_sweep_rows_on_the_cpu(monkeypatch, capsys) -> None:
    import benchmarks.gemv as bench

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "L2_FLUSH_BYTES", 1)
    monkeypatch.setattr(bench, "graph_us", lambda call, calls: (call(0), 1000.0)[1])
    configs = [bench.default_config(1, 48, 64), bench.FEW_ROWS_CONFIG, GemvConfig(16, 32, 4, 2, one_row=True),
               GemvConfig(32, 32, 4, 2)]
    for rows in (1, 3):
        row = bench.bench_shape("tiny o", 48, 64, rows, configs)
        bench.print_row(row)
        timed = [e for e in row["configs"] if "us" in e]
        assert not [e for e in row["configs"] if "error" in e], row
        assert len(timed) == (4 if rows == 1 else 2)  # the one-row configs only at one row
        [default] = [e for e in row["configs"] if e["default"]]
        assert default["config"]["one_row"] == (rows == 1)
    assert "not taken" in capsys.readouterr().out     # 2-3 programs < the defaults' 32
    assert [name for name, _, _ in bench.decode_gemms("8b-tp2")] == [
        "8b-tp2 qkv", "8b-tp2 o", "8b-tp2 gate_up", "8b-tp2 down"]
    assert bench.decode_gemms("30b-a3b") == [  # a sparse model: attention and the router
        ("30b-a3b qkv", 5120, 2048), ("30b-a3b o", 2048, 4096), ("30b-a3b router", 128, 2048)]


@pytest.mark.parametrize("timing", ["graph", "do_bench"])
def test_prefill_sweep_rows_on_the_cpu(monkeypatch, timing) -> None:
    import benchmarks.prefill_attention as bench

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "BLOCK_SIZE", 16)
    monkeypatch.setattr(bench, "TIMING", timing)
    monkeypatch.setattr(bench, "graph_us", lambda call, calls, replays: (call(0), 1000.0)[1])
    monkeypatch.setattr(bench.triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.0)[1])
    monkeypatch.setattr(bench, "bench_sdpa", lambda p, shape, ref, quick: [])
    result = bench.bench_shape(bench.Shape("tiny", (20, 7), prefix=9), [PrefillConfig(16, 16, 4, 1)], True)
    bench.print_shape(result)
    # the config given, then the shape's default launched through a tile map (the engine's graphs)
    assert [r["ms"] for r in result["configs"]] == [1.0, 1.0], result
    assert [r["map"] for r in result["configs"]] == [False, True]


def test_decode_attention_rows_on_the_cpu(monkeypatch, capsys) -> None:
    import benchmarks.decode_attention as bench

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "BLOCK_SIZE", 16)
    monkeypatch.setattr(bench, "graph_us", lambda call, calls: (call(0), 10.0)[1])
    monkeypatch.setattr(bench.triton.testing, "do_bench", lambda fn, **kw: (fn(), 0.02)[1])  # ms
    p = bench.make_problem(2, 32)
    row = bench.timed_row(p, 2, 32, num_sms=4, copy_gbs=100.0)
    bench.print_rows([row], 100.0)
    assert (row["eager_us"], row["graph_us"]) == (20.0, 10.0)
    assert row["graph_gbs"] == pytest.approx(p.bytes_moved / 10e-6 / 1e9)
    assert row["graph_pct_copy"] == pytest.approx(row["graph_gbs"])   # of 100 GB/s
    assert row["max_err"] <= 1.6e-2
    assert "copy bandwidth 100 GB/s" in capsys.readouterr().out
