"""Qwen3-Next (hybrid Gated DeltaNet + gated attention, dense and MoE layers mixed) on the CPU
against transformers' ``Qwen3NextForCausalLM``, float32:

- the fused DeltaNet projections: what the loader makes of ``in_proj_qkvz`` / ``in_proj_ba``,
  on one rank and on each of two, is transformers' own de-interleaving of the same tensors;
- the model driven directly: logits over two chunks per prompt, a mixed step and decodes;
- the engine (``LLM``): chunked prefill, a pool that preempts, and the same prompts again
  hitting the prefix cache: every token transformers' greedy one, every log-probability its;
- the config: the released checkpoints' spelling, and each refusal.

Planted and seen to fail: the fused tensors loaded as if their parts were contiguous
([q k v | z], [b | a]) fails the projection test and every logit and token test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm import LLM, SamplingParams
from minivllm.config import ModelConfig
from minivllm.layers.linear_attention import DeltaNetInProj
from minivllm.model.loader import load_weights, map_name
from minivllm.model.qwen3_5_mtp import check_mtp_config
from minivllm.model.registry import build_model
from minivllm.testing import hf_generate
from tests.model.test_qwen3_5 import BS, LENGTHS, SPLITS, Batch, check, hf_config, make_hf, prompts

ARCH = "Qwen3NextForCausalLM"
LIN, FULL = "linear_attention", "full_attention"
ROPE = {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25}
# name -> settings beyond test_qwen3_5.SHAPES (4 attention heads over 2 K/V heads, 2 q/k heads of
# the DeltaNet). Linear attention first and last in both; dense and sparse layers in both.
MODELS = {
    # layer 1 dense (mlp_only_layers), the others routed; 2 value heads per q/k head.
    "next-mlp-only": dict(head_dim=16, intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=24, shared_expert_intermediate_size=32, mlp_only_layers=[1],
                          layer_types=[LIN, FULL, LIN, LIN]),
    # decoder_sparse_step 2 routes layers 1 and 3, mlp_only_layers keeps 3 dense; 3 value heads
    # per q/k head; the top-k weights not renormalised.
    "next-sparse-step": dict(head_dim=32, intermediate_size=40, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=16, shared_expert_intermediate_size=24, decoder_sparse_step=2,
                             mlp_only_layers=[3], norm_topk_prob=False, linear_num_value_heads=6,
                             layer_types=[LIN, LIN, FULL, LIN]),
}
NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=3)


def make_next(name: str, seed: int):
    """``MODELS[name]`` as a transformers model with random weights (test_qwen3_5's scales)."""
    return make_hf(ARCH, {"rope_parameters": dict(ROPE), **MODELS[name]}, seed=seed)


@pytest.fixture(scope="module", params=list(MODELS))
def setup(request, tmp_path_factory):
    hf = make_next(request.param, seed=20 + list(MODELS).index(request.param))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, str(path)


def in_proj_rows(config: ModelConfig, path: str, tp_rank: int, tp_size: int) -> DeltaNetInProj:
    """Layer 0's packed in_proj of rank ``tp_rank``, loaded from the checkpoint's fused tensors
    through the model's own ``checkpoint_parts`` and the packing rules."""
    model = build_model(config)
    proj = DeltaNetInProj(config, tp_rank, tp_size)
    tensors = load_file(str(Path(path) / "model.safetensors"))
    for fused in ("in_proj_qkvz", "in_proj_ba"):
        name = f"model.layers.0.linear_attn.{fused}.weight"
        for part_name, part in model.checkpoint_parts(name, tensors[name]):
            _, shard = map_name(part_name, model.packed_modules_mapping)
            proj.weight.weight_loader(proj.weight, part, shard)
    return proj


def test_fused_projections_load_as_transformers_splits_them(setup) -> None:
    """Rank r of 1 and of 2: its q, k, v, z, b and a outputs of the packed in_proj are its heads'
    share of what transformers' ``fix_query_key_value_ordering`` makes of the fused projections."""
    _, hf, path = setup
    config = ModelConfig.from_hf_json(path)
    attn = hf.model.layers[0].linear_attn
    h = torch.randn(1, 5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = attn.fix_query_key_value_ordering(attn.in_proj_qkvz(h), attn.in_proj_ba(h))  # q k v z b a
    for tp_size in (1, 2):
        hk, hv = config.linear_num_key_heads // tp_size, config.linear_num_value_heads // tp_size
        for rank in range(tp_size):
            proj = in_proj_rows(config, path, rank, tp_size)
            with torch.no_grad():
                qkv, z, b, a = (h[0] @ proj.weight.t()).split(proj.local_sizes, dim=-1)
            key, value = hk * config.linear_key_head_dim, hv * config.linear_value_head_dim
            ours = (*qkv.split([key, key, value], dim=-1), z, b, a)
            heads = (hk, hk, hv, hv, hv, hv)
            for part, (got, full, n) in enumerate(zip(ours, want, heads)):
                share = full[0].reshape(5, full.shape[2], -1)[:, rank * n:(rank + 1) * n]
                torch.testing.assert_close(got, share.reshape(5, -1), atol=1e-6, rtol=0,
                                           msg=f"part {'qkvzba'[part]}, rank {rank} of {tp_size}")


def test_logits_through_chunks_a_mixed_step_and_decodes(setup) -> None:
    """Each prompt in two chunks (the second continuing from the state slot), then a step mixing
    a chunk with one-token rows, then decodes: transformers' logits at every row."""
    _, hf, path = setup
    model = build_model(ModelConfig.from_hf_json(path))
    load_weights(model, path)
    seqs, batch = prompts(hf.config.vocab_size, seed=6), Batch.garbage(model.config, seed=3)
    check(model, hf, batch, seqs, [(i, 0, s, False) for i, s in enumerate(SPLITS)])
    rng = np.random.default_rng(4)
    for i in (1, 2):
        check(model, hf, batch, seqs, [(i, SPLITS[i], LENGTHS[i] - SPLITS[i], True)])
        seqs[i].append(int(rng.integers(hf.config.vocab_size)))
    check(model, hf, batch, seqs, [(0, SPLITS[0], LENGTHS[0] - SPLITS[0], True), (2, LENGTHS[2], 1, True),
                                   (1, LENGTHS[1], 1, True)])
    for _ in range(3):
        rows = [(i, len(s), 1, True) for i, s in enumerate(seqs)]
        for s in seqs:
            s.append(int(rng.integers(hf.config.vocab_size)))
        check(model, hf, batch, seqs, rows)


def hf_logprobs(hf, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """transformers' log-probabilities (n, V) of the n completion positions."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + completion[:-1]])).logits[0, len(prompt) - 1:].float()
    return torch.log_softmax(logits, dim=-1)


def test_engine_equals_transformers_with_chunks_preemption_and_prefix_hits(setup) -> None:
    """A 7-token budget (chunked prefill), a pool of 12 blocks for four sequences of up to 10
    (preemption), snapshots every 2nd block: transformers' tokens and log-probabilities; then the
    same prompts again give the same, the three on a shared 18-token prefix resuming from the
    cache (the first of them computed it all the first time)."""
    _, hf, path = setup
    rng = np.random.default_rng(8)
    prefix = rng.integers(0, hf.config.vocab_size, 18).tolist()
    batch = [prefix + rng.integers(0, hf.config.vocab_size, n).tolist() for n in (3, 9, 14)]
    batch.append(rng.integers(0, hf.config.vocab_size, 23).tolist())
    want = [hf_generate(hf, p, NEW) for p in batch]
    llm = LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, block_size=BS, max_num_seqs=4,
              max_model_len=64, num_blocks=12, max_num_batched_tokens=7, state_snapshot_interval=2)
    cached = []
    for run in ("cold", "warm"):
        outs = llm.generate(batch, GREEDY, use_tqdm=False)
        assert [list(o.token_ids) for o in outs] == want, run
        for p, o in zip(batch, outs):
            ref = hf_logprobs(hf, p, list(o.token_ids))
            for i, top in enumerate(o.logprobs):
                for t, lp in top.items():
                    assert abs(lp - float(ref[i, t])) <= 1e-4, (run, i, t)
        cached.append([o.num_cached_tokens for o in outs])
    assert llm.engine.stats.num_preemptions > 0
    assert cached[0][0] == 0 and all(n > 0 for n in cached[1][:3]), cached


def test_config_reads_the_released_spelling(tmp_path: Path) -> None:
    """config.json as Qwen3-Next-80B-A3B's: no layer_types (full_attention_interval), RoPE at the
    top level, no MTP key (one MTP layer); with num_experts 0 every layer is dense."""
    c = ModelConfig.from_hf_json(write_config(tmp_path, layer_types=None, rope_parameters=None,
                                              full_attention_interval=2, rope_theta=1e7, partial_rotary_factor=0.25))
    assert c.layer_types == (LIN, FULL, LIN, FULL) and c.rotary_dim == 4 and c.rope_theta == 1e7
    assert c.attn_output_gate and c.mtp_num_hidden_layers == 1 and c.norm_topk_prob
    assert [c.is_sparse_layer(i) for i in range(4)] == [True, False, True, True]
    dense = ModelConfig.from_hf_json(write_config(tmp_path, num_experts=0))
    assert not any(dense.is_sparse_layer(i) for i in range(4)) and dense.shared_expert_intermediate_size == 0


def write_config(tmp_path: Path, **changes) -> str:
    """``next-mlp-only``'s config.json with ``changes`` (None: the key removed)."""
    c = {k: v for k, v in hf_config(ARCH, rope_parameters=dict(ROPE), **MODELS["next-mlp-only"]).to_dict().items()
         if v is not None}
    c.update(changes)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in c.items() if v is not None}))
    return str(tmp_path)


