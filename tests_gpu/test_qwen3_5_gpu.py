"""Qwen3.5 hybrid models (dense and MoE) on the GPU through ``LLM`` with the Triton kernels,
decode steps in CUDA graphs: on tiny configs (Qwen3-Next's too), float32 greedy tokens equal transformers' in both
scheduling modes, and a second call whose prompts share a prefix resumes from state snapshots
with the same tokens; at Qwen3.5-9B's and -35B-A3B's layer shapes (4 layers), float32 greedy
tokens equal transformers' over 16 prompts on shared prefixes, and bf16 keeps to float32's top
5 as often as transformers' bf16 does; the chunked delta rule's kernel on tensor cores agrees
with the recurrent one at Qwen3.5-9B's shapes."""

from __future__ import annotations

import copy
import gc

import numpy as np
import pytest
import torch
import transformers

from minivllm import LLM, SamplingParams
from minivllm.testing import (SHAPES, hf_generate, leading_identical, randomize_weights, release_memory,
                              top5_at_first_difference)
from tests.model.test_qwen3_5 import MODELS, make_hf
from tests.model.test_qwen3_next import MODELS as NEXT_MODELS, make_next
from tests_gpu.test_model_gpu import hf_greedy, shared_prefix_prompts

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")]
NEW = 8


@pytest.mark.parametrize("name", ["dense-lin-first", "moe-shared-full-first", *NEXT_MODELS])
def test_hybrid_model_on_the_gpu_gives_transformers_tokens(name: str, tmp_path) -> None:
    """Qwen3.5's tiny configs, and Qwen3-Next's (its fused projections read at load)."""
    hf = make_next(name, seed=3) if name in NEXT_MODELS else make_hf(*MODELS[name], seed=3)
    hf.save_pretrained(tmp_path)
    rng = np.random.default_rng(0)
    vocab = hf.config.vocab_size
    prefix = rng.integers(0, vocab, 40).tolist()
    plain = [rng.integers(0, vocab, n).tolist() for n in (70, 9, 33)]
    shared = [prefix + rng.integers(0, vocab, n).tolist() for n in (3, 11)]
    want = {i: hf_generate(hf, p, NEW) for i, p in enumerate(plain + shared)}
    # a second turn after the first shared prompt: its 48-token boundary was saved by a decode step
    turn = shared[0] + want[3] + rng.integers(0, vocab, 5).tolist()
    want_turn = hf_generate(hf, turn, NEW)
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    with LLM(str(tmp_path), device="cuda", dtype="float32", skip_tokenizer_init=True, block_size=16,
             num_blocks=64, max_model_len=128, state_snapshot_interval=1) as llm:
        for mode in (False, True):
            llm.engine.set_async_scheduling(mode)
            got = [list(o.token_ids) for o in llm.generate(plain, greedy, use_tqdm=False)]
            assert got == [want[i] for i in range(3)], mode
        cold = llm.generate(shared[:1], greedy, use_tqdm=False)
        warm = llm.generate(shared[1:], greedy, use_tqdm=False)
        second = llm.generate([turn], greedy, use_tqdm=False)
        assert llm.engine.executor.graph_runner.num_replays > 0
        assert llm.engine.executor.prefill_graph_runner.num_replays > 0  # prefill steps, their saves in graphs
    assert list(cold[0].token_ids) == want[3] and list(warm[0].token_ids) == want[4]
    assert warm[0].num_cached_tokens == 32  # the deepest snapshot short of the shared 40 tokens
    assert list(second[0].token_ids) == want_turn and second[0].num_cached_tokens == 48
    del hf
    gc.collect()
    torch.cuda.empty_cache()


# ---- at the published models' layer shapes --------------------------------------------------

LAYERS = 4  # three Gated DeltaNet layers, then one gated attention layer
SHAPED_NEW = 32


