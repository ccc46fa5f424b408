"""The benchmarks' JSON summaries, written and read: ``write_summary`` is what every
benchmark calls, and ``python -m benchmarks.report DIR`` turns the summaries in DIR into
``docs/performance.md`` (``make bench`` runs it after the benchmarks).

    python -m benchmarks.report DIR [--out docs/performance.md]   # --out -: stdout
    python -m benchmarks.report DIR --keep   # sections without a summary in DIR: as the page has them

A summary is ``<name>.json``: the benchmark's own data plus ``meta`` (the command that
produced it, the machine, the commit, the date). The page is tables only, every number
copied from a summary: an index naming each summary's benchmark, make target and command,
then one section per benchmark. A summary the page does not know is left out.

``make bench`` copies each summary it writes into ``docs/summaries/`` (committed), replacing
that name's earlier one, and builds the page from that folder: a run of some benchmarks
(``BENCH_ONLY``) updates their rows and leaves the others' as they were measured. A summary
brought back from another machine goes there too, then ``python -m benchmarks.report
docs/summaries --keep``.

``--keep``: a section none of whose summaries is in DIR is kept from the current page as it
stands, its index rows and its table, with their dates (the sections of runs from before
their summaries were kept); the header then names the kept part's machines and commits too.
A section with a summary in DIR is rendered from DIR alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PAGE = REPO_ROOT / "docs" / "performance.md"
OUT_ENV = "OUT"  # the folder summaries go to (``make bench`` sets it); unset: none written


# ---- writing ---------------------------------------------------------------------------

def write_summary(name: str, data: dict[str, Any], path: str | os.PathLike[str] | None = None) -> Path | None:
    """Write ``data`` with its ``meta`` to ``path``, or to ``$OUT/<name>.json`` when OUT is
    set (else nothing); draw its figure beside it (``benchmarks.plots``). Returns the file."""
    if path is None:
        out = os.environ.get(OUT_ENV)
        if not out:
            return None
        path = Path(out) / f"{name}.json"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({**data, "meta": run_meta()}, f, indent=1, default=str)
    print(f"summary written to {path}")
    from benchmarks.plots import figure_beside

    figure_beside(path)
    return path


def run_meta() -> dict[str, Any]:
    """What reproduces a summary: the command, the machine, the commit and the date."""
    return {"command": command_line(), "machine": machine(), "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def command_line() -> str:
    """``python -m benchmarks.<module> ARGS`` for a module run with ``-m``, else argv."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.startswith("benchmarks."):
        return shlex.join(["python", "-m", spec.name, *sys.argv[1:]])
    return shlex.join(["python", *sys.argv])