@pytest.mark.parametrize("change, match", [
    ({"attn_output_gate": False}, "attn_output_gate False"),
    ({"rope_parameters": {**ROPE, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0}}, "rope type 'llama3'"),
    ({"shared_expert_intermediate_size": None}, "shared_expert_intermediate_size"),
    ({"head_dim": None}, "lacks head_dim"),
    ({"mlp_only_layers": [4]}, "mlp_only_layers"),
])
def test_config_refusals_name_the_field(tmp_path: Path, change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_json(write_config(tmp_path, **change))


def test_mtp_layer_count_is_num_nextn_predict_layers(tmp_path: Path) -> None:
    check_mtp_config(ModelConfig.from_hf_json(write_config(tmp_path)))
    with pytest.raises(ValueError, match="num_nextn_predict_layers 1, got 2"):
        check_mtp_config(ModelConfig.from_hf_json(write_config(tmp_path, num_nextn_predict_layers=2)))


@pytest.mark.parametrize("setup", ["next-mlp-only"], indirect=True)
def test_a_mis_shaped_fused_projection_is_named(setup, tmp_path: Path) -> None:
    """A fused in_proj_qkvz one row short: the loader names it (a read through the parts would
    otherwise take the wrong rows)."""
    _, _, path = setup
    tensors = load_file(str(Path(path) / "model.safetensors"))
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((Path(path) / "config.json").read_text())
    model = build_model(ModelConfig.from_hf_json(str(tmp_path)))
    with pytest.raises(ValueError, match=rf"{name}: expected \d+ rows"):
        load_weights(model, str(tmp_path))
