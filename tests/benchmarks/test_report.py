"""``benchmarks.report``: the summaries it writes carry what reproduces them, and the page it
makes from a folder of them is tables of exactly their numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import report

GPU = {"gpu": "NVIDIA H200", "gpus": 1, "cuda": "12.8", "torch": "2.11.0", "triton": "3.6.0"}
TWO_GPUS = dict(GPU, gpus=2)


def meta(command: str, machine: dict[str, Any] = GPU) -> dict[str, Any]:
    return {"meta": {"command": command, "machine": machine, "commit": "abc1234", "date": "2026-12-01 10:00 UTC"}}


SUMMARIES: dict[str, dict[str, Any]] = {
    "throughput": {"args": {"shapes": "qwen3-0.6b", "tensor_parallel_size": 1}, "workload": "offline-256",
                   "hf": {"requests": 32, "tok_s": 1379.4},
                   "minivllm": {"async on": {"offline": {"tok_s": 25012.3}, "batch1": {"ms_per_token": 0.9712},
                                             "vs_hf": 18.13},
                                "async off": {"offline": {"tok_s": 21001.0}, "batch1": {"ms_per_token": 1.2034},
                                              "vs_hf": 15.22}},
                   **meta("python -m benchmarks.throughput")},
    "throughput_tp2": {"args": {"shapes": "qwen3-0.6b", "tensor_parallel_size": 2}, "workload": "offline-256",
                       "minivllm": {"async on": {"offline": {"tok_s": 30100.0}, "batch1": {"ms_per_token": 0.8}}},
                       **meta("python -m benchmarks.throughput --tensor-parallel-size 2", TWO_GPUS)},
    "serving": {"rates": [{"rate": "8", "requests": 160, "failures": 0, "request_throughput": 7.91,
                           "output_tok_s": 4420.5, "ttft_ms": {"p50": 31.2, "p99": 80.9},
                           "tpot_ms": {"p50": 8.11, "p99": 12.42}, "itl_ms": {"p50": 7.9, "p99": 15.1}},
                          {"rate": "inf", "requests": 256, "failures": 1, "request_throughput": 12.5,
                           "output_tok_s": 23000.0, "ttft_ms": {"p50": 900.0, "p99": 2500.0},
                           "tpot_ms": {"p50": None, "p99": None}, "itl_ms": {"p50": 9.0, "p99": 20.0}}],
                "offline": {"tok_s": 24800.0}, "ratio_server_offline": 0.927,
                **meta("python -m benchmarks.serving")},
    "moe": {"copy_gbs": 4310.0,
            "batch1": {"ms_per_token": 1.8412, "floor_ms": 1.4251, "floor_fraction": 0.774, "goal_ms": 2.0,
                       "met": True},
            "offline": [{"workload": "offline-256", "tok_s": 9120.4, "floor_tok_s": 14210.0, "floor_fraction": 0.6418,
                         "goal_fraction": 0.7, "met": False}],
            "kernel": [{"tokens": 16, "distinct_experts": 86.5, "expert_bytes": 408.1e6, "graph_us": 120.44,
                        "floor_us": 94.68, "GBs": 3388.4, "pct_copy": 78.61, "torch_us": 2210.0, "speedup": 18.35},
                       {"tokens": 1, "distinct_experts": 8.0, "expert_bytes": 37.7e6, "floor_us": 8.75}],
            **meta("python -m benchmarks.moe")},
    "decode_attention": {"copy_gbs": 4221.4, "block_size": 64, "rows": [
        {"batch": 16, "context": 8192, "splits": 4, "eager_us": 140.25, "eager_gbs": 3830.0, "graph_us": 128.5,
         "graph_gbs": 4180.2, "graph_pct_copy": 99.02}], **meta("python -m benchmarks.decode_attention")},
    "gemv": {"rows": [{"shape": "0.6b o", "rows": 1, "N": 1024, "K": 2048, "cublas_us": 9.51, "taken_by_default": True,
                       "configs": [{"default": False, "us": 3.0}, {"default": True, "us": 3.41, "GBs": 1230.0,
                                                                    "speedup": 2.79}]}],
             "total_us": {"cublas": 9.51, "gemv": 3.41}, **meta("python -m benchmarks.gemv --quick")},
    "tp_scaling": {"pairs": [{"tp1": {"tok_s": 10000.0, "ms_per_token": 4.9}, "tp2": {"tok_s": 16500.0,
                                                                                    "ms_per_token": 3.1},
                              "throughput": 1.65, "batch1": 0.6327}],
                   "median": {"throughput": 1.65, "batch1": 0.6327},
                   **meta("python -m benchmarks.tp_scaling --pairs 1", TWO_GPUS)},
    "accuracy": {"teacher_forced": {"ours": {"flip": 0.1201, "outside_top5": 0.0, "logits_rel": 0.053},
                                    "hf": {"flip": 0.1544, "outside_top5": 0.003, "logits_rel": 0.068}},
                 "greedy": {"ours": {"mean_leading": 5.69, "top5_hits": 16, "prompts": 16},
                            "hf": {"mean_leading": 7.81, "top5_hits": 16, "prompts": 16}},
                 **meta("python -m benchmarks.accuracy")},
    "speculative": {"shapes": "qwen3-0.6b", "curve": [
        {"batch": 1, "k": 0, "accept": None, "tok_s": 950.2, "ms_per_token": 1.0524},
        {"batch": 1, "k": 4, "accept": 1.0, "tok_s": 1900.4, "ms_per_token": 0.5262, "speedup": 2.0,
         "measured_acceptance": 1.0, "tokens_per_step": 4.6, "identical": 1.0}],
        "cost_always_wrong_batch1": 1.274, "offline_ngram_finding_nothing": {"ratio": 0.973},
        **meta("python -m benchmarks.speculative --load-format dummy")},
    "draft_model": {"shapes": "qwen3-8b", "draft_shapes": "qwen3-0.6b", "k": 4, "plain_ms_per_step": 5.904,
                    "drafted_ms_per_step": 13.215, "measured_acceptance": 0.0, "tokens_per_drafted_step": 1.0,
                    "implied_speedup_at_0.6": 1.03, "implied_speedup_at_0.8": 1.502,
                    **meta("python -m benchmarks.draft_model --load-format dummy")},
    "copy_chat": {"k": 8, "rows": {"0": {"tokens": 73, "ms_per_token_off": 0.818, "ms_per_token_ngram": 0.333,
                                         "speedup": 2.456, "tokens_per_drafted_step": 6.8, "same_as_off": 0.0}},
                  "speedup_geomean": 1.69, **meta("python -m benchmarks.copy_chat")},
    "hybrid_qwen3_5_9b": {
        "batch1": {"ms_per_token": 5.52, "floor_ms": 3.806, "floor_fraction": 0.6895, "goal_floor_fraction": 0.85,
                   "met": False},
        "offline": {"workload": "offline-256", "tok_s": 4010.0, "floor_tok_s": 8020.0, "floor_fraction": 0.5},
        "prefix": {"requests": 256, "shared_tokens": 2000, "identical_outputs": False, "identical_requests": 250,
                   "top5_failures": 0,
                   "cache_on": {"wall_s": 3.5, "prompt_tokens": 518160, "computed_prompt_tokens": 8160,
                                "snapshots": 1024, "snapshot_bytes": 52.7e9},
                   "cache_off": {"wall_s": 30.25, "prompt_tokens": 518160, "computed_prompt_tokens": 518160,
                                 "snapshots": 1024, "snapshot_bytes": 52.7e9}},
        "mtp": {"ms_per_step": {"no head": {"1": 6.0, "16": 9.5}, "k=1": {"1": 12.0, "16": 9.5}}},
        **meta("python -m benchmarks.hybrid --shapes qwen3.5-9b")},
    "delta_rule": {"copy_gbs": 4200.0, "prefill": [
        {"batch": 1, "tokens": 2048, "check": {"ours-chunked": "ok out 1e-4 state 1e-7", "fla": "failed: x"},
         "ours-chunked": {"ms": 1.25, "tok_s": 1638400.0}}],
        "decode": [{"batch": 16, "tokens": 1, "check": {"ours-recurrent": "ok out 0 state 0"},
                    "ours-recurrent": {"us": 29.2, "gbs": 2314.0, "of_copy": 0.79}}],
        **meta("python -m benchmarks.delta_rule")},
}


@pytest.fixture
def page(tmp_path: Path) -> str:
    for name, data in SUMMARIES.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    (tmp_path / "something_else.json").write_text("{}")  # not a benchmark the page knows: left out
    out = tmp_path / "performance.md"
    assert report.main([str(tmp_path), "--out", str(out)]) == 0
    return out.read_text()


def rows_of(page: str, first_cell: str) -> list[list[str]]:
    """The cells of every table row whose first cell is ``first_cell``."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in page.splitlines()
            if line.startswith("|")]
    return [r for r in rows if r[0] == first_cell]