def machine() -> dict[str, Any]:
    """GPU model and count, CUDA, torch and triton versions (the CPU when there is no GPU)."""
    try:
        import torch
    except ImportError:  # engine_host needs no torch
        return {"cpu": platform.processor() or platform.machine()}
    info: dict[str, Any] = {"torch": torch.__version__}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(), cuda=torch.version.cuda)
    else:
        info["cpu"] = platform.processor() or platform.machine()
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def git_commit() -> str | None:
    """The checkout's commit (``+`` when files differ from it), or None outside a git tree."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


# ---- reading ---------------------------------------------------------------------------

def get(d: Any, *keys: str | int) -> Any:
    """``d[k0][k1]...``, or None where any level is missing."""
    for k in keys:
        try:
            d = d[k]
        except (KeyError, IndexError, TypeError):
            return None
    return d


def fmt(value: Any, spec: str = "") -> str:
    """A table cell: ``-`` for a missing value, else ``value`` formatted by ``spec``."""
    if value is None:
        return "-"
    if isinstance(value, float) and spec == "":
        spec = ".3g"
    return format(value, spec)


def pair(p: Any, spec: str = ".1f") -> str:
    """``p50 / p99`` of a percentile entry."""
    return f"{fmt(get(p, 'p50'), spec)} / {fmt(get(p, 'p99'), spec)}"


def batch1_ms(b: Any) -> str:
    """A batch-1 cell: the median ms/token, then the range of its rounds where there were
    several (``0.918 (0.910-1.490, 5 rounds)``)."""
    cell = fmt(get(b, "ms_per_token"), ".3f")
    rounds = get(b, "rounds_ms_per_token") or []
    if len(rounds) > 1:
        cell += f" ({fmt(get(b, 'min'), '.3f')}-{fmt(get(b, 'max'), '.3f')}, {len(rounds)} rounds)"
    return cell


def table(headers: list[str], rows: Iterable[list[str]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)] + table_rows(rows)


def table_rows(rows: Iterable[list[str]]) -> list[str]:
    return ["| " + " | ".join(row) + " |" for row in rows]


Summaries = list[tuple[str, dict[str, Any]]]  # (file stem, content), in file-name order


def throughput_section(runs: Summaries) -> list[str]:
    rows = []
    for stem, d in runs:
        shapes, tp = get(d, "args", "shapes"), get(d, "args", "tensor_parallel_size")
        if "tok_s" in (d.get("hf") or {}):
            rows.append([stem, fmt(d.get("workload")), fmt(shapes), "-",
                         f"HF transformers ({fmt(d['hf'].get('requests'))} requests)",
                         fmt(d["hf"]["tok_s"], ",.0f"), "-", "-"])
        for mode in ("async on", "async off"):
            m = get(d, "minivllm", mode)
            if m is not None:
                rows.append([stem, fmt(d.get("workload")), fmt(shapes), fmt(tp), f"minivllm, {mode}",
                             fmt(get(m, "offline", "tok_s"), ",.0f"), batch1_ms(m.get("batch1")),
                             fmt(m.get("vs_hf"), ".1f")])
    return table(["summary", "workload", "shapes", "TP", "engine", "offline tok/s", "batch-1 ms/token", "x HF"], rows)


def serving_section(runs: Summaries) -> list[str]:
    lines: list[str] = []
    for stem, d in runs:
        lines += table(["summary", "rate (req/s)", "requests", "failures", "req/s", "output tok/s",
                        "TTFT p50 / p99 ms", "TPOT p50 / p99 ms", "ITL p50 / p99 ms"],
                       [[stem, fmt(r.get("rate")), fmt(r.get("requests")), fmt(r.get("failures")),
                         fmt(r.get("request_throughput"), ".2f"), fmt(r.get("output_tok_s"), ",.0f"),
                         pair(r.get("ttft_ms")), pair(r.get("tpot_ms"), ".2f"), pair(r.get("itl_ms"), ".2f")]
                        for r in d.get("rates", [])])
        lines += [""] + table(["summary", "offline generate() tok/s", "server at rate inf / offline"],
                              [[stem, fmt(get(d, "offline", "tok_s"), ",.0f"),
                                fmt(d.get("ratio_server_offline"), ".3f")]]) + [""]
    return lines[:-1]


def long_context_section(runs: Summaries) -> list[str]:
    return table(["summary", "prompts", "prefill tok/s", "HF SDPA forward tok/s", "x HF", "decode ms/step",
                  "decode floor ms", "decode context"],
                 [[stem, fmt(d.get("shape")), fmt(get(d, "prefill", "minivllm", "tok_s"), ",.0f"),
                   fmt(get(d, "prefill", "hf", "tok_s"), ",.0f"), fmt(get(d, "prefill", "vs_hf"), ".2f"),
                   fmt(get(d, "decode", "median_ms"), ".3f"), fmt(get(d, "decode", "floor_ms"), ".3f"),
                   fmt(get(d, "decode", "context"), ",.0f")] for stem, d in runs])


def moe_section(runs: Summaries) -> list[str]:
    """Batch-1 and offline beside their floors, then the experts of one layer alone."""
    rows = []
    for stem, d in runs:
        b = d.get("batch1")
        if b is not None:
            rows.append([stem, "batch-1 ms/token", batch1_ms(b), fmt(b.get("floor_ms"), ".3f"),
                         fmt(b.get("floor_fraction"), ".2f"), f"<= {fmt(b.get('goal_ms'), '.1f')} ms/token",
                         _met(b.get("met"))])
        for r in d.get("offline", []):
            rows.append([stem, f"{fmt(r.get('workload'))} tok/s", fmt(r.get("tok_s"), ",.0f"),
                         fmt(r.get("floor_tok_s"), ",.0f"), fmt(r.get("floor_fraction"), ".2f"),
                         f">= {fmt(r.get('goal_fraction'), '.2f')} of the floor", _met(r.get("met"))])
    lines = table(["summary", "run", "measured", "floor", "fraction of the floor's speed", "goal", "met"], rows)
    for stem, d in runs:
        lines += [""] + table(
            ["summary", "tokens", "distinct experts", "expert MB", "graph us", "floor us", "GB/s",
             f"% of copy ({fmt(d.get('copy_gbs'), ',.0f')} GB/s)", "torch loop us", "x torch loop"],
            [[stem, fmt(r.get("tokens")), fmt(r.get("distinct_experts"), ".1f"),
              fmt(r["expert_bytes"] / 1e6 if "expert_bytes" in r else None, ".1f"), fmt(r.get("graph_us"), ".1f"),
              fmt(r.get("floor_us"), ".1f"), fmt(r.get("GBs"), ",.0f"), fmt(r.get("pct_copy"), ".1f"),
              fmt(r.get("torch_us"), ".1f"), fmt(r.get("speedup"), ".1f")] for r in d.get("kernel", [])])
    return lines


def fp8_section(runs: Summaries) -> list[str]:
    """Every 8-bit variant beside bf16 of the same run: offline, batch-1, long-context decode,
    and its agreement with bf16."""
    rows = []
    for stem, d in runs:
        off, long, acc = d.get("offline", {}), d.get("long_context", {}), d.get("accuracy", {})
        for name in dict.fromkeys([*off, *long, *acc]):
            o, lc, a = off.get(name, {}), long.get(name, {}), acc.get(name, {})
            goals = "; ".join(f"{key} <= {g['goal']:g}: {_met(g['met'])}" if key.endswith("_ms")
                              else f"{key} >= {g['goal']:,.0f}: {_met(g['met'])}"
                              for r in (o, lc) for key, g in r.get("goals", {}).items()) or "-"
            rows.append([stem, name, fmt(o.get("tok_s"), ",.0f"), fmt(o.get("kv_blocks")),
                         batch1_ms(o.get("batch1")), fmt(lc.get("median_ms"), ".3f"),
                         fmt(lc.get("floor_ms"), ".3f"),
                         "-" if not a else f"{a['top5_failures']} / {a['prompts']}",
                         fmt(a.get("mean_kl"), ".2e"), goals])
    lines = table(["summary", "variant", "offline tok/s", "KV blocks", "batch-1 ms/token", "long-context decode ms",
                   "its floor ms", "top-5 rule broken", "mean KL vs bf16", "goals"], rows)
    kernel = [[stem, name, fmt(r.get("us"), ".1f"), fmt(r.get("kv_bytes", 0) / 1e9, ".3f"), fmt(r.get("gbs"), ",.0f"),
               fmt(100 * r.get("copy_fraction", 0), ".1f")]
              for stem, d in runs for name, r in d.get("attention", {}).items()]
    if kernel:
        lines += [""] + table(["summary", "decode attention, cache", "us", "K/V GB", "GB/s", "% of copy"], kernel)
    return lines


def _met(ok: bool | None) -> str:
    return "-" if ok is None else ("MET" if ok else "not met")


def engine_host_section(runs: Summaries) -> list[str]:
    return table(["summary", "batch", "output kind", "steps", "engine host ms/step"],
                 [[stem, fmt(d.get("batch")), fmt(d.get("output_kind")), fmt(d.get("steps")),
                   fmt(d.get("ms_per_step"), ".3f")] for stem, d in runs])


def decode_attention_section(runs: Summaries) -> list[str]:
    lines: list[str] = []
    for stem, d in runs:
        lines += table(["summary", "block size", "batch", "context", "splits", "eager us", "eager GB/s",
                        "graph us", "graph GB/s", f"graph % of copy ({fmt(d.get('copy_gbs'), ',.0f')} GB/s)"],
                       [[stem, fmt(d.get("block_size")), fmt(r.get("batch")), fmt(r.get("context")),
                         fmt(r.get("splits")), fmt(r.get("eager_us"), ".1f"), fmt(r.get("eager_gbs"), ",.0f"),
                         fmt(r.get("graph_us"), ".1f"), fmt(r.get("graph_gbs"), ",.0f"),
                         fmt(r.get("graph_pct_copy"), ".1f")] for r in d.get("rows", [])]) + [""]
    return lines[:-1]


def prefill_attention_section(runs: Summaries) -> list[str]:
    rows = []
    for stem, d in runs:
        for r in d.get("results", []):
            default = next((c for c in r.get("configs", []) if c.get("default")), {})
            best = next((c for c in r.get("configs", []) if c.get("name") == r.get("best")), {})
            sdpa = next(iter(r.get("sdpa", [])), {})
            rows.append([stem, fmt(d.get("block_size")), fmt(r.get("shape")), fmt(r.get("default")),
                         fmt(default.get("ms"), ".3f"), fmt(default.get("tflops"), ".0f"),
                         fmt(sdpa.get("ms"), ".3f"), fmt(default.get("pct_sdpa"), ".0f"),
                         fmt(r.get("best")), fmt(best.get("tflops"), ".0f")])
    return table(["summary", "block size", "shape", "default config", "ms", "TFLOP/s", "SDPA ms", "% of SDPA",
                  "best config", "best TFLOP/s"], rows)


def gemv_section(runs: Summaries) -> list[str]:
    rows = []
    for stem, d in runs:
        for r in d.get("rows", []):
            default = next((c for c in r.get("configs", []) if c.get("default")), {})
            rows.append([stem, fmt(r.get("shape")), fmt(r.get("rows")), f"{fmt(r.get('N'))} x {fmt(r.get('K'))}",
                         fmt(r.get("cublas_us"), ".2f"), fmt(default.get("us"), ".2f"), fmt(default.get("GBs"), ",.0f"),
                         fmt(default.get("speedup"), ".2f"), "yes" if r.get("taken_by_default") else "no"])
        total = d.get("total_us") or {}
        rows.append([stem, "sum", "", "", fmt(total.get("cublas"), ".1f"), fmt(total.get("gemv"), ".1f"), "", "", ""])
    return table(["summary", "shape", "rows", "N x K", "cuBLAS us", "gemv us (default config)", "GB/s",
                  "x cuBLAS", "taken by the engine"], rows)


def fp8_gemm_section(runs: Summaries) -> list[str]:
    """Per (GEMM, scales, M): the FP8 GEMM beside cuBLAS bf16, torch._scaled_mm and, at M = 1,
    the FP8 GEMV (``unsupported`` where torch lacks the mode on the device)."""
    lines: list[str] = []
    for stem, d in runs:
        rows = []
        for r in d.get("rows", []):
            res = r.get("results") or {}
            ours, cublas = res.get("fp8_gemm") or {}, res.get("cublas_bf16") or {}
            rows.append([stem, fmt(r.get("gemm")), fmt(r.get("mode")), fmt(r.get("M")),
                         f"{fmt(r.get('N'))} x {fmt(r.get('K'))}", fmt(ours.get("us"), ".2f"),
                         fmt(ours.get("GBs"), ",.0f"), fmt(ours.get("pct_copy"), ".1f"), fmt(ours.get("TFLOPs"), ".1f"),
                         fmt(cublas.get("us"), ".2f"), fmt(ours.get("x_cublas"), ".2f"),
                         _us_or_unsupported(res.get("scaled_mm")), _us_or_unsupported(res.get("fp8_gemv"))])
        lines += table(["summary", "GEMM", "scales", "M", "N x K", "fp8_gemm us", "GB/s",
                        f"% of copy ({fmt(d.get('copy_gbs'), ',.0f')} GB/s)", "TFLOP/s", "cuBLAS bf16 us",
                        "x cuBLAS", "torch._scaled_mm us", "fp8_gemv us"], rows) + [""]
    return lines[:-1]


def _us_or_unsupported(entry: dict[str, Any] | None) -> str:
    return "unsupported" if entry and "unsupported" in entry else fmt(get(entry, "us"), ".2f")


def sampler_section(runs: Summaries) -> list[str]:
    return table(["summary", "rows", "case", "torch reference ms", "fused ms", "speedup", "host build us"],
                 [[stem, fmt(r.get("rows")), fmt(r.get("case")), fmt(r.get("reference_ms"), ".3f"),
                   fmt(r.get("fused_ms"), ".3f"), fmt(r.get("speedup"), ".1f"), fmt(r.get("build_us"), ".1f")]
                  for stem, d in runs for r in d.get("results", [])])


def structured_outputs_section(runs: Summaries) -> list[str]:
    rows = []
    for stem, d in runs:
        for name in ("unconstrained", "json_schema"):
            for i, r in enumerate(get(d, "rounds", name) or []):
                rows.append([stem, fmt(d.get("workload")), name, str(i), fmt(r.get("completion_tokens"), ",d"),
                             fmt(r.get("tok_s"), ",.0f"),
                             fmt(r.get("mask_ms_per_step"), ".3f") if name == "json_schema" else "-"])
        rows.append([stem, fmt(d.get("workload")), "JSON / unconstrained (medians)", "", "",
                     fmt(d.get("ratio"), ".3f"), fmt(d.get("mask_ms_per_step"), ".3f")])
    return table(["summary", "workload", "requests", "round", "completion tokens", "tok/s",
                  "host mask ms per step"], rows)


def accuracy_section(runs: Summaries) -> list[str]:
    rows = []
    for stem, d in runs:
        for side, name in (("ours", "minivllm"), ("hf", "HF transformers")):
            tf, greedy = get(d, "teacher_forced", side) or {}, get(d, "greedy", side) or {}
            rows.append([stem, name, fmt(tf.get("flip"), ".3f"), fmt(tf.get("outside_top5"), ".3f"),
                         fmt(tf.get("logits_rel"), ".2e"), fmt(greedy.get("mean_leading"), ".2f"),
                         f"{fmt(greedy.get('top5_hits'))} / {fmt(greedy.get('prompts'))}"])
    return table(["summary", "engine", "bf16 argmax != fp32 (teacher-forced)", "outside fp32 top-5",
                  "logits rel. error", "greedy tokens identical to fp32 (mean)", "first difference in fp32 top-5"],
                 rows)


def tp_scaling_section(runs: Summaries) -> list[str]:
    rows = []
    for stem, d in runs:
        for i, p in enumerate(d.get("pairs", []), 1):
            rows.append([stem, str(i), fmt(get(p, "tp1", "tok_s"), ",.0f"), fmt(get(p, "tp2", "tok_s"), ",.0f"),
                         fmt(p.get("throughput"), ".3f"), fmt(get(p, "tp1", "ms_per_token"), ".3f"),
                         fmt(get(p, "tp2", "ms_per_token"), ".3f"), fmt(p.get("batch1"), ".3f")])
        rows.append([stem, "median", "", "", fmt(get(d, "median", "throughput"), ".3f"), "", "",
                     fmt(get(d, "median", "batch1"), ".3f")])
    return table(["summary", "pair", "TP=1 tok/s", "TP=2 tok/s", "throughput TP=2 / TP=1", "TP=1 ms/token",
                  "TP=2 ms/token", "batch-1 TP=2 / TP=1"], rows)


def all_reduce_section(runs: Summaries) -> list[str]:
    return table(["summary", "ranks", "rows", "KB", "NCCL us", "one-shot us", "two-shot us", "engine's pick us",
                  "fused with add + RMSNorm us", "all-reduce, then add + RMSNorm us"],
                 [[stem, fmt(get(d, "args", "world_size")), fmt(r.get("rows")), fmt(r.get("kb"), ",.0f"),
                   fmt(r.get("nccl_us"), ".2f"), fmt(r.get("one_shot_us"), ".2f"), fmt(r.get("two_shot_us"), ".2f"),
                   fmt(r.get("engine_us"), ".2f"), fmt(r.get("fused_norm_us"), ".2f"),
                   fmt(r.get("unfused_norm_us"), ".2f")]
                  for stem, d in runs for r in d.get("rows", [])])


def speculative_section(runs: Summaries) -> list[str]:
    rows = []
    for stem, d in runs:
        for r in d.get("curve", []):
            rows.append([stem, fmt(d.get("shapes")), fmt(r.get("batch")), fmt(r.get("k")),
                         "no drafts" if r.get("accept") is None else fmt(r.get("accept"), ".1f"),
                         fmt(r.get("tok_s"), ",.0f"), fmt(r.get("ms_per_token"), ".3f"), fmt(r.get("speedup"), ".2f"),
                         fmt(r.get("measured_acceptance"), ".2f"), fmt(r.get("tokens_per_step"), ".2f"),
                         fmt(r.get("identical"), ".2f")])
        rows.append([stem, "every draft wrong, batch 1, k 4: ms/token x no drafts", "", "", "", "", "",
                     fmt(d.get("cost_always_wrong_batch1"), ".3f"), "", "", ""])
        rows.append([stem, "offline n-gram finding nothing: tok/s x off", "", "", "", "", "",
                     fmt(get(d, "offline_ngram_finding_nothing", "ratio"), ".3f"), "", "", ""])
    return table(["summary", "shapes", "batch", "k", "acceptance", "tok/s", "ms/token", "x no drafts",
                  "drafts kept", "tokens a step", "identical share"], rows)


def draft_model_section(runs: Summaries) -> list[str]:
    return table(["summary", "target", "draft", "k", "plain ms/step", "drafted ms/step", "drafts kept (measured)",
                  "tokens a drafted step", "implied x at acceptance 0.6", "implied x at 0.8"],
                 [[stem, fmt(d.get("shapes")), fmt(d.get("draft_shapes")), fmt(d.get("k")),
                   fmt(d.get("plain_ms_per_step"), ".3f"), fmt(d.get("drafted_ms_per_step"), ".3f"),
                   fmt(d.get("measured_acceptance"), ".3f"), fmt(d.get("tokens_per_drafted_step"), ".2f"),
                   fmt(d.get("implied_speedup_at_0.6"), ".2f"), fmt(d.get("implied_speedup_at_0.8"), ".2f")]
                  for stem, d in runs])


def copy_chat_section(runs: Summaries) -> list[str]:
    rows = []
    for stem, d in runs:
        for chat, r in sorted((d.get("rows") or {}).items()):
            rows.append([stem, chat, fmt(d.get("k")), fmt(r.get("tokens")), fmt(r.get("ms_per_token_off"), ".3f"),
                         fmt(r.get("ms_per_token_ngram"), ".3f"), fmt(r.get("speedup"), ".2f"),
                         fmt(r.get("tokens_per_drafted_step"), ".2f"), "yes" if r.get("same_as_off") else "no"])
        rows.append([stem, "geometric mean", "", "", "", "", fmt(d.get("speedup_geomean"), ".2f"), "", ""])
    return table(["summary", "chat", "k", "tokens", "ms/token, no drafts", "ms/token, n-gram", "speedup",
                  "tokens a drafted step", "same tokens as no drafts"], rows)


def hybrid_section(runs: Summaries) -> list[str]:
    """Qwen3.5 shapes: batch-1 and offline beside their floors; the shared-prefix workload with
    the cache on and off; the MTP head's cost a decode step."""
    rows = []
    for stem, d in runs:
        b = d.get("batch1")
        if b is not None:
            rows.append([stem, "batch-1 ms/token", batch1_ms(b), fmt(b.get("floor_ms"), ".3f"),
                         fmt(b.get("floor_fraction"), ".2f"),
                         f">= {fmt(b.get('goal_floor_fraction'), '.2f')} of the floor's speed", _met(b.get("met"))])
        o = d.get("offline")
        if o is not None:
            rows.append([stem, f"{fmt(o.get('workload'))} tok/s", fmt(o.get("tok_s"), ",.0f"),
                         fmt(o.get("floor_tok_s"), ",.0f"), fmt(o.get("floor_fraction"), ".2f"), "-", "-"])
    lines = table(["summary", "run", "measured", "floor", "fraction of the floor's speed", "goal", "met"], rows)
    prefix = [(stem, d["prefix"]) for stem, d in runs if d.get("prefix")]
    if prefix:
        lines += [""] + table(
            ["summary", "prefix cache", "requests", "shared tokens", "prompt tokens computed", "wall s",
             "snapshots", "snapshot GB", "outputs identical", "first difference outside the other's top-5"],
            [[stem, name.removeprefix("cache_"), fmt(p.get("requests")), fmt(p.get("shared_tokens"), ","),
              f"{fmt(get(p, name, 'computed_prompt_tokens'), ',')} of {fmt(get(p, name, 'prompt_tokens'), ',')}",
              fmt(get(p, name, "wall_s"), ".2f"), fmt(get(p, name, "snapshots")),
              fmt((get(p, name, "snapshot_bytes") or 0) / 1e9 if get(p, name, "snapshot_bytes") is not None
                  else None, ".2f"),
              identical_cell(p), fmt(p.get("top5_failures"))]
             for stem, p in prefix for name in ("cache_on", "cache_off")])
    for stem, d in runs:
        steps = get(d, "mtp", "ms_per_step")
        if not steps:
            continue
        batches = sorted({b for row in steps.values() for b in row}, key=int)
        base = steps.get("no head", {})
        lines += [""] + table(["summary", "MTP head"] + [f"ms/step, batch {b}" for b in batches],
                              [[stem, name] + [fmt(row.get(b), ".2f") + (f" (x{row[b] / base[b]:.2f})"
                                                                        if b in row and base.get(b) else "")
                                               for b in batches] for name, row in steps.items()])
    return lines


