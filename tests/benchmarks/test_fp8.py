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
    variants = ["bf16", "fp8-kv", "fp8-weights", "fp8-weights-channel"]
    fp8.main(["--smoke", "--model-dir", str(tmp_path / "model"), "--variants", ",".join(variants), "--sweep",
              "--split-sweep"])
    d = json.loads((tmp_path / "out" / "fp8.json").read_text())
    assert list(d["offline"]) == list(d["long_context"]) == variants and list(d["accuracy"]) == variants[1:]
    assert list(d["attention"]) == ["bf16", "fp8"]
    assert all(r["us"] > 0 and r["gbs"] > 0 for r in d["attention"].values())
    assert d["attention"]["fp8"]["kv_bytes"] * 2 == d["attention"]["bf16"]["kv_bytes"]
    sweeps = {name: r["sweep"] for name, r in d["attention"].items()}
    # each tile by pointers and by boxes (blocks of 32 hold tiles of 32); fp8: with fp16 dots too
    assert len(sweeps["bf16"]) == 4 and len(sweeps["fp8"]) == 8
    assert [t["fp16_dots"] for t in sweeps["fp8"]].count(True) == 4
    assert [t["tma"] for t in sweeps["bf16"]].count(True) == 2
    assert all(t["us"] > 0 for ts in sweeps.values() for t in ts)
    assert all([t["num_splits"] for t in r["splits"]] == list(fp8.ATTENTION_SPLITS) and r["default_splits"] >= 1
               for r in d["attention"].values())
    for r in d["offline"].values():
        assert len(r["rounds"]) == 2 and r["tok_s"] > 0 and r["batch1"]["ms_per_token"] > 0
    # --smoke keeps the default shapes' goals in view (the numbers mean nothing on the CPU).
    assert d["offline"]["fp8-kv"]["goals"]["tok_s"]["goal"] == 40_000
    assert d["offline"]["fp8-weights"]["goals"]["batch1_ms"]["goal"] == 0.6
    assert d["long_context"]["fp8-kv"]["goals"]["median_ms"]["goal"] == 3.0
    for name in variants[1:]:
        a = d["accuracy"][name]
        assert a["prompts"] == 2 and a["top5_failures"] == 0 and a["mean_kl"] >= 0, name
    out = capsys.readouterr().out
    assert "offline tok/s [fp8-kv]:" in out and "(bf16 " in out and "goal >= 40,000" in out
    assert "batch-1 ms/token [fp8-weights]:" in out and "goal <= 0.600" in out
    assert "long-context decode ms/step [fp8-kv]:" in out and "goal <= 3.000" in out
    page = report.render(report.load(tmp_path / "out"))
    assert "benchmarks.fp8" in page and "| fp8 | fp8-weights |" in page and "| fp8 | fp8 |" in page