def test_page_has_a_hardware_line_and_an_index_naming_how_to_reproduce_each_summary(page: str) -> None:
    assert page.startswith("# Performance\n")
    assert ("Hardware: 1 x NVIDIA H200, CUDA 12.8, torch 2.11.0, triton 3.6.0; "
            "2 x NVIDIA H200, CUDA 12.8, torch 2.11.0, triton 3.6.0. Commit: abc1234.") in page
    index = {r[1]: r for r in (row for line in page.splitlines() if line.startswith("| `benchmarks.")
                               for row in [[c.strip() for c in line.strip().strip("|").split("|")]])}
    assert sorted(index) == sorted(SUMMARIES)
    for stem, data in SUMMARIES.items():
        assert index[stem][4] == f"`{data['meta']['command']}`"
        assert index[stem][5] == "2026-12-01 10:00 UTC"
        assert index[stem][6] == ("2 x NVIDIA H200" if data["meta"]["machine"] is TWO_GPUS else "1 x NVIDIA H200")
    assert index["throughput_tp2"][0] == "`benchmarks.throughput`"
    assert index["tp_scaling"][3] == "`make bench-tp`" and index["gemv"][3] == "`make bench`"
    assert "something_else" not in page


def test_tables_hold_the_summaries_numbers(page: str) -> None:
    tput = rows_of(page, "throughput")
    assert ["throughput", "offline-256", "qwen3-0.6b", "-", "HF transformers (32 requests)", "1,379", "-", "-"] in tput
    assert ["throughput", "offline-256", "qwen3-0.6b", "1", "minivllm, async on", "25,012", "0.971", "18.1"] in tput
    assert rows_of(page, "throughput_tp2") == [
        ["throughput_tp2", "offline-256", "qwen3-0.6b", "2", "minivllm, async on", "30,100", "0.800", "-"]]
    serving = rows_of(page, "serving")
    assert ["serving", "8", "160", "0", "7.91", "4,420", "31.2 / 80.9", "8.11 / 12.42", "7.90 / 15.10"] in serving
    assert ["serving", "inf", "256", "1", "12.50", "23,000", "900.0 / 2500.0", "- / -", "9.00 / 20.00"] in serving
    assert ["serving", "24,800", "0.927"] in serving
    assert rows_of(page, "moe") == [
        ["moe", "batch-1 ms/token", "1.841", "1.425", "0.77", "<= 2.0 ms/token", "MET"],
        ["moe", "offline-256 tok/s", "9,120", "14,210", "0.64", ">= 0.70 of the floor", "not met"],
        ["moe", "16", "86.5", "408.1", "120.4", "94.7", "3,388", "78.6", "2210.0", "18.4"],
        ["moe", "1", "8.0", "37.7", "-", "8.8", "-", "-", "-", "-"]]   # untimed: checked only
    assert "% of copy (4,310 GB/s)" in page
    assert "graph % of copy (4,221 GB/s)" in page
    assert rows_of(page, "decode_attention") == [
        ["decode_attention", "64", "16", "8192", "4", "140.2", "3,830", "128.5", "4,180", "99.0"]]
    assert rows_of(page, "gemv") == [["gemv", "0.6b o", "1", "1024 x 2048", "9.51", "3.41", "1,230", "2.79", "yes"],
                                     ["gemv", "sum", "", "", "9.5", "3.4", "", "", ""]]
    assert rows_of(page, "tp_scaling") == [
        ["tp_scaling", "1", "10,000", "16,500", "1.650", "4.900", "3.100", "0.633"],
        ["tp_scaling", "median", "", "", "1.650", "", "", "0.633"]]
    assert rows_of(page, "speculative") == [
        ["speculative", "qwen3-0.6b", "1", "0", "no drafts", "950", "1.052", "-", "-", "-", "-"],
        ["speculative", "qwen3-0.6b", "1", "4", "1.0", "1,900", "0.526", "2.00", "1.00", "4.60", "1.00"],
        ["speculative", "every draft wrong, batch 1, k 4: ms/token x no drafts", "", "", "", "", "", "1.274", "", "",
         ""],
        ["speculative", "offline n-gram finding nothing: tok/s x off", "", "", "", "", "", "0.973", "", "", ""]]
    assert rows_of(page, "draft_model") == [
        ["draft_model", "qwen3-8b", "qwen3-0.6b", "4", "5.904", "13.215", "0.000", "1.00", "1.03", "1.50"]]
    assert rows_of(page, "copy_chat") == [["copy_chat", "0", "8", "73", "0.818", "0.333", "2.46", "6.80", "no"],
                                          ["copy_chat", "geometric mean", "", "", "", "", "1.69", "", ""]]
    assert rows_of(page, "hybrid_qwen3_5_9b") == [
        ["hybrid_qwen3_5_9b", "batch-1 ms/token", "5.520", "3.806", "0.69", ">= 0.85 of the floor's speed", "not met"],
        ["hybrid_qwen3_5_9b", "offline-256 tok/s", "4,010", "8,020", "0.50", "-", "-"],
        ["hybrid_qwen3_5_9b", "on", "256", "2,000", "8,160 of 518,160", "3.50", "1024", "52.70", "250 of 255", "0"],
        ["hybrid_qwen3_5_9b", "off", "256", "2,000", "518,160 of 518,160", "30.25", "1024", "52.70", "250 of 255", "0"],
        ["hybrid_qwen3_5_9b", "no head", "6.00 (x1.00)", "9.50 (x1.00)"],
        ["hybrid_qwen3_5_9b", "k=1", "12.00 (x2.00)", "9.50 (x1.00)"]]
    assert rows_of(page, "delta_rule") == [
        ["delta_rule", "prefill", "1 x 2048", "fla", "-", "-", "failed:"],
        ["delta_rule", "prefill", "1 x 2048", "ours-chunked", "1.250 ms", "1,638,400 tok/s", "ok"],
        ["delta_rule", "decode", "16 x 1", "ours-recurrent", "29.2 us", "2,314 GB/s (0.79 of 4,200)", "ok"]]
    assert rows_of(page, "accuracy") == [
        ["accuracy", "minivllm", "0.120", "0.000", "5.30e-02", "5.69", "16 / 16"],
        ["accuracy", "HF transformers", "0.154", "0.003", "6.80e-02", "7.81", "16 / 16"]]


