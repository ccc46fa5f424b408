"""The FP8 KV cache (``kv_cache_dtype="fp8"``): the store kernel quantizes, the attention
kernels read e4m3 through the layer's scales (TRITON_INTERPRET=1 here, against the torch
references), and the engine keeps its answers against a 16-bit cache on the same weights
(the top-5 rule and a KL bound), with prefix caching, preemption, checkpoint scales, the
pool's size and the CLI flag."""

from __future__ import annotations

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import (conftest sets it too)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.kernels._launch import tma_allowed  # noqa: E402
from minivllm.kernels.decode_attention import DecodeConfig, decode_attention  # noqa: E402
from minivllm.kernels.prefill_attention import PrefillConfig, prefill_attention  # noqa: E402
from minivllm.kernels.prefill_attention import default_config as default_prefill_config  # noqa: E402
from minivllm.kernels.qk_norm_rope_store import qk_norm_rope_store  # noqa: E402
from minivllm.kernels.reference import (  # noqa: E402
    paged_attention_reference, qk_norm_rope_store_reference, quantize_kv_reference,
)
from minivllm.testing import (  # noqa: E402
    TinyConfig, agreement, make_hf_model, make_model_executor, random_tokens, save_hf_model,
)
from tests.kernels.problems import make_qk_norm_problem  # noqa: E402
from tests.kernels.test_attention import make_paged_kv  # noqa: E402

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = torch.tensor([0.37]), torch.tensor([0.011])  # not powers of two: few exact ties


def quantized(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return quantize_kv_reference(cache, scale)  # NaN (unowned slots) stays NaN


def assert_one_fp8_step(got: torch.Tensor, want: torch.Tensor, exact_share: float, atol: float = 0.0) -> None:
    """FP8 caches equal but where the stored value (x / scale) went in a little apart (by up
    to ``atol``), so that its rounding moved to a neighbouring e4m3 value; at least
    ``exact_share`` of the values equal."""
    g, w = got.float(), want.float()
    same = (g == w) | (g.isnan() & w.isnan())
    assert same.float().mean() >= exact_share
    # Neighbours in e4m3 are at most 1/8 of the larger magnitude apart (3 mantissa bits).
    diff = (g - w)[~same].abs()
    assert (diff <= torch.maximum(g.abs(), w.abs())[~same] / 8 + 2 ** -9 + atol).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "rope-only"])
def test_store_quantizes_k_and_v_with_their_scales(dtype, norm) -> None:
    gen = torch.Generator().manual_seed(3)
    args, ref_args = make_qk_norm_problem(37, 4, 2, 16, dtype, gen, norm=norm)
    for a in (args, ref_args):
        a[6], a[7] = a[6].to(FP8), a[7].to(FP8)
    args += [K_SCALE, V_SCALE]
    ref_args += [K_SCALE, V_SCALE]
    q = qk_norm_rope_store(*args)
    q_ref = qk_norm_rope_store_reference(*ref_args)
    torch.testing.assert_close(q.float(), q_ref.float(), atol=6e-2, rtol=2e-2)
    # v is copied as is, so each value is the reference's exactly (fp32: no rounding before
    # the division); k went through the norm and RoPE (fp32: last-bit differences; bf16:
    # the interpreter rounds toward zero where the reference rounds to nearest).
    # bf16 k: RoPE's cancellations leave the interpreter's rounding (toward zero) up to
    # 6e-2 from the reference's (the q tolerance), that is 6e-2 / k_scale stored.
    assert_one_fp8_step(args[7], ref_args[7], 1.0)
    if dtype == torch.float32:
        assert_one_fp8_step(args[6], ref_args[6], 0.99)
    else:
        assert_one_fp8_step(args[6], ref_args[6], 0.95, atol=6e-2 / float(K_SCALE))
    # V / 0.011 exceeds 448 for |V| > 4.9: those saturate instead of becoming NaN.
    slots = args[8][args[8] >= 0]
    stored = args[7].view(-1, 2, 16)[slots].float()
    assert stored.abs().max() == 448.0 and not stored.isnan().any()


def test_quantize_reference_saturates_and_rounds_to_nearest_even() -> None:
    x = torch.tensor([1000.0, -1000.0, 29.0, 27.0, 0.0, 1e-12])
    assert quantize_kv_reference(x, torch.tensor([1.0])).float().tolist() == [448.0, -448.0, 28.0, 28.0, 0.0, 0.0]


