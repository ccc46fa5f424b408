"""bf16 against float32 on the same weights, minivllm beside HF transformers (greedy tokens
kept identical, teacher-forced flips; ``tests_gpu/test_bf16_accuracy.py`` asserts on them).

    PYTHONPATH=. python3 -m benchmarks.accuracy [--prompts 16] [--prompt-len 32] [--steps 64]
        [--std 0.1] [--smoke]

Model: Qwen3-0.6B shapes, random weights N(0, std) with norm weights 1 + 0.2 N(0, 1),
rounded to bf16 and saved in float32, so both dtypes of both engines run the same weights.
Prompts: random ids, all of one length (HF then batches them without padding).

- teacher-forced: each side's bf16 logits against its own float32 logits on one context
  (our float32 greedy continuation), over every (prompt, step): how often the argmax
  differs ("flip"), how often it falls outside float32's top-5, the logits' relative
  error. Ours through the executor the engine builds (CUDA graphs where it has them),
  HF one prompt at a time.
- greedy: ``LLM.generate`` against HF's argmax loop (:func:`hf_greedy`; both take an
  end-of-sequence token like any other), per prompt the tokens identical to float32 before
  the first difference, and whether that first bf16 token is in float32's
  top-5 (HF's float32 model on the shared context; a prompt without a difference counts).

With ``$OUT`` set, ``$OUT/accuracy.json``. ``--smoke``: a tiny model on the CPU.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import numpy as np
import torch

from benchmarks.report import write_summary
from minivllm.testing import (SMOKE_SHAPES, engine_greedy, hf_greedy, leading_identical, make_bf16_checkpoint,
                              make_llm, random_prompts, release_memory, teacher_forced_flips,
                              top5_at_first_difference)


def greedy_agreement(path: str, hf32, prompts: list[list[int]], steps: int,
                     device: str = "cuda") -> dict[str, dict[str, Any]]:
    """Per side, bf16 greedy tokens against float32 ones: leading tokens identical per
    prompt (and their mean), and first differences inside float32's top-5."""
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    runs = {"hf": (hf_greedy(hf32, prompts, steps), hf_greedy(hf16, prompts, steps))}
    del hf16
    release_memory()
    ours = []
    for dtype in ("float32", "bfloat16"):
        llm = make_llm(path, dtype, prompts, steps, device)
        ours.append(engine_greedy(llm, prompts, steps))
        del llm
        release_memory()
    runs["ours"] = (ours[0], ours[1])
    result = {}
    for side, (ref, got) in runs.items():
        leading = [leading_identical(r, g) for r, g in zip(ref, got)]
        result[side] = {"leading": leading, "mean_leading": float(np.mean(leading)), "prompts": len(prompts),
                        "top5_hits": sum(top5_at_first_difference(hf32, prompts, ref, got))}
    return result


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64, help="generated tokens per prompt")
    ap.add_argument("--std", type=float, default=0.1)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (numbers mean nothing)")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.accuracy needs a CUDA device (or --smoke)")
    if args.smoke:
        args.prompts, args.prompt_len, args.steps = min(args.prompts, 2), min(args.prompt_len, 8), min(args.steps, 4)
    overrides = SMOKE_SHAPES if args.smoke else {}
    with tempfile.TemporaryDirectory(prefix="minivllm-accuracy-") as path:
        hf32 = make_bf16_checkpoint(path, args.std, device=device, **overrides)
        prompts = random_prompts(args.prompts, args.prompt_len, hf32.config.vocab_size)
        result = {"args": vars(args),
                  "teacher_forced": teacher_forced_flips(path, hf32, prompts, args.steps, device),
                  "greedy": greedy_agreement(path, hf32, prompts, args.steps, device)}
    for side, name in (("ours", "minivllm"), ("hf", "HF")):
        tf, g = result["teacher_forced"][side], result["greedy"][side]
        print(f"{name:>8}: teacher-forced flips {tf['flip']:.3f}, outside fp32 top-5 {tf['outside_top5']:.3f}, "
              f"logits rel. error {tf['logits_rel']:.2e}; greedy: mean {g['mean_leading']:.2f} tokens identical, "
              f"first difference in fp32 top-5 {g['top5_hits']}/{g['prompts']}")
    write_summary("accuracy", result)


if __name__ == "__main__":
    main()