def test_sections_follow_one_order_and_only_for_summaries_present(page: str) -> None:
    headings = [line.split(":")[0] for line in page.splitlines() if line.startswith("## ")]
    assert headings == ["## throughput", "## serving", "## moe", "## decode_attention", "## gemv", "## accuracy",
                        "## speculative", "## draft_model", "## copy_chat", "## hybrid", "## delta_rule",
                        "## tp_scaling"]


def test_missing_values_are_dashes(tmp_path: Path) -> None:
    (tmp_path / "long_context.json").write_text(json.dumps({"shape": "16 x 8,192", "prefill": {
        "minivllm": {"tok_s": 250000.0}}}))
    page = report.render(report.load(tmp_path))
    assert "Hardware: unknown. Commit: -." in page
    assert rows_of(page, "long_context") == [["long_context", "16 x 8,192", "250,000", "-", "-", "-", "-", "-"]]


def test_a_folder_without_summaries_is_an_error(tmp_path: Path, capsys) -> None:
    assert report.main([str(tmp_path), "--out", str(tmp_path / "page.md")]) == 1
    assert not (tmp_path / "page.md").exists()
    assert "no benchmark summary" in capsys.readouterr().err


def test_write_summary_adds_what_reproduces_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(report.OUT_ENV, raising=False)
    assert report.write_summary("engine_host", {"ms_per_step": 1.0}) is None  # nowhere to write
    monkeypatch.setenv(report.OUT_ENV, str(tmp_path / "out"))
    path = report.write_summary("engine_host", {"ms_per_step": 1.0})
    assert path == tmp_path / "out" / "engine_host.json"
    data = json.loads(path.read_text())
    assert data["ms_per_step"] == 1.0
    assert set(data["meta"]) == {"command", "machine", "commit", "date"} and "torch" in data["meta"]["machine"]
    other = report.write_summary("serving", {"rates": []}, path=tmp_path / "elsewhere.json")
    assert other == tmp_path / "elsewhere.json" and other.exists()
    assert report.section_of("engine_host") == "engine_host" and report.load(tmp_path / "out")["engine_host"]
    # the longest name wins: fp8_gemm has a section of its own, fp8_kv would be fp8's
    assert (report.section_of("fp8_gemm"), report.section_of("fp8_kv"), report.section_of("moe_fp8")) == (
        "fp8_gemm", "fp8", "moe")


