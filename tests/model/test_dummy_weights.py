"""``load_format="dummy"``: random weights filled on the device from config.json alone.

A directory holding only config.json runs under "dummy" and is refused, naming the
missing weights, under "auto"; the fill is seeded, sets norms to 1 and biases to 0,
reaches every parameter at the intended scale, keeps tied embeddings tied, and gives
the ranks of a tensor-parallel model equal replicated parameters.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from minivllm import LLM, SamplingParams
from minivllm.config import ExecutorConfig, ModelConfig
from minivllm.layers.norm import RMSNorm
from minivllm.layers.weights import default_weight_loader, get_weight_loader
from minivllm.model.loader import DUMMY_STD, fill_dummy_weights
from minivllm.model.registry import build_model
from minivllm.ops.dispatch import FP8_DTYPE
from minivllm.testing import TinyConfig

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
ENGINE = dict(device="cpu", kernels="torch", skip_tokenizer_init=True, block_size=4, num_blocks=16,
              max_num_seqs=2, max_model_len=32, max_num_batched_tokens=32)
PROMPT = [[3, 14, 15, 92, 65]]
# Qwen2: q/k/v biases; its one KV head is replicated when split over 2 ranks; the odd
# vocabulary pads rank 1's shard.
TP_CFG = TinyConfig(family="qwen2", vocab_size=113, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=8, max_position_embeddings=64)


# Qwen3-MoE: sparse layers with a router (E, H) and experts stacked (E, 2I, H), (E, H, I).
MOE_CFG = transformers.Qwen3MoeConfig(
    vocab_size=97, hidden_size=32, intermediate_size=40, moe_intermediate_size=24, num_experts=4,
    num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=64, bos_token_id=None, eos_token_id=None, architectures=["Qwen3MoeForCausalLM"])


def config_only(path: Path, cfg: TinyConfig | transformers.PretrainedConfig = TinyConfig()) -> str:
    """A model directory holding nothing but config.json."""
    (cfg.hf_config() if isinstance(cfg, TinyConfig) else cfg).save_pretrained(path)
    assert os.listdir(path) == ["config.json"]
    return str(path)


def model_weights(llm: LLM) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in llm.engine.executor.model.named_parameters()}


@pytest.mark.parametrize("cfg", [TinyConfig(), MOE_CFG], ids=["qwen3", "qwen3-moe"])
def test_generates_from_config_only(tmp_path, cfg):
    with LLM(config_only(tmp_path, cfg), load_format="dummy", **ENGINE) as llm:
        out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].token_ids
    assert len(out) == GREEDY.max_tokens and all(0 <= t < TinyConfig().vocab_size for t in out)


def test_seed_decides_the_weights(tmp_path):
    path = config_only(tmp_path)
    runs = []
    for seed in (7, 7, 8):
        with LLM(path, load_format="dummy", seed=seed, **ENGINE) as llm:
            runs.append((llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].token_ids, model_weights(llm)))
    (tokens_a, w_a), (tokens_b, w_b), (_, w_c) = runs
    assert tokens_a == tokens_b
    assert all(torch.equal(w_a[n], w_b[n]) for n in w_a)
    matrices = [n for n in w_a if w_a[n].dim() >= 2]
    assert matrices and not any(torch.equal(w_a[n], w_c[n]) for n in matrices)


def test_auto_without_weights_names_them(tmp_path):
    path = config_only(tmp_path)
    for tp in (1, 2):  # TP refuses before starting any worker
        with pytest.raises(ValueError, match=r"no model weights.*safetensors.*load_format='dummy'"):
            LLM(path, tensor_parallel_size=tp, **ENGINE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [TinyConfig(family="qwen2", hidden_size=64, head_dim=16, tie_word_embeddings=True),
                                 TinyConfig(family="qwen3"), MOE_CFG], ids=["qwen2-tied", "qwen3", "qwen3-moe"])
def test_every_parameter_filled_at_its_scale(tmp_path, cfg, dtype):
    with torch.device("cpu"):
        torch.set_default_dtype(dtype)
        try:
            model = build_model(ModelConfig.from_hf_json(config_only(tmp_path, cfg)))
        finally:
            torch.set_default_dtype(torch.float32)
    params = dict(model.named_parameters())
    for p in params.values():
        p.data.fill_(math.nan)  # anything left unfilled stays NaN
    assert fill_dummy_weights(model, seed=1) == len(params)
    norms = {f"{m}.weight" for m, mod in model.named_modules() if isinstance(mod, RMSNorm)}
    biases = [n for n in params if n.endswith(".bias")]
    assert norms and (biases or getattr(cfg, "family", None) != "qwen2")
    scales = [n for n in params if n.endswith(("self_attn.k_scale", "self_attn.v_scale"))]
    assert len(scales) == 2 * cfg.num_hidden_layers
    for name, p in params.items():
        assert torch.isfinite(p).all(), name
        if name in scales:  # KV cache scales: float32 in every model, default 1
            assert p.dtype == torch.float32 and torch.equal(p, torch.ones_like(p)), name
            continue
        assert p.dtype == dtype, name
        if name in norms:
            assert torch.equal(p, torch.ones_like(p)), name
        elif name in biases:
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            assert p.dim() >= 2, name
            std, mean = p.float().std().item(), p.float().mean().item()
            # 5 standard errors of each estimate over p.numel() draws
            assert abs(std / DUMMY_STD - 1) < 5 / math.sqrt(2 * p.numel()), (name, std)
            assert abs(mean) < 5 * DUMMY_STD / math.sqrt(p.numel()), (name, mean)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("cfg", [TinyConfig(), MOE_CFG], ids=["qwen3", "qwen3-moe"])
def test_equally_shaped_weights_differ(tmp_path, cfg):
    """Each parameter draws its own values: layer 0's and layer 1's qkv (and every other pair
    of equally shaped matrices, the experts of one stack too) differ, else every layer computes
    the same function and a benchmark's caches and routing see repeated data."""
    model = build_model(ModelConfig.from_hf_json(config_only(tmp_path, cfg)))
    fill_dummy_weights(model, seed=1)
    params = {n: p for n, p in model.named_parameters() if p.dim() >= 2}
    layers = model.model.layers
    assert not torch.equal(layers[0].self_attn.qkv_proj.weight, layers[1].self_attn.qkv_proj.weight)
    matrices = [p.reshape(-1, *p.shape[-2:]) for p in params.values()]
    by_shape: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for m in (m for stack in matrices for m in stack):
        by_shape.setdefault(tuple(m.shape), []).append(m)
    assert max(len(ms) for ms in by_shape.values()) >= 2
    for shape, ms in by_shape.items():
        for i, j in itertools.combinations(range(len(ms)), 2):
            assert not torch.equal(ms[i], ms[j]), (shape, i, j)


