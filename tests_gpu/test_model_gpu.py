"""The real engine on the GPU against Hugging Face transformers.

Random-weight Qwen3 checkpoints (Qwen3-0.6B's exact shapes and two smaller
configs) are written with ``save_pretrained`` here; nothing is downloaded.
Weights use std 0.5 with norm weights near 1 so logits are well separated and
float32 greedy equality is meaningful (near-uniform logits would make argmax
ties; ``docs/design.md``, "Correctness against Hugging Face"). Tolerances: float32
logits relative (max |diff| / max |ref|) <= 1e-4; bf16 checked the vLLM way (at the first differing greedy token each
side's token is in the other's top-5).
"""

from __future__ import annotations

import gc
from typing import Any, Callable

import numpy as np
import pytest
import torch
import transformers

from minivllm import LLM, SamplingParams
from minivllm.engine.plan import StepPlan
from minivllm.executor.model_executor import ModelExecutor
import minivllm.testing
from minivllm.testing import QWEN3_0_6B, make_model_executor, randomize_weights

CONFIGS = {
    "qwen3-0.6b": dict(QWEN3_0_6B, bos_token_id=None, eos_token_id=None),
    "small-gqa": dict(QWEN3_0_6B, vocab_size=32000, hidden_size=512, intermediate_size=1024,
                      num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None),
    "small-mqa": dict(QWEN3_0_6B, vocab_size=5000, hidden_size=256, intermediate_size=768,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                      bos_token_id=None, eos_token_id=None),
}
NEW = 64


def make_checkpoint(name: str, path: str, std: float = 0.5) -> tuple[transformers.PreTrainedModel, str]:
    cfg = transformers.Qwen3Config(**CONFIGS[name])
    cfg.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.Qwen3ForCausalLM(cfg).float().eval()
    randomize_weights(hf, std)
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    hf, path = make_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)))
    yield request.param, hf, path
    del hf
    gc.collect()
    torch.cuda.empty_cache()