def test_batch1_cells_show_the_median_then_the_range_of_its_rounds(tmp_path: Path) -> None:
    spread = {"ms_per_token": 0.918, "rounds_ms_per_token": [0.93, 0.918, 1.49, 0.91, 0.92], "min": 0.91,
              "max": 1.49}
    summaries = {
        "throughput": {"workload": "offline-256", "minivllm": {"async on": {"offline": {"tok_s": 25000.0},
                                                                            "batch1": spread}}},
        "moe": {"batch1": {**spread, "floor_ms": 0.5, "goal_ms": 2.0, "met": True}},
        "fp8": {"offline": {"bf16": {"tok_s": 24000.0, "batch1": spread},
                            "fp8-kv": {"tok_s": 31000.0, "batch1": {"ms_per_token": 1.1,
                                                                    "rounds_ms_per_token": [1.1], "min": 1.1,
                                                                    "max": 1.1}}}}}
    for name, data in summaries.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    page = report.render(report.load(tmp_path))
    cell = "0.918 (0.910-1.490, 5 rounds)"
    assert rows_of(page, "throughput")[0][6] == cell
    assert rows_of(page, "moe")[0][2] == cell
    fp8 = rows_of(page, "fp8")
    assert (fp8[0][4], fp8[1][4]) == (cell, "1.100")   # one round: no range


