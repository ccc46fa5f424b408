"""Structured outputs: offline-256 with every request under a JSON schema, against the same
requests unconstrained, side by side in one process (alternating rounds).

    PYTHONPATH=. python3 -m benchmarks.structured_outputs [--rounds 2] [--smoke]

Qwen3-0.6B shapes, random bf16 weights, beside a synthetic byte-level tokenizer of the
model's 151,936 ids (``minivllm.testing.write_byte_level_tokenizer``); both runs
detokenize. The schema is an object with one free string field: a random model keeps
writing it until max_tokens, so both runs generate the same tokens, and the grammar allows
nearly every token at every step (the mask is filled and applied everywhere, the common
case of JSON with text in it). Unconstrained requests ignore eos; constrained ones cannot
(the grammar ends with eos). Printed: tok/s of each, their ratio (goal >= 0.9), and the
host time the engine spent filling masks per masked step (``EngineStats.grammar_mask_s``).

Summary: ``$OUT/structured_outputs.json``. ``--smoke``: the tiny trained model in
fixtures/ on the CPU (numbers meaningless).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
from pathlib import Path
from typing import Any

from benchmarks.report import write_summary
from benchmarks.throughput import offline_workload, timed_generate
from minivllm.testing import SHAPES, write_byte_level_tokenizer, write_random_checkpoint

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
GOAL_RATIO = 0.9
TINY = Path(__file__).resolve().parent.parent / "fixtures" / "tiny-qwen3"


def checkpoint(args: argparse.Namespace) -> str:
    if args.smoke:
        return str(TINY)
    path = write_random_checkpoint(args.model_dir, "qwen3-0.6b")
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        numbers = SHAPES["qwen3-0.6b"][1]
        write_byte_level_tokenizer(path, numbers["vocab_size"], numbers["eos_token_id"])
    return path


def run(llm: Any, prompts: list[list[int]], max_tokens: list[int], constrained: bool, label: str) -> dict[str, Any]:
    from minivllm import SamplingParams

    if constrained:
        params = [SamplingParams(temperature=1.0, max_tokens=m, structured_outputs={"json": SCHEMA})
                  for m in max_tokens]
    else:
        params = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs, wall, before, s = timed_generate(llm, prompts, params)
    ntok = sum(len(o.token_ids) for o in outs)
    masked = s.num_masked_steps - before.num_masked_steps
    mask_ms = 1e3 * (s.grammar_mask_s - before.grammar_mask_s) / masked if masked else 0.0
    r = dict(completion_tokens=ntok, wall_s=wall, tok_s=ntok / wall, steps=s.num_steps - before.num_steps,
             masked_steps=masked, mask_ms_per_step=mask_ms,
             ended_by_eos=sum(o.finish_reason == "stop" for o in outs))
    print(f"{label}: {ntok} completion tokens in {wall:.2f}s = {ntok / wall:,.0f} tok/s (steps {r['steps']}"
          + (f", masks {mask_ms:.3f} ms/step on the host over {masked} steps, {r['ended_by_eos']} ended "
             "by the grammar" if constrained else "") + ")", flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="alternating pairs (unconstrained, JSON)")
    ap.add_argument("--model-dir", default="/tmp/qwen3-0.6b-random-with-tokenizer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    from minivllm import LLM

    path = checkpoint(args)
    opts: dict[str, Any] = dict(device="cpu", max_model_len=64) if args.smoke else dict(max_model_len=2048)
    n = 8 if args.smoke else args.num_requests
    wl = offline_workload(n, args.seed, smoke=args.smoke)
    with LLM(path, seed=args.seed, max_num_seqs=256, **opts) as llm:
        limit = min(wl.id_limit, llm.model_config.vocab_size)
        warm = dataclasses.replace(wl, id_limit=limit).prompts(stream=999, n=16)
        for constrained in (False, True):  # graphs, compiled kernels, the grammar
            run(llm, warm, [16] * len(warm), constrained, f"warm-up ({'JSON' if constrained else 'unconstrained'})")
        rounds: dict[str, list[dict[str, Any]]] = {"unconstrained": [], "json_schema": []}
        for r in range(args.rounds):
            prompts = dataclasses.replace(wl, id_limit=limit).prompts(stream=r + 1)
            for constrained in (False, True):
                name = "json_schema" if constrained else "unconstrained"
                rounds[name].append(run(llm, prompts, wl.max_tokens, constrained, f"offline-{n} [{name}, round {r}]"))
    tok_s = {k: statistics.median(x["tok_s"] for x in v) for k, v in rounds.items()}
    ratio = tok_s["json_schema"] / tok_s["unconstrained"]
    mask_ms = statistics.median(x["mask_ms_per_step"] for x in rounds["json_schema"])
    print(f"offline-{n} under a JSON schema: {tok_s['json_schema']:,.0f} tok/s against {tok_s['unconstrained']:,.0f} "
          f"unconstrained = {ratio:.3f} (goal >= {GOAL_RATIO}) {'MET' if ratio >= GOAL_RATIO else 'not met'}; "
          f"masks {mask_ms:.3f} ms/step on the host", flush=True)
    write_summary("structured_outputs", dict(workload=f"offline-{n}", schema=SCHEMA, smoke=args.smoke,
                                             rounds=rounds, tok_s=tok_s, ratio=ratio, mask_ms_per_step=mask_ms))


if __name__ == "__main__":
    main()