def fp8_paged(lens: list[int], bs: int, hkv: int, d: int, gen: torch.Generator):
    k, v, tables = make_paged_kv(lens, bs, hkv, d, torch.float32, gen)
    return quantized(k * 0.37, K_SCALE), quantized(v * 0.011 * 40, V_SCALE), tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_reads_fp8_through_the_scales(dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    lens = [0, 1, 7, 70, 16]
    k8, v8, tables = fp8_paged(lens, 4, 2, 32, gen)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), 4, 32, generator=gen).to(dtype)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    ref = paged_attention_reference(q.float(), k8, v8, cu, kv_lens, tables, 32 ** -0.5, K_SCALE, V_SCALE)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    for num_splits, config in ((None, None), (3, DecodeConfig(block_n=16))):
        out = decode_attention(q, k8, v8, kv_lens, tables, 32 ** -0.5, num_splits=num_splits, config=config,
                               k_scale=K_SCALE, v_scale=V_SCALE)
        assert out.dtype == dtype and torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    # The scales are read: another V scale gives another output.
    other = decode_attention(q, k8, v8, kv_lens, tables, 32 ** -0.5, k_scale=K_SCALE, v_scale=V_SCALE * 2)
    torch.testing.assert_close(other.float(), 2 * ref, atol=2 * tol, rtol=tol)
    if dtype == torch.bfloat16:  # the dots in fp16: the same values (q exact in fp16), P finer
        fp16 = decode_attention(q, k8, v8, kv_lens, tables, 32 ** -0.5, num_splits=3,
                                config=DecodeConfig(block_n=16, fp16_dots=True), k_scale=K_SCALE, v_scale=V_SCALE)
        assert fp16.dtype == dtype
        torch.testing.assert_close(fp16.float(), ref, atol=tol, rtol=tol)