def test_keep_carries_the_sections_a_partial_run_did_not_measure(page: str, tmp_path: Path) -> None:
    """``--keep``: a run of two benchmarks replaces their sections and index rows, and every other
    section, with its index row, stands as the page had it; without ``--keep`` they go."""
    out = tmp_path / "performance.md"
    partial = tmp_path / "partial"
    partial.mkdir()
    newer = {"meta": {**SUMMARIES["gemv"]["meta"], "commit": "def5678", "date": "2026-12-07 09:00 UTC"}}
    (partial / "gemv.json").write_text(json.dumps({**SUMMARIES["gemv"], **newer, "total_us": {"cublas": 1.0}}))
    (partial / "moe_fp8.json").write_text(json.dumps({**SUMMARIES["moe"], **newer}))   # moe's section, renamed
    assert report.main([str(partial), "--out", str(out), "--keep"]) == 0
    kept = out.read_text()

    def block(text: str, name: str) -> str:
        return text.split(f"\n## {name}:")[1].split("\n## ")[0]
    for name in ("throughput", "serving", "decode_attention", "accuracy", "hybrid", "delta_rule", "tp_scaling"):
        assert block(kept, name) == block(page, name)
    assert rows_of(kept, "gemv")[-1] == ["gemv", "sum", "", "", "1.0", "-", "", "", ""]
    assert rows_of(kept, "moe") == [] and rows_of(kept, "moe_fp8")[0][:3] == ["moe_fp8", "batch-1 ms/token", "1.841"]
    index = [line for line in kept.splitlines() if line.startswith("| `benchmarks.")]
    assert [line.split("|")[2].strip() for line in index] == [
        "throughput", "throughput_tp2", "serving", "moe_fp8", "decode_attention", "gemv", "accuracy", "speculative",
        "draft_model", "copy_chat", "hybrid_qwen3_5_9b", "delta_rule", "tp_scaling"]
    assert "2026-12-07 09:00 UTC" in index[5] and "2026-12-01 10:00 UTC" in index[4]
    assert "Commit: abc1234, def5678." in kept
    # without --keep the page is the folder's alone
    assert report.main([str(partial), "--out", str(out)]) == 0
    assert [line.split(":")[0] for line in out.read_text().splitlines() if line.startswith("## ")] == [
        "## moe", "## gemv"]


