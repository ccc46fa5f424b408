"""``fixtures/fp8_checkpoint.py``: a tiny saved Qwen3 and Qwen3-MoE (transformers'
``save_pretrained``, one of them sharded) converted to the Qwen3-FP8 format: which tensors
became fp8 with scales, their shapes and dtypes, the config, the copies, and that
dequantizing gives the weights back within e4m3's rounding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from fixtures.fp8_checkpoint import convert_checkpoint, main
from minivllm.config import FP8_WEIGHT_BLOCK, Fp8Config
from minivllm.kernels.fp8 import FP8_DTYPE, dequantize_fp8_block
from minivllm.model.loader import checkpoint_files
from minivllm.testing import TinyConfig, make_hf_model, randomize_weights, save_hf_model

# hidden 160 and intermediate 200: partial 128x128 blocks in every projection
DENSE = TinyConfig(hidden_size=160, intermediate_size=200, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=40)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def read(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in checkpoint_files(directory):
        with safe_open(path, framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def check_converted(src: Path, dst: Path, quantized_names: set[str], scale_dtype: torch.dtype = torch.float32) -> None:
    """Every quantized weight is fp8 with (cdiv(N,128), cdiv(K,128)) scales of ``scale_dtype``
    that give it back within e4m3's rounding (and the 2^-9 by which an amax element may
    saturate under bf16 scales); every other tensor is copied bit for bit."""
    extra = 0.0 if scale_dtype == torch.float32 else 2.0 ** -9
    before, after = read(src), read(dst)
    assert set(after) == set(before) | {name + "_scale_inv" for name in quantized_names}
    for name, w in before.items():
        if name not in quantized_names:
            assert torch.equal(after[name], w) and after[name].dtype == w.dtype, name
            continue
        q, s = after[name], after[name + "_scale_inv"]
        assert q.dtype == FP8_DTYPE and q.shape == w.shape, name
        assert s.dtype == scale_dtype and s.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128)), name
        spread = s.float().repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
        err = (dequantize_fp8_block(q, s, FP8_WEIGHT_BLOCK) - w.float()).abs()
        assert torch.all(err <= (2.0 ** -4 + extra) * w.float().abs() + 2.0 ** -10 * spread + 1e-30), name


def test_dense_checkpoint(tmp_path: Path) -> None:
    src = Path(save_hf_model(make_hf_model(DENSE), tmp_path / "bf16", max_shard_size="200KB"))
    (src / "tokenizer_config.json").write_text("{}\n", encoding="utf-8")
    assert len(checkpoint_files(src)) > 1  # sharded: the index must name the scales too
    done = convert_checkpoint(src, tmp_path / "fp8")
    want = {f"model.layers.{i}.{m}.weight" for i in range(DENSE.num_hidden_layers) for m in LINEARS}
    assert set(done.quantized) == want
    check_converted(src, tmp_path / "fp8", want)
    index = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(read(tmp_path / "fp8"))
    assert (tmp_path / "fp8" / "tokenizer_config.json").exists()
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    qc = config.pop("quantization_config")
    assert config == json.loads((src / "config.json").read_text())
    assert qc["modules_to_not_convert"] == ["lm_head", "model.layers.0.input_layernorm",
                                            "model.layers.0.post_attention_layernorm",
                                            "model.layers.1.input_layernorm",
                                            "model.layers.1.post_attention_layernorm"]
    assert Fp8Config.from_hf(qc).scale_mode == "block"
    with pytest.raises(ValueError, match="already quantized"):
        convert_checkpoint(tmp_path / "fp8", tmp_path / "again")


def test_moe_checkpoint_keeps_the_router(tmp_path: Path) -> None:
    """Per-expert weights quantized, the router copied; bf16 scales, through the command line."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=97, hidden_size=160, intermediate_size=200, moe_intermediate_size=136, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=40, num_experts=3, num_experts_per_tok=2,
        mlp_only_layers=[1], max_position_embeddings=64, bos_token_id=None, eos_token_id=None)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    randomize_weights(model, 0.5)
    src = Path(save_hf_model(model, tmp_path / "bf16"))
    assert main([str(src), str(tmp_path / "fp8"), "--scale-dtype", "bfloat16"]) == 0
    experts = {f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(3) for p in ("gate_proj", "up_proj",
                                                                                         "down_proj")}
    want = experts | {f"model.layers.{i}.{m}.weight" for i in range(2) for m in LINEARS[:4]} | {
        f"model.layers.1.{m}.weight" for m in LINEARS[4:]}
    check_converted(src, tmp_path / "fp8", want, torch.bfloat16)
    qc = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert qc == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                  "modules_to_not_convert": ["lm_head", "model.layers.0.input_layernorm", "model.layers.0.mlp.gate",
                                             "model.layers.0.post_attention_layernorm",
                                             "model.layers.1.input_layernorm",
                                             "model.layers.1.post_attention_layernorm"],
                  "weight_block_size": [128, 128]}
    c = Fp8Config.from_hf(qc)
    assert not c.converts("model.layers.0.mlp.gate") and c.converts("model.layers.0.mlp.experts.2.up_proj")
