"""benchmarks/fp8.py on the CPU: the smoke run end to end (every part, both variants, the
table and the summary), the round order, and its section of the generated page."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import fp8, report


def test_rounds_alternate_the_order() -> None:
    assert fp8.round_orders(["a", "b"], 3) == [["a", "b"], ["b", "a"], ["a", "b"]]


def test_smoke_run_writes_every_part_and_its_section(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    fp8.main(["--smoke", "--model-dir", str(tmp_path / "model")])
    d = json.loads((tmp_path / "out" / "fp8.json").read_text())
    assert set(d["offline"]) == set(d["long_context"]) == {"bf16", "fp8-kv"} and set(d["accuracy"]) == {"fp8-kv"}
    for r in d["offline"].values():
        assert len(r["rounds"]) == 2 and r["tok_s"] > 0 and r["batch1"]["ms_per_token"] > 0
    assert d["offline"]["fp8-kv"]["goal"] == 40_000 and d["long_context"]["fp8-kv"]["goal"] == 3.0
    a = d["accuracy"]["fp8-kv"]
    assert a["prompts"] == 2 and a["top5_failures"] == 0 and a["mean_kl"] >= 0
    out = capsys.readouterr().out
    assert "offline [fp8-kv]:" in out and "(bf16 " in out and "goal >= 40,000" in out
    assert "long_context [fp8-kv]:" in out and "goal <= 3.000" in out
    page = report.render(report.load(tmp_path / "out"))
    assert "benchmarks.fp8" in page and "| fp8 | fp8-kv |" in page