def identical_cell(p: dict[str, Any]) -> str:
    """``yes``, or how many of the requests gave identical tokens (``no`` where not counted)."""
    if p.get("identical_outputs"):
        return "yes"
    if p.get("identical_requests") is None:
        return "no"
    return f"{p['identical_requests']} of {p.get('requests', 1) - 1}"


def delta_rule_section(runs: Summaries) -> list[str]:
    """Each implementation's prefill tok/s and decode state bandwidth, per problem."""
    rows = []
    for stem, d in runs:
        copy = d.get("copy_gbs")
        for phase in ("prefill", "decode"):
            for r in d.get(phase, []):
                for name, check in sorted((r.get("check") or {}).items()):
                    t = r.get(name) or {}
                    time_cell = fmt(t.get("ms"), ".3f") + " ms" if phase == "prefill" else fmt(t.get("us"), ".1f") + " us"
                    rate = fmt(t.get("tok_s"), ",.0f") + " tok/s" if phase == "prefill" else \
                        f"{fmt(t.get('gbs'), ',.0f')} GB/s ({fmt(t.get('of_copy'), '.2f')} of {fmt(copy, ',.0f')})"
                    rows.append([stem, phase, f"{r.get('batch')} x {r.get('tokens')}", name,
                                 time_cell if t else "-", rate if t else "-", check.split(" ")[0]])
    return table(["summary", "phase", "sequences x tokens", "implementation", "time", "rate", "check"], rows)


