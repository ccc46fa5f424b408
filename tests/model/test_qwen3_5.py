"""Qwen3.5 (dense and MoE, hybrid Gated DeltaNet + gated attention) on the CPU against
transformers' models, float32, the model driven directly (no engine): ragged prefills in one
step, prompts in two chunks, a step mixing a chunk with one-token rows, decode steps; state
slots out of order over garbage; the vision-language checkpoint form; the config's refusals;
and the delta-rule references against each other."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from minivllm.config import ModelConfig
from minivllm.kernels.linear_attention_reference import (
    causal_conv1d_reference, gated_delta_rule_chunked_reference, gated_delta_rule_recurrent_reference)
from minivllm.layers.linear_attention import allocate_linear_state
from minivllm.layers.norm import RMSNorm1p
from minivllm.model.loader import fill_dummy_weights, load_weights
from minivllm.model.registry import build_model
from minivllm.ops.metadata import AttentionMetadata, StateMetadata
from minivllm.testing import hf_logits, random_tokens

# transformers builds the empty shared expert of shared_expert_intermediate_size 0 with a warning.
pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")

TOL = 1e-4
BS = 4             # KV block size
NUM_BLOCKS = 96
NUM_SLOTS = 8
SLOTS = (5, 2, 7)  # the three prompts' state slots: not 0..B-1, not in order
LENGTHS = (70, 9, 33)  # one prompt longer than a delta-rule chunk (64)
SPLITS = (37, 5, 20)   # first chunks' lengths: not multiples of 64, nor of the block size

SHAPES = dict(vocab_size=97, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=None,
              eos_token_id=None, tie_word_embeddings=False)
# The released models' multimodal RoPE keys: a text token has one position in every section.
ROPE = {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True}
LIN, FULL = "linear_attention", "full_attention"
# name -> (transformers causal LM class, its settings beyond SHAPES)
MODELS = {
    "dense-lin-first": ("Qwen3_5ForCausalLM", dict(intermediate_size=48, head_dim=32,
                                                    layer_types=[LIN, LIN, LIN, FULL])),
    "moe-shared-full-first": ("Qwen3_5MoeForCausalLM", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=32, layer_types=[FULL, LIN, LIN, LIN])),
    "moe-no-shared-lin-first": ("Qwen3_5MoeForCausalLM", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=0, layer_types=[LIN, LIN, FULL, LIN])),
}


def hf_config(arch: str, **overrides) -> transformers.PreTrainedConfig:
    config_class = getattr(transformers, arch).config_class
    cfg = config_class(**{**SHAPES, "rope_parameters": dict(ROPE), **overrides})
    cfg.architectures = [arch]
    return cfg


def make_hf(arch: str, settings: dict, seed: int) -> transformers.PreTrainedModel:
    """A float32 model with random weights of a scale that keeps the logits of order 1-10:
    zero-centred norm weights around 0, decays and conv filters of varied strength."""
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(hf_config(arch, **settings)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((0.0 if "linear_attn.norm" not in name else 1.0) + 0.2 * torch.randn_like(p))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.normal_(0.0, 0.1)
    return model


def saved_model(name: str, tmp_path_factory) -> tuple[transformers.PreTrainedModel, str]:
    """``MODELS[name]``'s transformers model (its own seed) and the directory it is saved in."""
    arch, settings = MODELS[name]
    hf = make_hf(arch, settings, seed=list(MODELS).index(name))
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return hf, str(path)


@pytest.fixture(scope="module", params=list(MODELS))
def setup(request, tmp_path_factory):
    hf, path = saved_model(request.param, tmp_path_factory)
    return request.param, hf, path


def load(path: str) -> torch.nn.Module:
    model = build_model(ModelConfig.from_hf_json(path))
    load_weights(model, path)
    return model.eval()