@pytest.fixture(scope="module", params=["qwen3.5-9b", "qwen3.5-35b-a3b"])
def shaped(request, tmp_path_factory):
    """(name, HF float32 model on the GPU at the shapes' first 4 layers, path, prompts with
    shared prefixes, HF's float32 greedy tokens)."""
    architecture, numbers = SHAPES[request.param]
    numbers = copy.deepcopy(dict(numbers, num_hidden_layers=LAYERS, bos_token_id=None, eos_token_id=None))
    numbers.pop("full_attention_interval")
    numbers["layer_types"] = ["linear_attention"] * (LAYERS - 1) + ["full_attention"]
    cfg = getattr(transformers, architecture).config_class(**numbers)
    cfg.architectures = [architecture]
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = getattr(transformers, architecture)(cfg).float().eval()
    randomize_weights(hf, 0.5)
    path = str(tmp_path_factory.mktemp(request.param))
    hf.save_pretrained(path)
    prompts = shared_prefix_prompts(cfg.vocab_size)
    expected = [hf_greedy(hf, p, SHAPED_NEW) for p in prompts]
    yield request.param, hf, path, prompts, expected
    del hf
    release_memory()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_shapes_greedy_fp32_matches_hf_with_graphs(shaped, async_scheduling: bool) -> None:
    """16 prompts on two shared 200-token prefixes, decode steps in CUDA graphs, snapshots every
    4 blocks so later prompts resume from the prefix's state."""
    name, _, path, prompts, expected = shaped
    llm = None
    try:
        llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_num_seqs=16, max_model_len=512,
                  num_blocks=1024, max_num_batched_tokens=256, async_scheduling=async_scheduling,
                  state_snapshot_interval=4)
        got = [list(o.token_ids) for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=SHAPED_NEW, ignore_eos=True), use_tqdm=False)]
        print(f"{name} {'async' if async_scheduling else 'sync'}: cached tokens {llm.engine.stats.num_cached_tokens}, "
              f"graph replays {llm.engine.executor.graph_runner.num_replays}")
        assert got == expected
        assert llm.engine.executor.graph_runner.num_replays > 0 and llm.engine.stats.num_cached_tokens > 0
        assert llm.engine.executor.prefill_graph_runner.num_replays > 0
    finally:
        del llm
        release_memory()


def test_shapes_bf16_top5_at_first_difference_as_often_as_hf(shaped) -> None:
    """bf16 through ``LLM`` (graphs on): at each prompt's first token that differs from
    float32 transformers', ours is in float32's top 5 at least 90% as often as transformers' own
    bf16 greedy is (the rule of ``tests_gpu/test_bf16_accuracy.py``). Not on every prompt: at
    35B-A3B's shapes random routers over 256 experts pick other experts once rounded, and
    transformers' bf16 leaves float32's top 5 too (both printed)."""
    name, hf, path, prompts, expected = shaped
    llm = None
    try:
        llm = LLM(path, dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=16, max_model_len=512,
                  num_blocks=1024, max_num_batched_tokens=256)
        got = [list(o.token_ids) for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=SHAPED_NEW, ignore_eos=True), use_tqdm=False)]
    finally:
        del llm
        release_memory()
    ours = top5_at_first_difference(hf, prompts, expected, got)
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    theirs16 = [hf_greedy(hf16, p, SHAPED_NEW) for p in prompts]
    del hf16
    release_memory()
    theirs = top5_at_first_difference(hf, prompts, expected, theirs16)
    print(f"{name}: leading tokens identical to float32, ours {[leading_identical(e, g) for e, g in zip(expected, got)]}"
          f" (top-5 {sum(ours)}), transformers bf16 {[leading_identical(e, r) for e, r in zip(expected, theirs16)]}"
          f" (top-5 {sum(theirs)})")
    assert sum(ours) >= 0.9 * sum(theirs), (ours, theirs)


# ---- the chunked delta rule against the recurrent one at Qwen3.5-9B's DeltaNet shapes ---------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-tf32x3", "bf16-tf32"])
@pytest.mark.parametrize("lens", [[2048], [128] * 16, [100, 37, 300, 1]], ids=["1x2048", "16x128", "varlen"])
def test_chunked_kernel_agrees_with_the_recurrent_one(lens: list[int], dtype: torch.dtype) -> None:
    """On tensor cores (TF32 products for bf16, float32-accurate ones for float32) the chunked
    kernel's output and states stay within the inputs' rounding of the token-by-token
    kernel's, with save points inside the sequences."""
    from minivllm.kernels.gated_delta_rule_chunked import gated_delta_rule_chunked
    from minivllm.kernels.gated_delta_rule_recurrent import gated_delta_rule_recurrent
    from tests.kernels.problems import make_delta_rule_problem

    t, nseq = sum(lens), len(lens)
    q, k, v, g, beta, state = (x.cuda() for x in make_delta_rule_problem(t, 16, 32, 128, 128, dtype, 0, 2 * nseq + 4, max_decay=0.5))
    state.mul_(0.1)
    cu = torch.tensor([0, *np.cumsum(lens)], device="cuda")
    slots = torch.arange(nseq, device="cuda")
    init = torch.tensor([i % 2 == 0 for i in range(nseq)], device="cuda")
    rows = torch.tensor([0, nseq - 1], device="cuda")
    offsets = torch.tensor([min(lens[0], 70), lens[-1]], device="cuda")
    entries = torch.tensor([2 * nseq + 2, 2 * nseq + 3], device="cuda")
    outs = {}
    for name, fn in (("recurrent", gated_delta_rule_recurrent), ("chunked", gated_delta_rule_chunked)):
        s = state.clone()
        outs[name] = fn(q, k, v, g, beta, s, cu, slots, init, rows, offsets, entries).float(), s
    (want, want_state), (got, got_state) = outs["recurrent"], outs["chunked"]
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    print(f"{lens[:2]} {dtype}: |diff| out {(got - want).abs().max().item():.1e}, "
          f"state {(got_state - want_state).abs().max().item():.1e}")
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_state, want_state, **tol)