# name -> (what it measures, the make target that runs it, its section), in page order
SECTIONS: dict[str, tuple[str, str, Callable[[Summaries], list[str]]]] = {
    "throughput": ("offline throughput and batch-1 decode, against HF transformers", "make bench",
                   throughput_section),
    "serving": ("the OpenAI server under Poisson arrivals", "make bench", serving_section),
    "long_context": ("prefill and decode at long context", "make bench", long_context_section),
    "moe": ("Qwen3-30B-A3B: batch-1, offline and the experts of one layer, against bandwidth floors",
            "make bench", moe_section),
    "fp8": ("8-bit beside bf16 in one run: the FP8 KV cache and FP8 weights", "make bench", fp8_section),
    "engine_host": ("host cost of the engine per decode step", "make bench", engine_host_section),
    "decode_attention": ("paged decode attention", "make bench", decode_attention_section),
    "prefill_attention": ("paged prefill attention against SDPA", "make bench", prefill_attention_section),
    "gemv": ("the GEMV kernel against cuBLAS at decode shapes", "make bench", gemv_section),
    "fp8_gemm": ("the FP8 GEMM and GEMV against cuBLAS bf16 and torch._scaled_mm, Qwen3 linear shapes",
                 "make bench", fp8_gemm_section),
    "sampler": ("the sampler", "make bench", sampler_section),
    "structured_outputs": ("offline-256 under a JSON schema against unconstrained", "make bench",
                           structured_outputs_section),
    "accuracy": ("bf16 against float32, minivllm and HF transformers", "make bench", accuracy_section),
    "speculative": ("speculative decoding: the cost of trying and the gain by acceptance, replayed drafts",
                    "make bench", speculative_section),
    "draft_model": ("a draft model: the cost of a drafted step and the speedup it implies", "make bench",
                    draft_model_section),
    "copy_chat": ("n-gram lookup on real text: SmolLM2-135M-Instruct answering copy-heavy chats, batch 1",
                  "make bench", copy_chat_section),
    "hybrid": ("Qwen3.5 hybrids: batch-1 and offline against their floors, the shared-prefix cache, the MTP head",
               "make bench", hybrid_section),
    "delta_rule": ("the gated delta rule's kernels alone, beside fla-core's where installed", "make bench",
                   delta_rule_section),
    "tp_scaling": ("TP=2 against TP=1, Qwen3-8B shapes", "make bench-tp", tp_scaling_section),
    "all_reduce": ("the tensor-parallel all-reduce", "make bench-tp", all_reduce_section),
}