@dataclass
class Batch:
    """Paged KV cache and state slots for the test's sequences, and the metadata of a step."""

    config: ModelConfig
    kv_cache: torch.Tensor
    conv_state: torch.Tensor
    recurrent_state: torch.Tensor

    @classmethod
    def garbage(cls, config: ModelConfig, seed: int = 0) -> "Batch":
        """Every state slot and cache entry filled with noise: nothing may be read unwritten."""
        gen = torch.Generator().manual_seed(seed)
        conv, recurrent = allocate_linear_state(config, NUM_SLOTS, torch.float32, "cpu")
        kv = torch.empty(config.num_attention_layers, 2, NUM_BLOCKS, BS, config.num_key_value_heads, config.head_dim)
        for t in (conv, recurrent, kv):
            t.copy_(torch.randn(t.shape, generator=gen) * 3)
        return cls(config, kv, conv, recurrent)

    def metadata(self, rows: list[tuple[int, int, int, bool]]) -> tuple[AttentionMetadata, torch.Tensor]:
        """(sequence index, start position, tokens fed, continues its state) per sequence ->
        (metadata, positions). Sequence i owns blocks [32 i, 32 i + 32) in reverse order and slot SLOTS[i]."""
        lens = [n for _, _, n, _ in rows]
        positions = torch.cat([torch.arange(start, start + n) for _, start, n, _ in rows])
        tables = torch.tensor([[32 * i + 31 - j for j in range(32)] for i, _, _, _ in rows], dtype=torch.int32)
        slot_mapping = torch.cat([tables[b, pos // BS].long() * BS + pos % BS for b, pos in
                                  enumerate(torch.arange(s, s + n) for _, s, n, _ in rows)])
        state = StateMetadata(slots=torch.tensor([SLOTS[i] for i, _, _, _ in rows], dtype=torch.int64),
                              has_initial_state=torch.tensor([c for _, _, _, c in rows]),
                              conv_state=self.conv_state, recurrent_state=self.recurrent_state)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, cu_seqlens_q=torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32),
            kv_lens=torch.tensor([s + n for _, s, n, _ in rows], dtype=torch.int32), block_tables=tables,
            max_q_len=max(lens), is_decode=all(n == 1 for n in lens), kv_cache=self.kv_cache, state=state)
        return meta, positions


def step_logits(model, batch: Batch, seqs: list[list[int]], rows: list[tuple[int, int, int, bool]]) -> torch.Tensor:
    """Every fed row's logits (T, V) of one step."""
    meta, positions = batch.metadata(rows)
    ids = torch.tensor([t for i, start, n, _ in rows for t in seqs[i][start:start + n]])
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, meta)).float()


def hf_rows(hf, seqs: list[list[int]], rows: list[tuple[int, int, int, bool]]) -> torch.Tensor:
    """transformers' logits of the same rows, each from its whole sequence up to the row."""
    return torch.cat([hf_logits(hf, seqs[i][:start + n])[start:start + n] for i, start, n, _ in rows])


def prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [random_tokens(rng, n, vocab) for n in LENGTHS]


def check(model, hf, batch: Batch, seqs: list[list[int]], rows: list[tuple[int, int, int, bool]]) -> float:
    ours = step_logits(model, batch, seqs, rows)
    ref = hf_rows(hf, seqs, rows)
    torch.testing.assert_close(ours, ref, atol=TOL, rtol=0)
    return float((ours - ref).abs().max())


def test_ragged_prefill_in_one_step(setup) -> None:
    """Three prompts of different lengths, one over a chunk of the delta rule, in one step from
    slots holding garbage (has_initial_state False: a fresh start ignores them); slots no
    sequence uses keep their contents."""
    name, hf, path = setup
    model, seqs = load(path), prompts(hf.config.vocab_size)
    batch = Batch.garbage(model.config)
    untouched = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    before = batch.conv_state[:, untouched].clone(), batch.recurrent_state[:, untouched].clone()
    diff = check(model, hf, batch, seqs, [(i, 0, n, False) for i, n in enumerate(LENGTHS)])
    print(f"\n[qwen3.5] {name}: ragged prefill max|diff| = {diff:.2e}")
    assert torch.equal(batch.conv_state[:, untouched], before[0])
    assert torch.equal(batch.recurrent_state[:, untouched], before[1])


def test_two_chunks_then_mixed_step_then_decode(setup) -> None:
    """Each prompt in two chunks (the second continues from the slot), then a step mixing the
    first sequence's last chunk with one-token rows of the others (the chunked rule over one
    token), then 6 decode steps (the one-step recurrence), each checked against transformers
    over the whole sequence so far."""
    name, hf, path = setup
    model, seqs = load(path), prompts(hf.config.vocab_size, seed=2)
    batch = Batch.garbage(model.config, seed=1)
    worst = check(model, hf, batch, seqs, [(i, 0, s, False) for i, s in enumerate(SPLITS)])
    worst = max(worst, check(model, hf, batch, seqs, [(1, SPLITS[1], LENGTHS[1] - SPLITS[1], True),
                                                      (2, SPLITS[2], LENGTHS[2] - SPLITS[2], True)]))
    rng = np.random.default_rng(3)
    for i in (1, 2):
        seqs[i].append(int(rng.integers(hf.config.vocab_size)))
    mixed = [(0, SPLITS[0], LENGTHS[0] - SPLITS[0], True), (2, LENGTHS[2], 1, True), (1, LENGTHS[1], 1, True)]
    worst = max(worst, check(model, hf, batch, seqs, mixed))
    for _ in range(6):
        rows = []
        for i, s in enumerate(seqs):
            rows.append((i, len(s), 1, True))
            s.append(int(rng.integers(hf.config.vocab_size)))
        meta, _ = batch.metadata(rows)
        assert meta.is_decode
        worst = max(worst, check(model, hf, batch, seqs, rows))
    print(f"\n[qwen3.5] {name}: chunks, mixed step, decodes max|diff| = {worst:.2e}")


