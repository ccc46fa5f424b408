"""The simulator end to end: random traces through the real engine, the CLI, record/replay."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

import sim.runner
from minivllm.engine.trace import load
from sim.__main__ import main, parse_overrides
from sim.oracle import Expected
from sim.runner import record_trace, run_trace
from sim.traces import generate_trace

ROOT = Path(__file__).resolve().parents[2]
# x 8 configs = 800 traces per run (all async, 200 also sync); .ci/run follows `make test` with
# `make sim`, 10,000 random traces more. (2,000 here cost ~45 s of the 5-minute budget.)
TRACES_PER_CONFIG = 100
CONFIGS = list(itertools.product(("prefill_first", "mixed"), (True, False), (True, False)))


@pytest.mark.parametrize("policy, prefix, chunked", CONFIGS,
                         ids=[f"{p}-{'prefix' if c else 'noprefix'}-{'chunked' if k else 'whole'}"
                              for p, c, k in CONFIGS])
def test_random_traces(policy: str, prefix: bool, chunked: bool, tmp_path: Path) -> None:
    overrides = {"policy": policy, "enable_prefix_caching": prefix, "chunked_prefill": chunked}
    base = 10_000 * (1 + CONFIGS.index((policy, prefix, chunked)))
    totals = dict(preemptions=0, cached_tokens=0, chunked_prefills=0, aborts=0, rejected=0)
    for seed in range(base, base + TRACES_PER_CONFIG):
        # Every trace with one step in flight; every fourth also synchronously, outputs compared.
        modes = (True, False) if seed % 4 == 0 else (True,)
        outputs = []
        for mode in modes:
            trace = generate_trace(seed, {**overrides, "async_scheduling": mode})
            result = run_trace(trace)
            if not result.ok:
                path = trace.save(tmp_path / f"trace-{seed}.jsonl")
                pytest.fail(f"trace seed {seed} ({overrides}, async {mode}) saved to {path}:\n"
                            + "\n".join(result.violations[:5]))
            outputs.append({k: (o.token_ids, o.finish_reason) for k, o in result.outputs.items()
                            if o.finish_reason != "abort"})
        finished_in_both = outputs[0].keys() & outputs[-1].keys()
        assert all(outputs[0][k] == outputs[-1][k] for k in finished_in_both), seed
        for k in totals:
            totals[k] += getattr(result, k)
    assert totals["preemptions"] > 0 and totals["aborts"] > 0 and totals["rejected"] > 0, totals
    assert (totals["cached_tokens"] > 0) == prefix, totals
    assert (totals["chunked_prefills"] > 0) == chunked, totals


def test_cli_run_ok(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--traces", "20", "--seed", "3", "--quiet", "--config", "block_size=2 policy=mixed"]) == 0
    out = capsys.readouterr().out
    for row in ("traces", "steps/s", "prefix-hit", "preemptions", "chunked prefills", "aborts", "violations"):
        assert row in out


def test_cli_run_saves_failing_trace_and_exits_1(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    def wrong_oracle(*args: object, **kwargs: object) -> Expected:
        return Expected((), "stop")

    monkeypatch.setattr(sim.runner, "oracle_generate", wrong_oracle)
    rc = main(["run", "--traces", "3", "--seed", "9", "--out-dir", str(tmp_path), "--max-failures", "2"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "VIOLATION in trace seed 9000000" in err
    saved = sorted(tmp_path.glob("trace-*.jsonl"))
    assert saved and load(saved[0]).events == generate_trace(9_000_000).events


def _summary_rows(out: str) -> list[str]:
    """The summary's lines but the timing (steps/s)."""
    return [line for line in out.splitlines() if line.strip() and not line.startswith("steps/s")]


def test_cli_run_over_workers_counts_what_one_process_counts(capsys: pytest.CaptureFixture[str]) -> None:
    """--jobs 3 spreads the traces over forked workers; every total equals the one-process run's."""
    args = ["run", "--traces", "30", "--seed", "4", "--quiet", "--config", "policy=mixed"]
    assert main(args) == 0
    one = _summary_rows(capsys.readouterr().out)
    assert main([*args, "--jobs", "3"]) == 0
    assert _summary_rows(capsys.readouterr().out) == one
    assert any(line.startswith("preemptions") for line in one)


def test_cli_run_over_workers_saves_failing_traces(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A violation found in a worker is reported with its seed and its trace, generated again in
    the caller, saved; the run stops at --max-failures."""
    monkeypatch.setattr(sim.runner, "oracle_generate", lambda *a, **k: Expected((), "stop"))
    rc = main(["run", "--traces", "40", "--seed", "9", "--out-dir", str(tmp_path), "--max-failures", "2",
               "--jobs", "2", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1 and "stopping after 2 failing traces" in err
    saved = sorted(tmp_path.glob("trace-*.jsonl"))
    assert [p.name for p in saved] == ["trace-9000000.jsonl", "trace-9000001.jsonl"]
    assert load(saved[1]).events == generate_trace(9_000_001).events


@pytest.mark.parametrize("extra,message", [(["--jobs", "0"], "--jobs 0"),
                                           (["--jobs", "2", "--plot", "figs"], "--plot")])
def test_cli_run_refuses_bad_jobs(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--traces", "1", *extra]) == 2
    assert message in capsys.readouterr().err


def test_cli_bad_config_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--traces", "1", "--config", "blocksize=4"]) == 2
    assert "unknown config key" in capsys.readouterr().err
    assert parse_overrides(['{"cache": {"block_size": 8}}', "policy=mixed num_blocks=null"]) == {
        "block_size": 8, "policy": "mixed", "num_blocks": None}


def test_record_then_replay_matches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.jsonl"
    assert main(["record", "--seed", "42", "--out", str(out)]) == 0
    trace = load(out)
    assert trace.expects and len(trace.expects) == run_trace(trace).steps
    assert main(["replay", str(out)]) == 0
    assert "all" in capsys.readouterr().out
    # Re-recording the recorded inputs gives the same file.
    again = tmp_path / "again.jsonl"
    assert main(["record", "--trace", str(out), "--out", str(again)]) == 0
    assert again.read_text() == out.read_text()


def _tamper(path: Path, step: int, field: str, value: object) -> None:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    target = next(d for d in lines[1:] if d["op"] == "expect" and d["step"] == step)
    target[field] = value
    path.write_text("".join(json.dumps(d) + "\n" for d in lines))


def test_tampered_trace_reports_its_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace, result = record_trace(generate_trace(7, {"num_blocks": 64, "block_size": 4}))
    assert result.ok and len(trace.expects) > 3
    path = trace.save(tmp_path / "t.jsonl")
    k = trace.expects[2].step
    _tamper(path, k, "free_blocks", trace.expects[2].free_blocks + 1)
    assert main(["replay", str(path)]) == 1
    assert f"MISMATCH at step {k}: free_blocks" in capsys.readouterr().out

    busy = next(e for e in trace.expects if e.scheduled)
    path = trace.save(tmp_path / "u.jsonl")
    _tamper(path, busy.step, "scheduled", {**busy.scheduled, "ghost": 1})
    r = run_trace(load(path), "replay")
    assert r.mismatch_step == busy.step and "scheduled" in (r.mismatch or "")


def test_cli_help_and_module_entry() -> None:
    proc = subprocess.run([sys.executable, "-m", "sim", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and "replay" in proc.stdout
    trace = str(ROOT / "fixtures/traces/shared_prefix_three_seqs.jsonl")
    proc = subprocess.run([sys.executable, "-m", "sim", "replay", trace],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