def section_of(stem: str) -> str | None:
    """The section of a summary file: its name, or a name then ``_`` (``throughput_tp2``); the
    longest such name (``fp8_gemm`` is its own section, not ``fp8``'s)."""
    names = [name for name in SECTIONS if stem == name or stem.startswith(name + "_")]
    return max(names, key=len) if names else None


def load(directory: str | os.PathLike[str]) -> dict[str, Summaries]:
    """The known summaries in ``directory``, by section, each section's files in name order."""
    found: dict[str, Summaries] = {}
    for path in sorted(Path(directory).glob("*.json")):
        name = section_of(path.stem)
        if name is not None:
            with open(path) as f:
                found.setdefault(name, []).append((path.stem, json.load(f)))
    return found


def machine_line(m: dict[str, Any] | None) -> str:
    """``1 x NVIDIA H200, CUDA 12.8, torch 2.11.0, triton 3.6.0`` from a summary's machine."""
    if not m:
        return "unknown"
    parts = [f"{m.get('gpus')} x {m['gpu']}, CUDA {m.get('cuda')}" if m.get("gpu") else f"CPU {m.get('cpu')}"]
    return ", ".join(parts + [f"{key} {m[key]}" for key in ("torch", "triton") if key in m])


def machine_short(m: dict[str, Any] | None) -> str:
    """``1 x NVIDIA H200`` (or ``CPU``, ``unknown``): the index's column, since one page may
    gather summaries from different machines."""
    if not m:
        return "unknown"
    return f"{m.get('gpus')} x {m['gpu']}" if m.get("gpu") else "CPU"