def test_decode_and_chunked_paths_agree_on_one_token_rows(setup) -> None:
    """The same one-token rows through the decode recurrence (is_decode) and through the
    chunked rule (a mixed step's path) give the same logits and states, to float32 rounding."""
    _, hf, path = setup
    model, seqs = load(path), prompts(hf.config.vocab_size, seed=4)
    batches = [Batch.garbage(model.config, seed=2) for _ in range(2)]
    prefill = [(i, 0, n, False) for i, n in enumerate(LENGTHS)]
    for b in batches:
        step_logits(model, b, seqs, prefill)
    for s in seqs:
        s.append(5)
    rows = [(i, n, 1, True) for i, n in enumerate(LENGTHS)]
    decode = step_logits(model, batches[0], seqs, rows)
    meta, positions = batches[1].metadata(rows)
    meta = dataclasses.replace(meta, is_decode=False)
    with torch.no_grad():
        chunked = model.compute_logits(model(torch.tensor([s[-1] for s in seqs]), positions, meta))
    torch.testing.assert_close(decode, chunked, atol=1e-5, rtol=0)
    torch.testing.assert_close(batches[0].recurrent_state, batches[1].recurrent_state, atol=1e-5, rtol=0)


def to_conditional_generation(src: str, dst: Path, stack_experts: bool) -> None:
    """Rewrite a saved causal LM as its vision-language checkpoint: the text config under
    ``text_config`` beside a vision stub, the weights under ``model.language_model.``, a vision
    tower and an MTP tensor beside them, and (``stack_experts``) the experts stacked per layer
    as the released MoE checkpoints keep them."""
    dst.mkdir()
    text = json.loads((Path(src) / "config.json").read_text())
    arch = text.pop("architectures")[0].replace("ForCausalLM", "ForConditionalGeneration")
    config = {"architectures": [arch], "model_type": text["model_type"].removesuffix("_text"),
              "text_config": text, "vision_config": {"depth": 1, "hidden_size": 16},
              "tie_word_embeddings": text["tie_word_embeddings"], "image_token_id": 96}
    (dst / "config.json").write_text(json.dumps(config))
    tensors = {(k if k.startswith("lm_head") else k.replace("model.", "model.language_model.", 1)): v
               for k, v in load_file(str(Path(src) / "model.safetensors")).items()}
    if stack_experts:
        tensors = stacked_experts(tensors)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(48, 16)
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


def stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> ``experts.gate_up_proj`` (E, 2I, H) and ``experts.down_proj`` (E, H, I)."""
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    layers = {k.split(".mlp.experts.")[0] for k in tensors if ".mlp.experts." in k}
    for layer in layers:
        num = len({k for k in tensors if k.startswith(f"{layer}.mlp.experts.") and k.endswith("down_proj.weight")})
        part = lambda e, p: tensors[f"{layer}.mlp.experts.{e}.{p}.weight"]  # noqa: E731
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([part(e, "gate_proj"), part(e, "up_proj")]) for e in range(num)])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([part(e, "down_proj") for e in range(num)])
    return out


def test_conditional_generation_checkpoint_loads_the_text_model(setup, tmp_path: Path, caplog) -> None:
    """The vision-language form (nested config, ``model.language_model.`` names, stacked experts
    for MoE) gives transformers' logits; the vision tower and MTP tensors are skipped and logged."""
    name, hf, path = setup
    dst = tmp_path / "vl"
    to_conditional_generation(path, dst, stack_experts=name.startswith("moe"))
    config = ModelConfig.from_hf_json(str(dst))
    assert config.architecture.endswith("ForConditionalGeneration") and config.is_hybrid
    with caplog.at_level(logging.INFO, logger="minivllm.model.loader"):
        model = load(str(dst))
    assert "vision tower" in caplog.text and "multi-token-prediction" in caplog.text
    seqs = prompts(hf.config.vocab_size, seed=5)
    check(model, hf, Batch.garbage(model.config), seqs, [(i, 0, n, False) for i, n in enumerate(LENGTHS)])


