"""``benchmarks.tp_scaling``'s pairing and ratios, with the throughput runs stubbed (a
real run is two engine processes per pair; ``--smoke`` runs it on the CPU by hand)."""

from __future__ import annotations

import json

import pytest

import benchmarks.tp_scaling as bench


def test_pairs_alternate_and_ratios_are_tp2_over_tp1(monkeypatch, capsys, tmp_path) -> None:
    calls = []
    speeds = iter([(100.0, 5.0), (170.0, 3.0), (110.0, 5.5), (165.0, 3.3), (90.0, 4.0), (150.0, 2.4)])

    def fake_run(tp, passthrough, timeout_s, env=()):
        assert env == ()
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


def test_options_it_sets_itself_are_refused(monkeypatch) -> None:
    monkeypatch.setattr("sys.argv", ["tp_scaling", "--tensor-parallel-size", "4"])
    with pytest.raises(SystemExit, match="set by this benchmark"):
        bench.main()


def test_variants_run_in_every_round_against_that_rounds_tp1(monkeypatch, capsys, tmp_path) -> None:
    calls = []
    # Round 1: TP=1, plain, push, warm; round 2 the same.
    speeds = iter([(100.0, 5.0), (150.0, 3.5), (160.0, 3.4), (170.0, 3.0),
                   (120.0, 4.0), (180.0, 2.8), (192.0, 2.6), (204.0, 2.4)])

    def fake_run(tp, passthrough, timeout_s, env=()):
        calls.append((tp, tuple(passthrough), dict(env)))
        tok_s, ms = next(speeds)
        return {"tok_s": tok_s, "ms_per_token": ms}

    monkeypatch.setattr(bench, "run_throughput", fake_run)
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr("sys.argv", ["tp_scaling", "--pairs", "2", "--num-requests", "16",
                                     "--tp2-variant", "push=--push-all-reduce on",
                                     "--tp2-variant", "warm=MINIVLLM_PDL=1 MINIVLLM_AR_WARM_MB=16"])
    bench.main()
    base = ("--num-requests", "16")
    one_round = [(1, base, {}), (2, base, {}), (2, (*base, "--push-all-reduce", "on"), {}),
                 (2, base, {"MINIVLLM_PDL": "1", "MINIVLLM_AR_WARM_MB": "16"})]
    assert calls == one_round * 2
    saved = json.loads((tmp_path / "tp_scaling.json").read_text())
    assert [round(p["batch1"], 3) for p in saved["pairs"]] == [0.7, 0.7]
    warm = saved["variants"]["warm"]
    assert warm["env"] == {"MINIVLLM_PDL": "1", "MINIVLLM_AR_WARM_MB": "16"}
    assert [round(p["batch1"], 3) for p in warm["pairs"]] == [0.6, 0.6]
    assert warm["median"]["throughput"] == pytest.approx((1.7 + 1.7) / 2)
    assert saved["variants"]["push"]["median"]["batch1"] == pytest.approx((0.68 + 0.65) / 2)
    out = capsys.readouterr().out
    assert "[warm] median over 2 pair(s): throughput 1.700x (goal >= 1.6x: met), batch-1 0.600x" in out
    assert "[push] median over 2 pair(s)" in out and "batch-1 0.665x (goal <= 0.65x: not met)" in out


@pytest.mark.parametrize("spec, message", [
    ("warm=MINIVLLM_AR_WARN_MB=16", "MINIVLLM_AR_WARN_MB is not an environment variable the engine reads"),
    ("no options here", "need NAME=OPTIONS"),
    ("plain=--gemv off", "need NAME=OPTIONS"),
    ("empty=", "no options given"),
    ("tp4=--tensor-parallel-size 4", "set by this benchmark"),
])
def test_bad_variants_are_refused_before_any_run(monkeypatch, spec, message) -> None:
    monkeypatch.setattr(bench, "run_throughput", lambda *a, **k: pytest.fail("ran despite a bad variant"))
    monkeypatch.setattr("sys.argv", ["tp_scaling", "--tp2-variant", spec])
    with pytest.raises(SystemExit, match=message):
        bench.main()


def test_variant_names_must_differ(monkeypatch) -> None:
    monkeypatch.setattr("sys.argv", ["tp_scaling", "--tp2-variant", "a=--gemv off", "--tp2-variant", "a=--gemv on"])
    with pytest.raises(SystemExit, match="must differ"):
        bench.main()


def test_every_variable_a_variant_may_set_is_read_by_the_engine() -> None:
    """The allowed names come from the engine's own constants or its source: each must
    appear in minivllm/ (a renamed variable would leave the benchmark setting a dead one)."""
    from pathlib import Path
    source = "\n".join(p.read_text() for p in Path("minivllm").rglob("*.py"))
    for name in bench.engine_env_names():
        assert f'"{name}"' in source, name