def test_decode_attention_reads_fp8_by_box_as_by_pointer() -> None:
    """e4m3 tiles as tensor-memory boxes (blocks of 32 hold whole tiles of 16): the
    pointer path's answer, with bf16 and fp16 dots."""
    gen = torch.Generator().manual_seed(6)
    lens = [1, 32, 70, 129]
    k8, v8, tables = fp8_paged(lens, 32, 2, 32, gen)
    assert tma_allowed(k8, 16)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), 4, 32, generator=gen).bfloat16()
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    ref = paged_attention_reference(q.float(), k8, v8, cu, kv_lens, tables, 32 ** -0.5, K_SCALE, V_SCALE)
    for fp16_dots in (False, True):
        outs = [decode_attention(q, k8, v8, kv_lens, tables, 32 ** -0.5, num_splits=3,
                                 config=DecodeConfig(block_n=16, fp16_dots=fp16_dots, tma=tma),
                                 k_scale=K_SCALE, v_scale=V_SCALE) for tma in (True, False)]
        torch.testing.assert_close(outs[0].float(), ref, atol=1.6e-2, rtol=1.6e-2)
        assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_reads_fp8_by_pointer_and_by_box(dtype) -> None:
    gen = torch.Generator().manual_seed(9)
    seqs = [(70, 70), (5, 40), (1, 9), (0, 6), (40, 107)]
    k8, v8, tables = fp8_paged([kl for _, kl in seqs], 32, 2, 16, gen)
    config = PrefillConfig(32, 16, 4, 2)
    assert tma_allowed(k8, config.block_n)
    cu = torch.tensor([0] + [ql for ql, _ in seqs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    kv_lens = torch.tensor([kl for _, kl in seqs], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 4, 16, generator=gen).to(dtype)
    args = (q, k8, v8, cu, kv_lens, tables, 0.25, 70)
    ref = paged_attention_reference(q.float(), *args[1:7], K_SCALE, V_SCALE)
    with_tma = prefill_attention(*args, config=config, k_scale=K_SCALE, v_scale=V_SCALE)
    without = prefill_attention(*args, config=dataclasses.replace(config, tma=False, tma_io=False),
                                k_scale=K_SCALE, v_scale=V_SCALE)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(with_tma.float(), ref, atol=tol, rtol=tol)
    assert torch.equal(with_tma, without)
    if dtype == torch.bfloat16:  # the dots in fp16, by box and by pointer: q exact, P finer
        fp16 = dataclasses.replace(config, fp16_dots=True)
        wide = prefill_attention(*args, config=fp16, k_scale=K_SCALE, v_scale=V_SCALE)
        assert wide.dtype == dtype and not torch.equal(wide, with_tma)  # another rounding of P
        torch.testing.assert_close(wide.float(), ref, atol=tol, rtol=tol)
        assert torch.equal(wide, prefill_attention(*args, config=dataclasses.replace(fp16, tma=False, tma_io=False),
                                                   k_scale=K_SCALE, v_scale=V_SCALE))
        assert default_prefill_config(dtype, 16, 70, fp8_cache=True).fp16_dots
        assert not default_prefill_config(torch.float32, 16, 70, fp8_cache=True).fp16_dots
        assert not default_prefill_config(dtype, 16, 70).fp16_dots


def test_fp8_attention_refuses_missing_or_bad_scales() -> None:
    gen = torch.Generator().manual_seed(1)
    k8, v8, tables = fp8_paged([5], 4, 2, 16, gen)
    q = torch.randn(1, 4, 16)
    kv_lens = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        decode_attention(q, k8, v8, kv_lens, tables, 0.25)
    with pytest.raises(ValueError, match="v_scale must hold one element"):
        decode_attention(q, k8, v8, kv_lens, tables, 0.25, k_scale=K_SCALE, v_scale=torch.ones(2))
    with pytest.raises(TypeError, match="k_scale"):
        decode_attention(q, k8, v8, kv_lens, tables, 0.25, k_scale=K_SCALE.double(), v_scale=V_SCALE)
    with pytest.raises(TypeError, match="v_cache"):
        decode_attention(q, k8, v8.float(), kv_lens, tables, 0.25, k_scale=K_SCALE, v_scale=V_SCALE)
    with pytest.raises(ValueError, match="fp16_dots"):  # a 16-bit cache has nothing to widen
        decode_attention(q.bfloat16(), k8.float().bfloat16(), v8.float().bfloat16(), kv_lens, tables, 0.25,
                         config=DecodeConfig(fp16_dots=True))
    with pytest.raises(ValueError, match="fp16_dots"):  # float32 q would lose range and bits
        decode_attention(q, k8, v8, kv_lens, tables, 0.25, config=DecodeConfig(fp16_dots=True),
                         k_scale=K_SCALE, v_scale=V_SCALE)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        prefill_attention(q, k8, v8, cu, kv_lens, tables, 0.25, 1)
    with pytest.raises(ValueError, match="fp16_dots"):
        prefill_attention(q.bfloat16(), k8.float().bfloat16(), v8.float().bfloat16(), cu, kv_lens, tables, 0.25, 1,
                          config=PrefillConfig(fp16_dots=True))
    with pytest.raises(ValueError, match="fp16_dots"):
        prefill_attention(q, k8, v8, cu, kv_lens, tables, 0.25, 1, config=PrefillConfig(fp16_dots=True),
                          k_scale=K_SCALE, v_scale=V_SCALE)


# ---- the engine -------------------------------------------------------------------------

BS = 4
TINY = TinyConfig(hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128)
EXECUTOR = dict(device="cpu", block_size=BS, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return save_hf_model(make_hf_model(TINY, seed=0, std=0.1), tmp_path_factory.mktemp("kv-fp8"))


def test_fp8_cache_agrees_with_the_16_bit_cache(tiny_path) -> None:
    """bf16 weights and activations, torch references: 16 prompts x 32 greedy tokens. Measured
    (this model): 4 of 16 identical, the other 12 pass the top-5 rule, mean KL 6.2e-4 (the
    largest prompt's 1.2e-3); the bounds leave a factor of 8."""
    rng = np.random.default_rng(0)
    prompts = [random_tokens(rng, 20, TINY.vocab_size) for _ in range(16)]
    ref = make_model_executor(tiny_path, dtype="bfloat16", kernels="torch", **EXECUTOR)
    fp8 = make_model_executor(tiny_path, dtype="bfloat16", kernels="torch", kv_cache_dtype="fp8", **EXECUTOR)
    assert ref.kv_cache.dtype == torch.bfloat16 and fp8.kv_cache.dtype == FP8
    a = agreement(ref, fp8, prompts, 32, tuple(range(16)), BS)
    print(f"\n[kv fp8] {a}")
    assert a.top5_failures == 0
    assert a.mean_kl <= 5e-3 and a.max_kl <= 1e-2
    assert a.identical < a.prompts  # the cache is really 8-bit: some prompt diverges


def test_fp8_cache_on_triton_kernels_matches_the_references(tiny_path) -> None:
    """The fused store and both attention kernels (interpreted) against the torch references,
    each with an FP8 cache, float32 model: the same quantization, so the logits agree to the
    few values whose rounding lands one e4m3 step apart."""
    rng = np.random.default_rng(1)
    prompts = [random_tokens(rng, 9, TINY.vocab_size) for _ in range(2)]
    torch_ex = make_model_executor(tiny_path, dtype="float32", kernels="torch", kv_cache_dtype="fp8", **EXECUTOR)
    triton_ex = make_model_executor(tiny_path, dtype="float32", kernels="triton", kv_cache_dtype="fp8", **EXECUTOR)
    for ex in (torch_ex, triton_ex):  # scales as a checkpoint may give them: each one read
        for layer in ex.model.model.layers:
            layer.self_attn.k_scale.fill_(0.5)
            layer.self_attn.v_scale.fill_(0.125)
    a = agreement(torch_ex, triton_ex, prompts, 6, tuple(range(8)), BS)
    assert a.identical == a.prompts and a.mean_kl <= 1e-6, a


def test_pool_holds_twice_the_tokens_in_the_same_bytes(tiny_path) -> None:
    kw = dict(EXECUTOR, num_blocks=None, max_num_seqs=4)
    bf16 = make_model_executor(tiny_path, dtype="bfloat16", kernels="torch", **kw)
    fp8 = make_model_executor(tiny_path, dtype="bfloat16", kernels="torch", kv_cache_dtype="fp8", **kw)
    assert fp8.block_bytes * 2 == bf16.block_bytes
    assert fp8.kv_cache.element_size() == 1 and fp8.kv_cache.shape == bf16.kv_cache.shape


def test_engine_with_fp8_cache_prefix_caching_and_preemption(tiny_path) -> None:
    """Through LLM: shared prefixes in a pool too small for every request; the prefix cache
    hits, requests are preempted and recomputed, and the answers are those of the same
    engine without a prefix cache (the cached blocks hold the bytes a recomputation writes)."""
    rng = np.random.default_rng(2)
    prefix = random_tokens(rng, 12, TINY.vocab_size)
    prompts = [prefix + random_tokens(rng, 5, TINY.vocab_size) for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    opts = dict(device="cpu", dtype="float32", kernels="torch", skip_tokenizer_init=True, block_size=BS,
                num_blocks=20, max_num_seqs=4, max_num_batched_tokens=32, kv_cache_dtype="fp8")
    outs = {}
    for caching in (True, False):
        with LLM(tiny_path, enable_prefix_caching=caching, **opts) as llm:
            outs[caching] = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
            stats = llm.engine.stats
        if caching:
            assert stats.num_cached_tokens > 0 and stats.num_preemptions > 0
    assert outs[True] == outs[False]


def test_checkpoint_scales_are_loaded_and_checked(tiny_path, tmp_path) -> None:
    """``self_attn.k_scale`` / ``v_scale`` in the checkpoint become the layer's scales (one
    number each, any float dtype); a scale that is not a positive number is refused by name."""
    import shutil

    path = shutil.copytree(tiny_path, tmp_path / "scaled")
    weights = load_file(path / "model.safetensors")
    weights["model.layers.1.self_attn.k_scale"] = torch.tensor(0.5, dtype=torch.bfloat16)
    weights["model.layers.1.self_attn.v_scale"] = torch.tensor([0.25])
    save_file(weights, path / "model.safetensors")
    ex = make_model_executor(str(path), dtype="float32", kernels="torch", kv_cache_dtype="fp8", **EXECUTOR)
    layers = ex.model.model.layers
    assert float(layers[1].self_attn.k_scale) == 0.5 and float(layers[1].self_attn.v_scale) == 0.25
    assert float(layers[0].self_attn.k_scale) == 1.0  # absent: the default
    weights["model.layers.1.self_attn.v_scale"] = torch.tensor([0.0])
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.v_scale.*finite number > 0"):
        make_model_executor(str(path), dtype="float32", kernels="torch", **EXECUTOR)


def test_kv_cache_dtype_is_an_option_of_the_config_and_the_cli() -> None:
    from minivllm.__main__ import _engine_options, _parser
    from minivllm.config import CacheConfig

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="int8")
    args = _parser().parse_args(["generate", "--model", "m", "x", "--kv-cache-dtype", "fp8"])
    assert _engine_options(args)["kv_cache_dtype"] == "fp8"
    assert "kv_cache_dtype" not in _engine_options(_parser().parse_args(["generate", "--model", "m", "x"]))
    serve = _parser().parse_args(["serve", "m", "--kv-cache-dtype", "fp8_e4m3"])
    assert _engine_options(serve)["kv_cache_dtype"] == "fp8_e4m3"