def test_config_reads_the_hybrid_fields(setup) -> None:
    name, hf, path = setup
    c = ModelConfig.from_hf_json(path)
    assert c.layer_types == tuple(hf.config.layer_types)
    assert c.num_linear_layers == 3 and c.num_attention_layers == 1 and c.rotary_dim == c.head_dim // 4
    assert c.attn_output_gate and c.partial_rotary_factor == 0.25
    assert c.conv_state_shape(8) == (3, 8, 2 * 2 * 16 + 4 * 8, 3)
    assert c.recurrent_state_shape(8) == (3, 8, 4, 16, 8)
    assert c.shared_expert_intermediate_size == getattr(hf.config, "shared_expert_intermediate_size", 0)


def write_config(tmp_path: Path, arch: str, **changes) -> str:
    settings = MODELS["dense-lin-first" if arch == "Qwen3_5ForCausalLM" else "moe-shared-full-first"][1]
    c = {k: v for k, v in hf_config(arch, **settings).to_dict().items() if v is not None}
    for key, value in changes.items():
        if value is None:
            c.pop(key, None)
        else:
            c[key] = value
    (tmp_path / "config.json").write_text(json.dumps(c))
    return str(tmp_path)


@pytest.mark.parametrize("arch, change, match", [
    ("Qwen3_5ForCausalLM", {"layer_types": [LIN, "sliding_attention", LIN, FULL]}, "layer_types"),
    ("Qwen3_5ForCausalLM", {"rope_parameters": {**ROPE, "partial_rotary_factor": 0.3}}, "partial_rotary_factor"),
    ("Qwen3_5ForCausalLM", {"rope_parameters": {**ROPE, "partial_rotary_factor": 0.09375}}, "partial_rotary_factor"),
    ("Qwen3_5ForCausalLM", {"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ("Qwen3_5ForCausalLM", {"linear_conv_kernel_dim": None}, "linear_conv_kernel_dim"),
    ("Qwen3_5ForCausalLM", {"mamba_ssm_dtype": "bfloat16"}, "mamba_ssm_dtype"),
    ("Qwen3_5ForCausalLM", {"full_attention_interval": 2}, "full_attention_interval"),
    ("Qwen3_5ForCausalLM", {"rope_parameters": {**ROPE, "rope_type": "yarn"}}, "rope type 'yarn'"),
    ("Qwen3_5MoeForCausalLM", {"norm_topk_prob": False}, "norm_topk_prob"),
    ("Qwen3_5MoeForCausalLM", {"shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size"),
])
def test_config_refusals_name_the_field(tmp_path: Path, arch: str, change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_json(write_config(tmp_path, arch, **change))


def test_partial_rotary_and_gate_belong_to_qwen3_5_only(tmp_path: Path) -> None:
    c = ModelConfig.from_hf_json(write_config(tmp_path, "Qwen3_5ForCausalLM"))
    with pytest.raises(ValueError, match="layer_types: Qwen3ForCausalLM"):
        ModelConfig(**{**c.__dict__, "architecture": "Qwen3ForCausalLM"})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig(**{**c.__dict__, "architecture": "Qwen3ForCausalLM", "layer_types": ()})
    with pytest.raises(ValueError, match="linear_num_key_heads"):  # 2 q/k heads over 4 ranks
        build_model(c, tp_size=4)


def test_dummy_weights_fill_every_parameter(setup) -> None:
    """``load_format="dummy"``: every Qwen3.5 parameter has a fill rule (zero-centred norms at
    their unit scale 0, A_log 0, dt_bias 1) and the model runs on them."""
    _, hf, path = setup
    model = build_model(ModelConfig.from_hf_json(path))
    fill_dummy_weights(model, seed=0)
    norms = [m.weight for m in model.modules() if isinstance(m, RMSNorm1p)]
    assert norms and all(bool((w == 0).all()) for w in norms)
    logits = step_logits(model, Batch.garbage(model.config), prompts(hf.config.vocab_size), [(0, 0, 9, False)])
    assert torch.isfinite(logits).all()


def test_chunked_delta_rule_equals_the_recurrence() -> None:
    """Varlen batch (lengths around the chunk size, one of one token), initial states in
    scattered slots (one fresh over garbage): the chunked form's outputs and final states are
    the token-by-token recurrence's; slots no sequence owns are left alone."""
    gen = torch.Generator().manual_seed(0)
    lens, hk, h, k_dim, v_dim = [19, 1, 40, 16], 2, 4, 8, 6
    t = sum(lens)
    q, k = torch.randn(t, hk, k_dim, generator=gen), torch.randn(t, hk, k_dim, generator=gen)
    v = torch.randn(t, h, v_dim, generator=gen)
    g = -torch.rand(t, h, generator=gen) * 0.7
    beta = torch.rand(t, h, generator=gen)
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    slots, init = torch.tensor([6, 1, 3, 0]), torch.tensor([True, True, False, True])
    state = torch.randn(8, h, k_dim, v_dim, generator=gen)
    s_rec, s_chunk = state.clone(), state.clone()
    o_rec = gated_delta_rule_recurrent_reference(q, k, v, g, beta, s_rec, cu, slots, init)
    o_chunk = gated_delta_rule_chunked_reference(q, k, v, g, beta, s_chunk, cu, slots, init, chunk_size=16)
    torch.testing.assert_close(o_chunk, o_rec, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_chunk, s_rec, atol=1e-5, rtol=1e-5)
    assert torch.equal(s_chunk[[2, 4, 5, 7]], state[[2, 4, 5, 7]])
    # A sequence fed in two calls equals it fed in one (state carried in the slot).
    s_two = state.clone()
    first = gated_delta_rule_chunked_reference(q[:7], k[:7], v[:7], g[:7], beta[:7], s_two,
                                               torch.tensor([0, 7]), slots[:1], init[:1], chunk_size=16)
    rest = gated_delta_rule_chunked_reference(q[7:19], k[7:19], v[7:19], g[7:19], beta[7:19], s_two,
                                              torch.tensor([0, 12]), slots[:1], torch.tensor([True]), chunk_size=16)
    torch.testing.assert_close(torch.cat([first, rest]), o_rec[:19], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_two[6], s_rec[6], atol=1e-5, rtol=1e-5)


def test_causal_conv_continues_from_its_state() -> None:
    """A sequence's conv in three calls (2, 1 and 6 rows: the state spans calls shorter than the
    kernel) equals it in one; a fresh start ignores its slot's contents."""
    gen = torch.Generator().manual_seed(1)
    channels, width = 5, 4
    x, w = torch.randn(9, channels, generator=gen), torch.randn(channels, width, generator=gen)
    whole_state = torch.randn(3, channels, width - 1, generator=gen)
    parts_state = whole_state.clone()
    slot, fresh, cont = torch.tensor([2]), torch.tensor([False]), torch.tensor([True])
    whole = causal_conv1d_reference(x, w, whole_state, torch.tensor([0, 9]), slot, fresh)
    parts = [causal_conv1d_reference(x[a:b], w, parts_state, torch.tensor([0, b - a]), slot,
                                     fresh if a == 0 else cont) for a, b in ((0, 2), (2, 3), (3, 9))]
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-6, rtol=0)
    torch.testing.assert_close(parts_state, whole_state, atol=0, rtol=0)
    torch.testing.assert_close(whole_state[2], x[-(width - 1):].t(), atol=0, rtol=0)


def test_cli_and_server_run_a_hybrid_checkpoint(tmp_path: Path, capsys) -> None:
    """The tiny fixture's tokenizer beside a Qwen3.5 checkpoint of its vocabulary: the CLI and
    the OpenAI server answer what the offline ``LLM`` answers."""
    from minivllm import LLM
    from minivllm.__main__ import main as cli_main
    from tests.server.utils import add_fixture_tokenizer, assert_server_completes_as_llm

    arch, settings = MODELS["dense-lin-first"]
    make_hf(arch, {**settings, "vocab_size": 100}, seed=11).save_pretrained(tmp_path)
    path = add_fixture_tokenizer(tmp_path)
    with LLM(path, device="cpu", dtype="float32", block_size=BS, num_blocks=16, max_model_len=64) as llm:
        want = assert_server_completes_as_llm(llm, "12+34=")
    assert cli_main(["generate", "--model", path, "--device", "cpu", "--dtype", "float32", "--block-size", "4",
                     "--num-blocks", "16", "--max-model-len", "64", "--max-tokens", "4", "--ignore-eos",
                     "12+34="]) == 0
    assert want and want in capsys.readouterr().out