@dataclass
class KeptPage:
    """What ``--keep`` carries over from a page: its header's machines and commits, and per
    section, its index rows and its block (the heading through the line before the next)."""
    machines: list[str] = field(default_factory=list)
    commits: list[str] = field(default_factory=list)
    index: dict[str, list[str]] = field(default_factory=dict)
    blocks: dict[str, list[str]] = field(default_factory=dict)


def parse_page(text: str) -> KeptPage:
    """The parts of a page ``render`` made that ``--keep`` can carry over. An index row of a
    page from before the machine column gets the header's machine when it names only one."""
    kept = KeptPage()
    lines = text.splitlines()
    for line in lines:
        if line.startswith("Hardware: ") and ". Commit: " in line:
            hardware, commits = line.removeprefix("Hardware: ").rstrip(".").split(". Commit: ")
            kept.machines = [m for m in hardware.split("; ") if m not in ("-", "unknown")]
            kept.commits = [c for c in commits.split(", ") if c != "-"]
    only_machine = kept.machines[0].split(", CUDA")[0].split(", torch")[0] if len(kept.machines) == 1 else "unknown"
    for line in lines:
        if line.startswith("| `benchmarks."):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            name = section_of(cells[1])
            if name is not None:
                if len(cells) == 6:
                    line = line.rstrip() + f" {only_machine} |"
                kept.index.setdefault(name, []).append(line)
    heading = [i for i, line in enumerate(lines) if line.startswith("## ")] + [len(lines)]
    for start, end in zip(heading, heading[1:]):
        name = lines[start].removeprefix("## ").split(":")[0]
        if name in SECTIONS:
            block = lines[start:end]
            while block and not block[-1].strip():
                block.pop()
            kept.blocks[name] = block
    return kept