@pytest.mark.parametrize("cfg", [TinyConfig(), MOE_CFG], ids=["qwen3", "qwen3-moe"])
def test_fp8_dummy_weights_are_e4m3_with_per_channel_scales(tmp_path, cfg):
    """``quantization="fp8"`` applies to random weights as to a checkpoint's: every linear
    layer and expert stack in e4m3 with one scale per output row (each row's largest value
    at e4m3's 448), dequantizing to the dummy scale; embedding, LM head and router stay 16-bit."""
    with LLM(config_only(tmp_path, cfg), load_format="dummy", quantization="fp8", **ENGINE) as llm:
        model = llm.engine.executor.model
        quantized = [m for m in model.modules() if hasattr(m, "quantize_fp8_per_channel")]
        assert len(quantized) == (4 if cfg is not MOE_CFG else 3) * cfg.num_hidden_layers
        pairs = []
        for m in quantized:
            if hasattr(m, "weight_scale_channel"):
                assert m.weight_scale_inv is None
                pairs.append((m.weight, m.weight_scale))
            else:
                pairs += zip((m.gate_up_proj, m.down_proj), m.scales)
        for w, scale in pairs:
            assert w.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == w.shape[:-1]
            assert torch.all(w.float().abs().amax(dim=-1) == 448)
            std = (w.float() * scale[..., None]).std().item()
            assert abs(std / DUMMY_STD - 1) < 0.1, std
        assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32


