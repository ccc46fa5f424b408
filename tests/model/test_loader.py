"""The loader is strict: every parameter written, every tensor used, all offenders listed."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from safetensors import safe_open

from minivllm.config import ModelConfig
from minivllm.layers.weights import get_shard_ids, get_weight_loader
from minivllm.model.decoder import PACKED_MODULES
from minivllm.model.loader import LazyTensor, checkpoint_files, load_weights, map_name
from minivllm.model.qwen3 import Qwen3ForCausalLM
from minivllm.ops.communicator import Communicator
from minivllm.ops.dispatch import Ops
from minivllm.testing import TinyConfig, make_hf_model, save_hf_model

SMALL = TinyConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request, tmp_path_factory):
    cfg = TinyConfig(**{**SMALL.__dict__, "tie_word_embeddings": request.param})
    hf = make_hf_model(cfg)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("ckpt"))


def rewrite(src: str, dst: str, edit) -> str:
    """Copy checkpoint ``src`` to ``dst`` with its tensors changed by ``edit(dict)``."""
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def fresh_model(path: str, tp_rank: int = 0, tp_size: int = 1) -> Qwen3ForCausalLM:
    # A communicator only for the shapes: loading runs no collective.
    comm = Communicator(tp_rank, tp_size) if tp_size > 1 else None
    ops = Ops(triton=False, use_gemv=False, pdl=False, comm=comm)
    return Qwen3ForCausalLM(ModelConfig.from_hf_json(path), ops=ops, tp_rank=tp_rank, tp_size=tp_size)


def load_whole_tensors(model: Qwen3ForCausalLM, path: str) -> None:
    """The reference: every tensor read whole, then narrowed by the weight loaders."""
    params = dict(model.named_parameters())
    for ckpt_name, tensor in load_file(os.path.join(path, "model.safetensors")).items():
        name, shard_id = map_name(ckpt_name, model.packed_modules_mapping)
        if name in params:
            get_weight_loader(params[name])(params[name], tensor, shard_id)


def test_loads_every_tensor_exactly(checkpoint):
    hf, path = checkpoint
    model = fresh_model(path)
    load_weights(model, path)
    sd = hf.state_dict()
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    want = torch.cat([sd[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv, want)
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(gate_up, torch.cat([sd["model.layers.0.mlp.gate_proj.weight"],
                                           sd["model.layers.0.mlp.up_proj.weight"]]))
    assert torch.equal(model.lm_head.weight, sd["lm_head.weight"])
    tied = hf.config.tie_word_embeddings
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    names = {n for n, _ in model.named_parameters()}
    assert ("lm_head.weight" in names) == (not tied)


def test_missing_extra_and_misshaped_all_listed(checkpoint, tmp_path):
    _, path = checkpoint

    def edit(t: dict) -> None:
        del t["model.layers.0.self_attn.k_proj.weight"]
        del t["model.norm.weight"]
        t["model.layers.1.self_attn.rogue.weight"] = torch.zeros(3)
        t["model.extra_bias"] = torch.zeros(2)
        t["model.layers.1.mlp.up_proj.weight"] = torch.zeros(5, 16)
        t["model.layers.0.input_layernorm.weight"] = torch.zeros(17)

    bad = rewrite(path, str(tmp_path / "bad"), edit)
    with pytest.raises(ValueError) as e:
        load_weights(fresh_model(bad), bad)
    msg = str(e.value)
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.norm.weight",
                 "model.layers.1.self_attn.rogue.weight", "model.extra_bias",
                 "model.layers.1.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight",
                 # a rejected tensor leaves its parameter unwritten, so it is missing too
                 "model.layers.1.mlp.up_proj.weight (-> model.layers.1.mlp.gate_up_proj.weight shard 1)"):
        assert name in msg, (name, msg)


def test_untied_checkpoint_without_lm_head_fails(tmp_path):
    hf = make_hf_model(SMALL)
    path = save_hf_model(hf, tmp_path / "ok")
    bad = rewrite(path, str(tmp_path / "bad"), lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing \(1\):\n\s+lm_head.weight"):
        load_weights(fresh_model(bad), bad)


def test_tied_checkpoint_with_stored_head_copy_loads(tmp_path):
    cfg = TinyConfig(**{**SMALL.__dict__, "tie_word_embeddings": True})
    path = save_hf_model(make_hf_model(cfg), tmp_path / "ok")
    copy = rewrite(path, str(tmp_path / "copy"),
                   lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    model = fresh_model(copy)
    load_weights(model, copy)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_sharded_checkpoint_with_index_loads(tmp_path):
    hf = make_hf_model(SMALL, seed=3)
    path = save_hf_model(hf, tmp_path / "sharded", max_shard_size="4KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    assert len(checkpoint_files(path)) > 1
    model = fresh_model(path)
    load_weights(model, path)
    assert torch.equal(model.model.embed_tokens.weight, hf.state_dict()["model.embed_tokens.weight"])


def test_index_naming_absent_file_raises(tmp_path):
    path = save_hf_model(make_hf_model(SMALL), tmp_path / "sharded", max_shard_size="4KB")
    victim = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[0]
    os.remove(os.path.join(path, victim))
    with pytest.raises(FileNotFoundError, match=victim):
        load_weights(fresh_model(path), path)


def test_no_checkpoint_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        checkpoint_files(tmp_path)


def test_map_name_matches_whole_components():
    assert map_name("model.layers.2.self_attn.v_proj.weight", PACKED_MODULES) == (
        "model.layers.2.self_attn.qkv_proj.weight", "v")
    assert map_name("model.layers.2.mlp.up_proj.weight", PACKED_MODULES) == (
        "model.layers.2.mlp.gate_up_proj.weight", 1)
    assert map_name("model.layers.2.self_attn.o_proj.weight", PACKED_MODULES) == (
        "model.layers.2.self_attn.o_proj.weight", None)


@pytest.mark.parametrize("rank", [0, 1])
def test_tp_rank_reads_only_its_shards(checkpoint, rank):
    """Rank r of 2 reads exactly the elements it holds (half of every sharded tensor, the
    norms whole), and gets the parameters that narrowing the whole tensors gives."""
    _, path = checkpoint
    model = fresh_model(path, rank, 2)
    report = load_weights(model, path)
    want = fresh_model(path, rank, 2)
    load_whole_tensors(want, path)
    for (name, got), (_, ref) in zip(model.named_parameters(), want.named_parameters()):
        assert torch.equal(got, ref), name
    stored = load_file(os.path.join(path, "model.safetensors"))
    assert report.num_tensors == len(stored)
    assert report.numel_total == sum(t.numel() for t in stored.values())
    # Every parameter the checkpoint holds (vocab 40: no padding; the optional KV cache
    # scales, absent from it, keep their default).
    assert report.numel_read == sum(p.numel() for p in model.parameters() if get_shard_ids(p) != ())
    replicated = sum(t.numel() for n, t in stored.items() if n.endswith("norm.weight"))
    assert report.numel_read == (report.numel_total - replicated) // 2 + replicated


def test_tp_load_error_names_rank_and_tensor(tmp_path):
    path = save_hf_model(make_hf_model(SMALL), tmp_path / "ok")
    bad = rewrite(path, str(tmp_path / "bad"),
                  lambda t: t.__setitem__("model.layers.1.self_attn.o_proj.weight", torch.zeros(16, 30)))
    with pytest.raises(ValueError, match=r"rank 1 of 2(.|\n)*model.layers.1.self_attn.o_proj.weight"):
        load_weights(fresh_model(bad, 1, 2), bad)
    with pytest.raises(ValueError) as e:
        load_weights(fresh_model(bad), bad)
    assert "tensor-parallel rank" not in str(e.value)


def test_lazy_tensor_reads_the_requested_slice(tmp_path):
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6).to(torch.bfloat16)
    save_file({"w": w}, str(tmp_path / "x.safetensors"))
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt", device="cpu") as f:
        lazy = LazyTensor(f, "w")
        assert (lazy.shape, lazy.dtype, lazy.numel_read) == (torch.Size([4, 6]), torch.bfloat16, 0)
        assert torch.equal(lazy.narrow(1, 2, 3), w.narrow(1, 2, 3)) and lazy.numel_read == 12
        assert lazy.narrow(0, 4, 0).shape == (0, 6)
        assert torch.equal(lazy.read(), w) and lazy.numel_read == 36
        with pytest.raises(ValueError, match=r"w: cannot narrow shape \(4, 6\)"):
            lazy.narrow(0, 3, 2)


def test_tensor_stored_in_two_checkpoint_shards_is_duplicated(tmp_path):
    """A tensor in two files of a sharded checkpoint is an error, not a silent overwrite."""
    path = save_hf_model(make_hf_model(SMALL), tmp_path / "one")
    dup = str(tmp_path / "dup")
    os.makedirs(dup)
    shutil.copy(os.path.join(path, "config.json"), dup)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    # A plain tensor, and a packed one (k_proj: a shard of qkv_proj), each in both files.
    victims = [halves["model-00001-of-00002.safetensors"][0], "model.layers.0.self_attn.k_proj.weight"]
    for victim in victims:
        for part in halves.values():
            if victim not in part:
                part.append(victim)
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, os.path.join(dup, file))
    weight_map = {n: file for file, part in halves.items() for n in part}
    with open(os.path.join(dup, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with pytest.raises(ValueError) as e:
        load_weights(fresh_model(dup), dup)
    for victim in victims:
        assert f"{victim}: appears more than once" in str(e.value)
