"""``benchmarks.tp_scaling``'s pairing and ratios, with the throughput runs stubbed (a
real run is two engine processes per pair; ``--smoke`` runs it on the CPU by hand)."""

from __future__ import annotations

import json

import pytest

import benchmarks.tp_scaling as bench


def test_pairs_alternate_and_ratios_are_tp2_over_tp1(monkeypatch, capsys, tmp_path) -> None:
    calls = []
    speeds = iter([(100.0, 5.0), (170.0, 3.0), (110.0, 5.5), (165.0, 3.3), (90.0, 4.0), (150.0, 2.4)])

    def fake_run(tp, passthrough, timeout_s):
        calls.append((tp, tuple(passthrough)))
        tok_s, ms = next(speeds)
        return {"tok_s": tok_s, "ms_per_token": ms}

    monkeypatch.setattr(bench, "run_throughput", fake_run)
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr("sys.argv", ["tp_scaling", "--pairs", "3", "--shapes", "qwen3-8b"])
    bench.main()
    assert calls == [(1, ("--shapes", "qwen3-8b")), (2, ("--shapes", "qwen3-8b"))] * 3
    saved = json.loads((tmp_path / "tp_scaling.json").read_text())
    assert [round(p["throughput"], 3) for p in saved["pairs"]] == [1.7, 1.5, 1.667]
    assert [round(p["batch1"], 3) for p in saved["pairs"]] == [0.6, 0.6, 0.6]
    assert saved["median"] == pytest.approx({"throughput": 5 / 3, "batch1": 0.6})
    out = capsys.readouterr().out
    assert "throughput 1.667x (goal >= 1.6x: met)" in out and "batch-1 0.600x (goal <= 0.65x: met)" in out
    assert saved["meta"]["command"] and saved["passthrough"] == ["--shapes", "qwen3-8b"]


@pytest.mark.parametrize("words", [["--tensor-parallel-size", "4"], ["--async=off"], ["--engines", "hf"]])
def test_options_it_sets_itself_are_refused(monkeypatch, words) -> None:
    monkeypatch.setattr(bench, "run_throughput", lambda *a: pytest.fail("ran despite a refused option"))
    monkeypatch.setattr("sys.argv", ["tp_scaling", *words])
    with pytest.raises(SystemExit, match="set by this benchmark"):
        bench.main()