def render(found: dict[str, Summaries], kept: KeptPage | None = None) -> str:
    """The page: title, hardware, the index of summaries, then one section per benchmark; with
    ``kept``, a section absent from ``found`` is ``kept``'s where it has one."""
    kept = kept or KeptPage()
    carried = [name for name in SECTIONS if name not in found and name in kept.blocks]
    everything = [(name, stem, d) for name in SECTIONS for stem, d in found.get(name, [])]
    machines = {machine_line(get(d, "meta", "machine")) for _, _, d in everything}
    commits = {c for _, _, d in everything if (c := get(d, "meta", "commit"))}
    if carried:
        machines = (machines - {"unknown"}) | set(kept.machines)
        commits |= set(kept.commits)
    lines = ["# Performance", "",
             "Generated by `python -m benchmarks.report docs/summaries --keep` (`make bench`) from the "
             "benchmarks' JSON summaries in docs/summaries/; edits here are overwritten.", "",
             f"Hardware: {'; '.join(sorted(machines)) or '-'}. Commit: {', '.join(sorted(commits)) or '-'}.", ""]
    index = table(["benchmark", "summary", "measures", "make target", "command", "date", "machine"], [])
    for name in SECTIONS:
        if name in found:
            index += table_rows([[f"`benchmarks.{name}`", stem, SECTIONS[name][0], f"`{SECTIONS[name][1]}`",
                                 f"`{fmt(get(d, 'meta', 'command'))}`", fmt(get(d, "meta", "date")),
                                 machine_short(get(d, "meta", "machine"))] for stem, d in found[name]])
        elif name in carried:
            index += kept.index.get(name, [])
    lines += index
    for name, (what, _, section) in SECTIONS.items():
        if name in found:
            lines += ["", f"## {name}: {what}", ""] + section(found[name])
        elif name in carried:
            lines += [""] + kept.blocks[name]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("directory", help="the folder of the summaries (make bench: docs/summaries)")
    ap.add_argument("--out", default=str(DEFAULT_PAGE), help="the page to write; '-': standard output")
    ap.add_argument("--keep", action="store_true",
                    help="keep the sections DIR has no summary for as the page (--out, else docs/performance.md) "
                         "has them")
    args = ap.parse_args(argv)
    found = load(args.directory)
    if not found:
        print(f"no benchmark summary in {args.directory} (known: {', '.join(SECTIONS)})", file=sys.stderr)
        return 1
    kept = None
    if args.keep:
        current = Path(DEFAULT_PAGE if args.out == "-" else args.out)
        kept = parse_page(current.read_text()) if current.exists() else None
    page = render(found, kept)
    if args.out == "-":
        sys.stdout.write(page)
    else:
        Path(args.out).write_text(page)
        print(f"wrote {args.out} from {sum(map(len, found.values()))} summaries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
