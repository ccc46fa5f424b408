"""``benchmarks.speculative``: the CPU smoke run end to end, with every step drafted
(``--max-backoff 0``): replayed drafts that are all right are all kept and give the run
without drafts (float32), all-wrong ones keep none, and the summary says how it ran."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks import speculative


def test_smoke_run_drafting_every_step(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["speculative", "--smoke", "--batches", "1", "--ks", "4", "--accepts", "1.0",
                                      "--offline", "4", "--offline-rounds", "1", "--max-backoff", "0"])
    speculative.main()
    summary = json.loads((tmp_path / "speculative.json").read_text())
    assert summary["max_backoff"] == 0
    rows = {r["accept"]: r for r in summary["curve"] if r["k"] == 4}
    assert rows[1.0]["measured_acceptance"] == 1.0 and rows[1.0]["identical"] == 1.0
    assert rows[0.0]["measured_acceptance"] == 0.0 and rows[0.0]["tokens_per_step"] < 1.01
    assert summary["cost_always_wrong_batch1"] > 0 and summary["offline_ngram_finding_nothing"]["ratio"] > 0
