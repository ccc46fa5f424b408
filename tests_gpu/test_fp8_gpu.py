"""FP8 on the GPU at Qwen3-0.6B shapes: the e4m3 kernels in hardware against their torch
references, the FP8 KV cache against the bf16 cache on the same weights (the top-5 rule and a
KL bound, CUDA graphs, both scheduling modes), and FP8 weights: a Qwen3-FP8-format checkpoint
(``fixtures/fp8_checkpoint.py`` from a random bf16-valued one) against
transformers loading the same checkpoint (its fine-grained FP8) and against the bf16 model it
came from, both by the top-5 rule at the first differing greedy token (weights std 0.02),
counted over many prompts against the count of transformers' own FP8 against its bf16."""

from __future__ import annotations


import pytest
import torch

from fixtures.fp8_checkpoint import convert_checkpoint
from minivllm import LLM, SamplingParams
from minivllm.config import FP8_WEIGHT_BLOCK
from minivllm.kernels.fp8 import FP8_DTYPE, quantize_fp8_block, quantize_fp8_per_token, quantize_fp8_per_token_group
from minivllm.kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm, scaled_mm_fp8
from minivllm.kernels.fp8_gemv import fp8_gemv
from minivllm.kernels.fp8_quant import quantize_activations
from minivllm.kernels.reference import (
    fp8_gemm_reference, fp8_gemv_reference, paged_attention_reference, quantize_kv_reference,
)
from minivllm.testing import (agreement, hf_greedy, make_bf16_checkpoint, make_model_executor, random_prompts,
                              release_memory)
from tests_gpu.test_model_gpu import hf_logits, last_logits, walk_to_first_difference

BS, STEPS, RULE_PROMPTS = 16, 32, 48
# Weights of std 0.02, where bf16 follows transformers' bf16: at std 0.1 the random model is so
# sensitive that one rounding changes its greedy path within a few tokens, and FP8 there is
# reported by `benchmarks.fp8` (its accuracy part), not bounded.
STD = 0.02


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(bf16-valued checkpoint, its FP8 conversion, 16 prompts)."""
    root = tmp_path_factory.mktemp("fp8")
    hf = make_bf16_checkpoint(str(root / "bf16"), std=STD, device="cuda")
    vocab = hf.config.vocab_size
    del hf
    release_memory()
    convert_checkpoint(root / "bf16", root / "fp8")
    return str(root / "bf16"), str(root / "fp8"), random_prompts(16, 32, vocab)


def executor(path: str, **options):
    return make_model_executor(path, device="cuda", dtype="bfloat16", block_size=BS, num_blocks=8, max_num_seqs=1,
                               max_num_batched_tokens=256, max_model_len=128, **options)


# ---- kernels in hardware -----------------------------------------------------------------

def test_hardware_e4m3_cast_is_the_reference_rounding() -> None:
    """On the GPU the kernels cast with the hardware (no fp32 rounding first): the KV store's
    quantization equals torch's bit for bit, ties and saturation included."""
    from minivllm.kernels.qk_norm_rope_store import qk_norm_rope_store
    from tests.kernels.problems import make_qk_norm_problem

    gen = torch.Generator().manual_seed(0)
    args, ref = make_qk_norm_problem(37, 4, 2, 64, torch.float32, gen, norm=False)
    scale = torch.tensor([0.011], device="cuda")
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    args[6], args[7] = args[6].to(FP8_DTYPE), args[7].to(FP8_DTYPE)
    qk_norm_rope_store(*args, scale, scale)
    slots = args[8][args[8] >= 0]
    stored = args[7].view(-1, 2, 64)[slots]
    v = ref[0].view(37, -1, 64)[:, 6:8].cuda()[args[8] >= 0]
    assert torch.equal(stored.view(torch.uint8), quantize_kv_reference(v, scale).view(torch.uint8))