def test_keep_reads_a_page_from_before_the_machine_column(tmp_path: Path) -> None:
    old = ("# Performance\n\nHardware: 1 x NVIDIA H100 80GB HBM3, CUDA 13.0, torch 2.11.0, triton 3.6.0. Commit: 1111111."
           "\n\n| benchmark | summary | measures | make target | command | date |\n|---|---|---|---|---|---|\n"
           "| `benchmarks.sampler` | sampler | the sampler | `make bench` | `python -m benchmarks.sampler` | "
           "2026-12-06 06:55 UTC |\n\n## sampler: the sampler\n\n| summary | x |\n|---|---|\n| sampler | 1.0 |\n")
    kept = report.parse_page(old)
    assert kept.machines == ["1 x NVIDIA H100 80GB HBM3, CUDA 13.0, torch 2.11.0, triton 3.6.0"]
    assert kept.commits == ["1111111"]
    assert kept.index["sampler"][0].endswith("| 2026-12-06 06:55 UTC | 1 x NVIDIA H100 80GB HBM3 |")
    assert kept.blocks["sampler"][-1] == "| sampler | 1.0 |"
    page = report.render(report.load(_folder(tmp_path, "gemv")), kept)
    assert rows_of(page, "sampler") == [["sampler", "1.0"]] and rows_of(page, "gemv")
    assert "Commit: 1111111, abc1234." in page


def _folder(tmp_path: Path, *names: str) -> Path:
    folder = tmp_path / "summaries"
    folder.mkdir()
    for name in names:
        (folder / f"{name}.json").write_text(json.dumps(SUMMARIES[name]))
    return folder


def test_the_committed_page_is_what_the_committed_summaries_make() -> None:
    """docs/performance.md is generated from docs/summaries/ (the sections without a summary
    there kept as they stand): a hand edit of a summary's number, or a summary added without the page,
    fails here."""
    root = Path(report.__file__).resolve().parent.parent
    page = (root / "docs" / "performance.md").read_text()
    assert report.render(report.load(root / "docs" / "summaries"), report.parse_page(page)) == page
