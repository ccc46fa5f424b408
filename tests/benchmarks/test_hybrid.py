"""``benchmarks.hybrid`` and ``benchmarks.delta_rule``: the CPU smoke runs end to end. The
shared-prefix part computes fewer prompt tokens with the cache than without, with identical
outputs; the floor's bytes count the recurrent states; every delta-rule kernel agrees with
the reference."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks import delta_rule, hybrid
from minivllm.config import ModelConfig
from minivllm.testing import write_random_config


def test_hybrid_smoke_run(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    hybrid.main(["--smoke", "--parts", "batch1,prefix"])
    summary = json.loads((tmp_path / "hybrid_qwen3_5_9b_batch1_prefix.json").read_text())
    on, off = summary["prefix"]["cache_on"], summary["prefix"]["cache_off"]
    assert summary["prefix"]["identical_outputs"] and summary["prefix"]["identical_requests"] == 5
    assert summary["prefix"]["top5_failures"] == 0 and summary["prefix"]["first_logprob_max_diff"] < 1e-4
    assert off["cached_tokens"] == 0 and on["cached_tokens"] == 5 * 32  # the shared prefix, every later request
    assert on["computed_prompt_tokens"] < off["computed_prompt_tokens"]
    assert summary["batch1"]["ms_per_token"] > 0 and summary["batch1"]["step_bytes"] > 0


def test_a_run_of_some_parts_names_its_summary_after_them() -> None:
    """So that it does not replace the summary of a whole run in docs/summaries/."""
    assert hybrid.summary_name("qwen3.5-9b", list(hybrid.PARTS)) == "hybrid_qwen3_5_9b"
    assert hybrid.summary_name("qwen3.5-9b", ["prefix", "batch1"]) == "hybrid_qwen3_5_9b_batch1_prefix"
    assert hybrid.summary_name("qwen3.5-35b-a3b", ["offline", "batch1"]) == "hybrid_qwen3_5_35b_a3b"
    assert hybrid.summary_name("qwen3.5-35b-a3b", ["batch1"]) == "hybrid_qwen3_5_35b_a3b_batch1"
    assert hybrid.parse_args(["--shapes", "qwen3.5-35b-a3b"]).parts == ["batch1", "offline"]


def test_greedy_runs_are_compared_by_the_top5_rule_at_their_first_difference() -> None:
    lp = lambda *tops: [{t: -float(i) for i, t in enumerate(top)} for top in tops]  # noqa: E731
    same = hybrid.compare_greedy([[1, 2]], [lp([1, 5], [2, 6])], [[1, 2]], [lp([1, 5], [2, 6])])
    assert same == {"identical_requests": 1, "top5_failures": 0, "first_difference_at": [], "first_logprob_max_diff": 0}
    # a near tie flipped at the second token: each run's token is in the other's top-5
    flip = hybrid.compare_greedy([[1, 2]], [lp([1, 5], [2, 6])], [[1, 6]], [lp([1, 5], [6, 2])])
    assert (flip["identical_requests"], flip["top5_failures"], flip["first_difference_at"]) == (0, 0, [1])
    # a token the other run did not rank at all breaks the rule; the first token's log-probabilities differ
    wrong = hybrid.compare_greedy([[1, 2]], [lp([1, 5], [2, 6])], [[7, 2]], [lp([7, 5], [2, 6])])
    assert (wrong["top5_failures"], wrong["first_difference_at"]) == (1, [0])
    assert wrong["first_logprob_max_diff"] == 0  # 5 ranked second by both
    shifted = hybrid.compare_greedy([[1]], [lp([1, 5])], [[1]], [[{1: -0.5, 5: -1.0}]])
    assert shifted["first_logprob_max_diff"] == 0.5


def test_the_floor_counts_states_at_qwen3_5_9b_shapes(tmp_path: Path) -> None:
    c = ModelConfig.from_hf_json(write_random_config(str(tmp_path), "qwen3.5-9b"))
    # 24 DeltaNet layers, each 32 float32 heads of 128 x 128 and a conv of 8,192 channels x 3, read and written
    assert hybrid.state_traffic_bytes(c, torch.bfloat16) == 2 * 24 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    weights = hybrid.step_weight_bytes(c, 1, 2)
    assert 15e9 < weights < 17e9   # about 8B parameters in bf16 besides the untied embedding table


def test_delta_rule_smoke_run(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    delta_rule.main(["--smoke", "--impls", "ours-chunked,ours-recurrent"])
    summary = json.loads((tmp_path / "delta_rule.json").read_text())
    checks = [v for row in summary["prefill"] + summary["decode"] for v in row["check"].values()]
    assert checks and all(v.startswith("ok") for v in checks)


def test_hybrid_mtp_smoke_run(tmp_path: Path, monkeypatch) -> None:
    """The MTP head's cost part: every row timed, and the drafting rows drafted."""
    monkeypatch.setenv("OUT", str(tmp_path))
    hybrid.main(["--smoke", "--parts", "mtp"])
    summary = json.loads((tmp_path / "hybrid_qwen3_5_9b_mtp.json").read_text())["mtp"]
    assert set(summary["ms_per_step"]) == {"no head", "head keeps up, no drafts", "k=1", "k=2", "k=3"}
    assert all(ms > 0 for row in summary["ms_per_step"].values() for ms in row.values())
    assert summary["draft_tokens"] > 0