@pytest.mark.parametrize("mode", ["block", "channel"])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_fp8_gemm_and_gemv_match_their_references(mode, m) -> None:
    gen = torch.Generator(device="cuda").manual_seed(m)
    w = torch.randn(1024, 1024, generator=gen, device="cuda") * 0.05
    if mode == "block":
        w8, s = quantize_fp8_block(w, FP8_WEIGHT_BLOCK)
    else:
        from minivllm.kernels.fp8 import quantize_fp8_per_channel
        w8, s = quantize_fp8_per_channel(w)
    x = torch.randn(m, 1024, generator=gen, device="cuda").bfloat16()
    ref = fp8_gemm_reference(x, w8, s, mode).float()
    torch.testing.assert_close(fp8_gemm(x, w8, s, mode).float(), ref, rtol=1.6e-2, atol=1e-2)
    other_tiles = fp8_gemm(x, w8, s, mode, Fp8GemmConfig(block_m=64, block_n=128))
    torch.testing.assert_close(other_tiles.float(), ref, rtol=1.6e-2, atol=1e-2)
    q, qs = quantize_activations(x, mode)   # the one-pass quantizer: the torch rule, bit for bit
    ref_q, ref_s = quantize_fp8_per_token_group(x) if mode == "block" else quantize_fp8_per_token(x)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(qs, ref_s)
    torch.testing.assert_close(scaled_mm_fp8(x, w8, s, mode).float(), ref, rtol=1.6e-2, atol=1e-2)
    if m == 1:
        torch.testing.assert_close(fp8_gemv(x, w8, s, mode).float(), fp8_gemv_reference(x, w8, s, mode).float(),
                                   rtol=1.6e-2, atol=1e-2)


FP8_DECODE_CONFIGS = {  # name -> DecodeConfig keywords; "default": the kernel's own choice
    "default": None, "bf16-dots": dict(fp16_dots=False), "fp16-dots": dict(fp16_dots=True),
    "boxes-bf16-dots": dict(block_n=64, tma=True), "boxes-fp16-dots": dict(block_n=64, tma=True, fp16_dots=True),
}