def last_logits(ex: ModelExecutor, context: list[int]) -> torch.Tensor:
    """Our logits at the last position of ``context`` (one prefill into a fresh table)."""
    bs = ex.block_size
    table = tuple(range(-(-len(context) // bs)))
    plan = StepPlan.build([0], [context], [0], [table], [True], [SamplingParams(temperature=0)], bs)
    return ex.compute_logits(plan)[0].float()


def fp32_logit_error(ex: ModelExecutor, hf: Any, name: str) -> float:
    """max |ours - HF| / max |HF| of the float32 logits at the last position of a random
    300-token context (printed with ``name``)."""
    ctx = np.random.default_rng(0).integers(0, hf.config.vocab_size, 300).tolist()
    ours = last_logits(ex, ctx)
    with torch.no_grad():
        ref = hf(torch.tensor([ctx], device="cuda")).logits[0, -1].float()
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"{name}: fp32 max|diff|/max|ref| = {rel:.2e} (max|ref| {ref.abs().max().item():.1f})")
    return rel


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """HF's plain argmax decode of one prompt (an end token taken like any other, as our
    runs with ``ignore_eos`` take it)."""
    return minivllm.testing.hf_greedy(hf, [prompt], n)[0]


def test_logits_match_hf_fp32(checkpoint) -> None:
    name, hf, path = checkpoint
    ex = make_model_executor(path, device="cuda", dtype="float32", kernels="triton",
                             block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=1024,
                             enforce_eager=True)
    assert fp32_logit_error(ex, hf, name) <= 1e-4


def test_bf16_top5_at_first_difference(checkpoint) -> None:
    name, hf, path = checkpoint
    hf16 = hf.to(torch.bfloat16)
    try:
        ex = make_model_executor(path, device="cuda", dtype="bfloat16", kernels="triton",
                                 block_size=16, num_blocks=64, max_num_seqs=4,
                                 max_num_batched_tokens=1024, enforce_eager=True)
        prompt = np.random.default_rng(1).integers(0, CONFIGS[name]["vocab_size"], 40).tolist()
        agreed = assert_top5_at_first_difference(ex, hf16, prompt, 32)
        print(f"{name}: bf16 greedy agreed for {agreed} of 32 tokens")
    finally:
        hf.float()


def assert_top5_at_first_difference(ex: ModelExecutor, hf16: Any, prompt: list[int], n: int) -> int:
    """Walk HF's bf16 greedy tokens; at the first one we would not pick, each side's token must be
    in the other's top 5. Returns how many tokens agreed."""
    agreed, holds, detail = walk_to_first_difference(lambda ctx: last_logits(ex, ctx), hf_logits(hf16),
                                                     hf_greedy(hf16, prompt, n), prompt)
    assert holds, detail
    return agreed


def hf_logits(hf: Any) -> Callable[[list[int]], torch.Tensor]:
    """HF's float logits at the last position of a context."""
    def logits(ctx: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([ctx], device="cuda")).logits[0, -1].float()
    return logits


def walk_to_first_difference(mine: Callable[[list[int]], torch.Tensor], ref: Callable[[list[int]], torch.Tensor],
                             ref_tokens: list[int], prompt: list[int]) -> tuple[int, bool, str]:
    """Walk the reference's greedy ``ref_tokens`` after ``prompt`` with ``mine``'s logits:
    (tokens agreed, whether at the first token ``mine`` would not pick each side's token is in
    the other's top 5 (True where none differs), the two top-5s)."""
    ctx = list(prompt)
    for t in ref_tokens:
        m = mine(ctx)
        ours = int(m.argmax())
        if ours != t:
            r = ref(ctx)
            top_m, top_r = m.topk(5), r.topk(5)
            holds = ours in top_r.indices.tolist() and t in top_m.indices.tolist()
            return len(ctx) - len(prompt), holds, f"mine {top_m} ref {top_r}"
        ctx.append(t)
    return len(ctx) - len(prompt), True, ""


def shared_prefix_prompts(vocab: int, n: int = 16, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab, 200).tolist() for _ in range(2)]
    return [prefixes[i % 2] + rng.integers(0, vocab, int(rng.integers(5, 50))).tolist()
            for i in range(n)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    hf, path = make_checkpoint("qwen3-0.6b", str(tmp_path_factory.mktemp("gen")))
    prompts = shared_prefix_prompts(CONFIGS["qwen3-0.6b"]["vocab_size"])
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return path, prompts, expected


# An explicit pool, so results do not depend on what else the process holds
# (the sizing from free memory runs in benchmarks/throughput.py).
POOL = dict(num_blocks=2048)
# Asynchronous scheduling is the CUDA default; the "-sync" engines run the synchronous path.
ENGINES = {
    "graphs+prefix-cache": dict(POOL),
    "graphs+prefix-cache-sync": dict(POOL, async_scheduling=False),
    # The CUDA default is blocks of 64 (the prefill kernel's TMA path); blocks of 16 too.
    "graphs+prefix-cache-block16": dict(POOL, block_size=16),
    "eager+no-prefix-cache": dict(POOL, enforce_eager=True, enable_prefix_caching=False),
    "tiny-pool-preemption": dict(num_blocks=48, block_size=16),
    "tiny-pool-preemption-sync": dict(num_blocks=48, block_size=16, async_scheduling=False),
    "tiny-pool-preemption-block64": dict(num_blocks=12),
    "chunked-prefill-budget-64": dict(POOL, max_num_batched_tokens=64),
    "prefill-first": dict(POOL, policy="prefill_first"),
    # Prefill and mixed steps run in CUDA graphs too (every engine above without
    # enforce_eager), here with 64-token chunks.
    "prefill-graphs-chunked-64": dict(POOL, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_greedy_fp32_matches_hf(reference, engine: str) -> None:
    path, prompts, expected = reference
    params = SamplingParams(temperature=0, max_tokens=NEW)
    llm = None
    try:
        llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_num_seqs=16, max_model_len=512,
                  **ENGINES[engine])
        got = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        s = llm.engine.stats
        print(f"{engine}: preemptions {s.num_preemptions}, cached tokens {s.num_cached_tokens}, "
              f"chunked {s.num_chunked_prefills}")
        assert got == expected
        assert llm.engine.async_scheduling == ENGINES[engine].get("async_scheduling", True)
        if engine.startswith("tiny-pool-preemption"):
            assert s.num_preemptions > 0
        if engine == "chunked-prefill-budget-64":
            assert s.num_chunked_prefills > 0
        prefill_runner = llm.engine.executor.prefill_graph_runner
        if "enforce_eager" in ENGINES[engine]:
            assert prefill_runner is None
        else:
            assert prefill_runner is not None and prefill_runner.num_replays > 0
        runner = llm.engine.executor.graph_runner
        if "enforce_eager" in ENGINES[engine]:
            assert runner is None
        else:
            assert runner is not None and runner.num_replays > 0
        if engine.startswith("graphs+prefix-cache"):
            # All 16 prompts are admitted in the first step, before any block is
            # computed, so hits come from the second call (or from readmissions).
            before = s.num_cached_tokens
            again = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
            assert again == expected
            # Across separate calls every prompt's 200-token prefix is reused: its first 192
            # tokens (12 blocks of 16 or 3 of 64).
            assert s.num_cached_tokens - before >= 16 * 192
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("batch", [3, 5, 8, 11, 16])
def test_cuda_graph_replay_equals_eager(reference, batch: int) -> None:
    """Captured sizes are 1, 2, 4, 8, 16: 3, 5 and 11 replay a padded larger graph."""
    path, prompts, expected = reference
    llm = None
    try:
        llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_num_seqs=16, max_model_len=512,
                  **POOL)
        got = [list(o.token_ids) for o in llm.generate(
            prompts[:batch], SamplingParams(temperature=0, max_tokens=NEW), use_tqdm=False)]
        assert llm.engine.executor.graph_runner.num_replays > 0
        assert got == expected[:batch]
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
