"""``benchmarks.draft_model``: the speedup a measured step cost implies at an acceptance, and
the CPU smoke run end to end (a draft model drafting in every step, its summary written)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import draft_model


def test_implied_speedup_counts_the_tokens_a_drafted_step_yields() -> None:
    # k 4: (1 - 0.5^5) / (1 - 0.5) = 1.9375 tokens a step; at twice a plain step's cost, x0.97.
    assert draft_model.implied_speedup(0.5, 4, 1.0, 2.0) == pytest.approx(1.9375 / 2)
    assert draft_model.implied_speedup(1.0, 4, 1.0, 2.0) == pytest.approx(2.5)
    assert draft_model.implied_speedup(0.0, 4, 1.0, 1.0) == pytest.approx(1.0)


def test_smoke_run_writes_its_summary(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["draft_model", "--smoke", "--load-format", "dummy", "--new-tokens", "6",
                                      "--rounds", "1", "--k", "2"])
    draft_model.main()
    summary = json.loads((tmp_path / "draft_model.json").read_text())
    assert summary["drafted_ms_per_step"] > 0 and summary["plain_ms_per_step"] > 0
    assert summary["k"] == 2 and summary["tokens_per_drafted_step"] >= 1