def _fp8_decode_problem(seed: int):
    """Qwen3-0.6B's heads (16 / 8 of 128) over an e4m3 cache of 8 sequences up to 3,000 tokens
    in blocks of 64 (tables of 48 blocks, scattered)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lens, bs, width = [3000, 1, 64, 1500, 7, 2048, 999, 300], 64, 48
    tables = torch.randperm(len(lens) * width, generator=gen, device="cuda").to(torch.int32).view(len(lens), width)
    shape = (len(lens) * width, bs, 8, 128)
    one = torch.ones(1, device="cuda")
    k8, v8 = (quantize_kv_reference(torch.randn(shape, generator=gen, device="cuda"), one) for _ in range(2))
    q = torch.randn(len(lens), 16, 128, generator=gen, device="cuda").bfloat16()
    kv_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, k8, v8, kv_lens, tables, one


def _fp8_decode_reference(q, k8, v8, kv_lens, tables, one):
    cu = torch.arange(len(kv_lens) + 1, dtype=torch.int32, device="cuda")
    return paged_attention_reference(q.float(), k8, v8, cu, kv_lens, tables, 128 ** -0.5, one, one)


@pytest.mark.parametrize("name", list(FP8_DECODE_CONFIGS))
def test_fp8_decode_attention_matches_its_reference(name) -> None:
    """Every way of reading the e4m3 cache (dots in bf16 or fp16, whole tiles by pointers or
    by tensor-memory boxes, and the default) against the float32 reference."""
    from minivllm.kernels.decode_attention import DecodeConfig, decode_attention

    q, k8, v8, kv_lens, tables, one = _fp8_decode_problem(3)
    keywords = FP8_DECODE_CONFIGS[name]
    config = None if keywords is None else DecodeConfig(**keywords)
    out = decode_attention(q, k8, v8, kv_lens, tables, 128 ** -0.5, config, k_scale=one, v_scale=one)
    torch.testing.assert_close(out.float(), _fp8_decode_reference(q, k8, v8, kv_lens, tables, one),
                               atol=1.6e-2, rtol=1.6e-2)


def test_fp8_decode_attention_by_boxes_in_a_cuda_graph() -> None:
    """The default over an e4m3 cache in blocks of 64 (tensor-memory boxes: the descriptors are
    built at capture) replays right on new tables, lengths and queries."""
    from minivllm.kernels.decode_attention import decode_attention, default_config

    assert default_config(torch.bfloat16, 128, True, 64).tma
    q, k8, v8, kv_lens, tables, one = _fp8_decode_problem(4)
    decode_attention(q, k8, v8, kv_lens, tables, 128 ** -0.5, k_scale=one, v_scale=one)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k8, v8, kv_lens, tables, 128 ** -0.5, k_scale=one, v_scale=one)
    q2, _, _, kv_lens2, tables2, _ = _fp8_decode_problem(5)
    q.copy_(q2)
    kv_lens.copy_(kv_lens2.flip(0))
    tables.copy_(tables2)
    graph.replay()
    torch.testing.assert_close(out.float(), _fp8_decode_reference(q, k8, v8, kv_lens, tables, one),
                               atol=1.6e-2, rtol=1.6e-2)


# ---- the FP8 KV cache ----------------------------------------------------------------------

def test_fp8_kv_cache_agrees_with_the_bf16_cache(checkpoints) -> None:
    src, _, prompts = checkpoints
    ref, ours = executor(src), executor(src, kv_cache_dtype="fp8")
    a = agreement(ref, ours, prompts, STEPS, tuple(range(8)), BS)
    print(f"\n[fp8 kv, Qwen3-0.6B shapes] {a}")
    assert a.top5_failures == 0 and a.mean_kl <= 1e-2


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_fp8_kv_cache_under_graphs_in_both_scheduling_modes(checkpoints, async_scheduling) -> None:
    """Greedy through LLM with CUDA graphs and prefix caching: the same tokens as the same
    engine eager (graphs change nothing), and by the top-5 rule against the bf16 cache."""
    src, _, prompts = checkpoints
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    runs = {}
    for name, opts in (("graphs", {}), ("eager", {"enforce_eager": True})):
        with LLM(src, kv_cache_dtype="fp8", skip_tokenizer_init=True, async_scheduling=async_scheduling,
                 gpu_memory_utilization=0.5, max_model_len=256, **opts) as llm:
            runs[name] = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        release_memory()
    assert runs["graphs"] == runs["eager"]


# ---- FP8 weights -----------------------------------------------------------------------------

def test_fp8_checkpoint_against_transformers_and_the_bf16_model(checkpoints) -> None:
    """Greedy walks of RULE_PROMPTS prompts with the top-5 rule at the first difference
    (``test_model_gpu``'s), counted: our FP8 executor against transformers loading the FP8
    checkpoint, and against transformers' bf16 of the model it came from, fails the rule at no
    more prompts than transformers' FP8 fails it against transformers' bf16. That count is the
    noise of the 8-bit format itself: at these random weights the top five logits often lie
    within 0.1 of each other, and one FP8 rounding reorders them (docs/tuning.md, "FP8")."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    src, fp8, _ = checkpoints
    ours = executor(fp8)
    # transformers' FP8 matmul is a kernel fetched from the Hub at first use (the `kernels`
    # package), which a machine without network cannot get: it reads the checkpoint's e4m3
    # weights and block scales and dequantizes them at load (``dequantize=True``), then runs
    # in bf16 with unquantized activations (ours quantizes them per 128-group: W8A8 as vLLM).
    hf8 = AutoModelForCausalLM.from_pretrained(fp8, device_map="cuda", dtype=torch.bfloat16,
                                               quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(src, device_map="cuda", dtype=torch.bfloat16).eval()
    prompts = random_prompts(RULE_PROMPTS, 32, hf16.config.vocab_size)
    refs = {"FP8": hf8, "bf16": hf16}
    greedy = {name: hf_greedy(m, prompts, STEPS, batched=True) for name, m in refs.items()}
    failures = {}
    for name, mine, ref in (("ours vs transformers FP8", lambda ctx: last_logits(ours, ctx), "FP8"),
                            ("ours vs transformers bf16", lambda ctx: last_logits(ours, ctx), "bf16"),
                            ("transformers FP8 vs bf16", hf_logits(hf8), "bf16")):
        walks = [walk_to_first_difference(mine, hf_logits(refs[ref]), toks, p)
                 for p, toks in zip(prompts, greedy[ref])]
        failures[name] = sum(not holds for _, holds, _ in walks)
        print(f"\n[{name}] top-5 rule failed at {failures[name]}/{RULE_PROMPTS} prompts; "
              f"tokens agreed per prompt: {[agreed for agreed, _, _ in walks]}")
    del hf8, hf16, refs
    release_memory()
    noise = failures["transformers FP8 vs bf16"]
    assert failures["ours vs transformers FP8"] <= noise and failures["ours vs transformers bf16"] <= noise, failures