def test_a_parameter_without_a_rule_is_refused(tmp_path):
    model = build_model(ModelConfig.from_hf_json(config_only(tmp_path)))
    model.model.layers[0].scale = nn.Parameter(torch.empty(4), requires_grad=False)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.scale"):
        fill_dummy_weights(model, seed=0)


def test_bad_load_format_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="load_format"):
        ExecutorConfig(load_format="random")
    with pytest.raises(ValueError, match="load_format"):
        LLM(config_only(tmp_path), load_format="safetensors", **ENGINE)


def test_cli_option():
    from minivllm.__main__ import _engine_options, _parser

    args = _parser().parse_args(["generate", "--model", "m", "--load-format", "dummy", "hi"])
    assert _engine_options(args)["load_format"] == "dummy"
    assert "load_format" not in _engine_options(_parser().parse_args(["generate", "--model", "m", "hi"]))
    with pytest.raises(SystemExit):
        _parser().parse_args(["generate", "--model", "m", "--load-format", "pt", "hi"])


# Rank 1's parameters as a worker process builds and fills them (another interpreter,
# another hash seed); construction and the fill never communicate, so the communicator
# the model requires under tensor parallelism is a placeholder here.
RANK1_SCRIPT = textwrap.dedent("""
    import sys, torch
    from minivllm.config import ModelConfig
    from minivllm.ops.dispatch import Ops
    from minivllm.model.loader import fill_dummy_weights
    from minivllm.model.registry import build_model
    path, seed, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ops = Ops(triton=False, use_gemv=False, pdl=False, comm=object())
    model = build_model(ModelConfig.from_hf_json(path), ops=ops, tp_rank=1, tp_size=2)
    fill_dummy_weights(model, seed)
    torch.save({n: p.detach() for n, p in model.named_parameters()}, out)
""")


def test_tensor_parallel_ranks_agree(tmp_path):
    path = config_only(tmp_path / "model", TP_CFG)
    with LLM(path, load_format="dummy", seed=5, tensor_parallel_size=2, **ENGINE) as llm:
        out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].token_ids
        rank0 = llm.engine.executor.local.model
        loaders = {n: get_weight_loader(p) for n, p in rank0.named_parameters()}
        w0 = {n: p.detach().clone() for n, p in rank0.named_parameters()}
    assert len(out) == GREEDY.max_tokens
    subprocess.run([sys.executable, "-c", RANK1_SCRIPT, path, "5", str(tmp_path / "rank1.pt")],
                   cwd=ROOT, check=True, env={**os.environ, "PYTHONHASHSEED": "random"}, timeout=120)
    w1 = torch.load(tmp_path / "rank1.pt")
    assert w0.keys() == w1.keys()
    replicated = [n for n in w0 if loaders[n] is default_weight_loader]  # the norms here
    assert replicated
    for name in replicated:
        assert torch.equal(w0[name], w1[name]), name
    # The one KV head, replicated on both ranks: rows after this rank's 2 query heads of qkv_proj.
    q_rows = 2 * TP_CFG.head_dim
    for name in [n for n in w0 if "qkv_proj" in n]:
        assert torch.equal(w0[name][q_rows:], w1[name][q_rows:]), name
    assert w0["model.layers.0.self_attn.qkv_proj.weight"][q_rows:].abs().sum() > 0
    # Rank 1 holds vocabulary rows 57..112 and one padding row, zeroed as the loader zeroes it.
    emb0, emb1 = w0["model.embed_tokens.weight"], w1["model.embed_tokens.weight"]
    assert torch.equal(emb1[-1], torch.zeros_like(emb1[-1])) and emb0[-1].abs().sum() > 0
