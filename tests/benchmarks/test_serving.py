"""benchmarks/serving.py: its arithmetic, and its CPU smoke run end to end (server
subprocess on the tiny fixture, Poisson and all-at-once rates, offline comparison)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("tokenizers")

from benchmarks import serving  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE_TIMEOUT = 120  # seconds: a hung server or client fails the test instead of the suite


def test_parse_rates() -> None:
    assert serving.parse_rates("8,32.5,inf") == [8.0, 32.5, math.inf]
    assert [serving.rate_label(r) for r in serving.parse_rates("4,0.5,inf")] == ["4", "0.5", "inf"]
    for bad in ("0", "-1", "x", "8,,inf"):
        with pytest.raises(ValueError):
            serving.parse_rates(bad)


def test_poisson_arrivals_and_request_cap() -> None:
    rng = np.random.default_rng(0)
    t = serving.poisson_arrivals(20000, 50.0, rng)
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    assert abs(np.diff(t).mean() - 1 / 50) < 1e-3  # mean gap 1/rate
    assert not serving.poisson_arrivals(5, math.inf, rng).any()
    assert serving.requests_at(math.inf, 256, 20) == 256
    assert serving.requests_at(8, 256, 20) == 160
    assert serving.requests_at(0.01, 256, 20) == 1


def test_cli_flags() -> None:
    assert serving.cli_flags({"max_model_len": 64, "max_num_seqs": 8, "enforce_eager": True}) == [
        "--max-model-len", "64", "--max-num-seqs", "8", "--enforce-eager"]


def test_sse_state_splits_events_across_reads() -> None:
    state = serving._SSEState()
    chunk = b'data: {"choices":[{"index":0,"text":" t5","finish_reason":null}]}\n\n'
    last = b'data: {"choices":[{"index":0,"text":" t6","finish_reason":"length"}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
    stream = chunk + last + usage + b"data: [DONE]\n\n"
    for i in range(0, len(stream), 7):  # reads that cut events anywhere
        state.feed(stream[i:i + 7], now=float(i))
    assert len(state.times) == 2 and state.ended
    assert state.finish_reason == "length" and state.completion_tokens == 2
    rec = serving._record(state, at=0.0, sent=0.0, max_tokens=2)
    assert rec.error is None and rec.num_output_tokens == 2
    assert serving._record(state, at=0.0, sent=0.0, max_tokens=3).error.startswith("usage says 2")


def test_summarize() -> None:
    ok = serving.RequestRecord(scheduled=0.0, sent=0.0, chunk_times=(0.1, 0.2, 0.4),
                               num_output_tokens=3, error=None)
    bad = serving.RequestRecord(scheduled=0.0, sent=0.1, chunk_times=(), num_output_tokens=0,
                                error="HTTP 500: boom")
    r = serving.summarize(math.inf, [ok, bad], client_cpu_s=0.0, client_procs=1)
    assert (r["rate"], r["completed"], r["failures"]) == ("inf", 1, 1)
    assert r["errors"] == ["HTTP 500: boom"]
    assert r["output_tokens"] == 3 and r["duration_s"] == pytest.approx(0.4)
    assert r["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert r["tpot_ms"]["p50"] == pytest.approx(150.0)          # (0.4 - 0.1) / 2
    assert r["itl_ms"]["mean"] == pytest.approx(150.0)          # gaps 100 and 200 ms


def test_smoke_run_on_cpu(tmp_path) -> None:
    out = tmp_path / "serving.json"
    cmd = [sys.executable, "-m", "benchmarks.serving", "--model", "fixtures/tiny-qwen3",
           "--num-requests", "8", "--rates", "4,inf", "--device", "cpu",
           "--tokenizer", "synthetic", "--out", str(out),
           "--engine-process"]  # serve's default layout end to end (test_server covers the thread)
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=SMOKE_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["rate"] for r in data["rates"]] == ["4", "inf"]
    assert (tmp_path / "serving.png").stat().st_size > 0, proc.stdout[-2000:]  # its figure, beside it
    for r in data["rates"]:
        assert r["requests"] == r["completed"] == 8 and r["failures"] == 0
        # Every token has text (synthetic tokenizer); a stream behind the engine gets the
        # tokens waiting for it in one chunk, so there are at most as many chunks as tokens.
        assert r["output_tokens"] == data["offline"]["completion_tokens"] > 0
        assert 0 < r["chunks"] <= r["output_tokens"]
        assert r["output_tok_s"] > 0 and r["request_throughput"] > 0
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
        # A stream whose tokens arrive merged (or in one socket read) has zero gaps: TPOT
        # and ITL can be 0 on this fast tiny model, never negative; ITL exists only where
        # some request got two chunks.
        assert 0 <= r["tpot_ms"]["p50"] <= r["tpot_ms"]["p99"]
        if r["chunks"] > r["completed"]:
            assert 0 <= r["itl_ms"]["p50"] <= r["itl_ms"]["p99"]
    assert data["offline"]["tok_s"] > 0 and data["ratio_server_offline"] > 0
    assert data["meta"]["command"].startswith("python -m benchmarks.serving --model fixtures/tiny-qwen3")

