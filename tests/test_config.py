"""Every config and SamplingParams error names the field at fault."""

from __future__ import annotations

import json

import pytest

from minivllm.config import CacheConfig, Llama3RopeScaling, ModelConfig, SchedulerConfig
from minivllm.sampling import RequestOutputKind, SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    (dict(block_size=0), "block_size"),
    (dict(block_size=6), "power of two"),
    (dict(block_size=True), "block_size"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching"),
])
def test_cache_config_errors(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        CacheConfig(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(max_model_len=1), "max_model_len"),
    (dict(policy="fifo"), "policy"),
    (dict(chunked_prefill=1), "chunked_prefill"),
    (dict(chunked_prefill=False, max_num_batched_tokens=100, max_model_len=200), "max_model_len"),
])
def test_scheduler_config_errors(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


def test_unknown_keys_are_errors() -> None:
    with pytest.raises(ValueError, match="max_num_sequences"):
        SchedulerConfig.from_dict({"max_num_sequences": 4})
    with pytest.raises(ValueError, match="blocksize"):
        CacheConfig.from_dict({"blocksize": 4})
    with pytest.raises(ValueError, match="temp"):
        SamplingParams.from_dict({"temp": 0.5})
    assert SchedulerConfig.from_dict({"max_num_seqs": 4}).max_num_seqs == 4
    assert SamplingParams.from_dict({"stop_token_ids": [1, 2]}).stop_token_ids == (1, 2)
    # A list, as vLLM users write it, is accepted and kept as a tuple (hashable params).
    listed = SamplingParams(stop_token_ids=[3, 4])
    assert listed.stop_token_ids == (3, 4) and listed == SamplingParams(stop_token_ids=(3, 4))
    assert hash(listed) == hash(SamplingParams(stop_token_ids=(3, 4)))
    # stop strings: one string, a list or a tuple, kept as a tuple; round-trips through a dict.
    assert SamplingParams(stop="ab").stop == ("ab",) and SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    p = SamplingParams(stop=["ab"], include_stop_str_in_output=True)
    assert SamplingParams.from_dict(p.to_dict()) == p


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(ignore_eos=1), "ignore_eos"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids"),
    (dict(stop_token_ids={1}), "stop_token_ids"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    (dict(seed=1.5), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop=[1]), "stop"),
    (dict(stop=3), "stop"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (dict(output_kind="cumulative"), "output_kind"),
    (dict(output_kind=2), "output_kind"),
])
def test_sampling_params_errors(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_valid_edges() -> None:
    assert SamplingParams(temperature=0).greedy
    SamplingParams(top_k=0), SamplingParams(top_k=-1), SamplingParams(top_p=1.0, min_p=1.0)
    p = SamplingParams(stop_token_ids=(3,), seed=7)
    assert SamplingParams.from_dict(p.to_dict()) == p
    # output_kind: the enum or its value, kept as the enum; round-trips through a dict (JSON traces).
    final = SamplingParams(output_kind="final_only")
    assert final.output_kind is RequestOutputKind.FINAL_ONLY
    assert final == SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY) != SamplingParams()
    assert SamplingParams.from_dict(final.to_dict()) == final and final.to_dict()["output_kind"] == "final_only"


def _hf(tmp_path, **over) -> str:
    cfg = dict(architectures=["Qwen3ForCausalLM"], vocab_size=100, hidden_size=32,
               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, rope_theta=10000.0, eos_token_id=[5, 6])
    cfg.update(over)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_model_config_from_hf_json(tmp_path) -> None:
    cfg = ModelConfig.from_hf_json(_hf(tmp_path))
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.eos_token_id, cfg.rope_theta) == (8, 2, (5, 6), 10000.0)


def test_eos_ids_from_config_and_generation_config(tmp_path) -> None:
    """Every eos id counts (Llama-3.x instruct lists three; vLLM stops at each), merged from
    config.json and generation_config.json in order without repeats; one id stays an int."""
    assert ModelConfig.from_hf_json(_hf(tmp_path, eos_token_id=7)).eos_token_id == 7
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7, 8]}))
    assert ModelConfig.from_hf_json(_hf(tmp_path, eos_token_id=7)).eos_token_id == (7, 9, 8)
    assert ModelConfig.from_hf_json(_hf(tmp_path, eos_token_id=None)).eos_token_id == (9, 7, 8)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, "x"]}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id"):
        ModelConfig.from_hf_json(_hf(tmp_path))


@pytest.mark.parametrize("over, match", [
    (dict(architectures=["MistralForCausalLM"]), "unsupported architectures"),
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(hidden_size=None), "hidden_size"),
])
def test_model_config_errors(tmp_path, over, match) -> None:
    if over.get("hidden_size", 0) is None:
        over = {}
        path = _hf(tmp_path)
        data = json.loads((tmp_path / "config.json").read_text())
        del data["hidden_size"]
        (tmp_path / "config.json").write_text(json.dumps(data))
    else:
        path = _hf(tmp_path, **over)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_json(path)


@pytest.mark.parametrize("kv_heads", ["absent", None])
def test_missing_num_key_value_heads_means_multi_head_attention(tmp_path, kv_heads) -> None:
    """HF's rule: no (or a null) ``num_key_value_heads`` is one KV head per query head."""
    path = _hf(tmp_path, num_attention_heads=8, head_dim=4, num_key_value_heads=kv_heads)
    if kv_heads == "absent":
        data = json.loads((tmp_path / "config.json").read_text())
        del data["num_key_value_heads"]
        _write(tmp_path, data)
    cfg = ModelConfig.from_hf_json(path)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (8, 8)


def test_zero_num_key_value_heads_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_hf_json(_hf(tmp_path, num_key_value_heads=0))


# ---- Qwen2/2.5 and Llama-3.x configs; RoPE in both spellings; what is refused ----

# Llama-3.2-1B's config.json as published (transformers 4.45: rope_theta + rope_scaling).
LLAMA_3_2_1B_PUBLISHED = dict(
    architectures=["LlamaForCausalLM"], attention_bias=False, bos_token_id=128000, eos_token_id=128001,
    head_dim=64, hidden_act="silu", hidden_size=2048, intermediate_size=8192, max_position_embeddings=131072,
    mlp_bias=False, model_type="llama", num_attention_heads=32, num_hidden_layers=16, num_key_value_heads=8,
    pretraining_tp=1, rms_norm_eps=1e-05, rope_theta=500000.0, tie_word_embeddings=True, vocab_size=128256,
    rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
)
# Qwen2.5-0.5B's config.json as published (no head_dim, no attention_bias: Qwen2 hard-codes its bias).
QWEN2_5_0_5B_PUBLISHED = dict(
    architectures=["Qwen2ForCausalLM"], bos_token_id=151643, eos_token_id=151645, hidden_act="silu",
    hidden_size=896, intermediate_size=4864, max_position_embeddings=32768, max_window_layers=21,
    model_type="qwen2", num_attention_heads=14, num_hidden_layers=24, num_key_value_heads=2,
    rms_norm_eps=1e-06, rope_theta=1000000.0, sliding_window=32768, tie_word_embeddings=True,
    use_sliding_window=False, vocab_size=151936, rope_scaling=None,
)


def _write(tmp_path, cfg: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def _transformers5(cfg: dict) -> dict:
    """``cfg`` as transformers 5 writes it: theta and scaling in one ``rope_parameters``."""
    out = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling")}
    out["rope_parameters"] = {"rope_type": "default", **(cfg.get("rope_scaling") or {}),
                              "rope_theta": cfg["rope_theta"]}
    return out


def test_llama_3_2_published_spelling(tmp_path) -> None:
    cfg = ModelConfig.from_hf_json(_write(tmp_path, LLAMA_3_2_1B_PUBLISHED))
    assert (cfg.architecture, cfg.head_dim, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (
        "LlamaForCausalLM", 64, 8, True)
    assert (cfg.rope_theta, cfg.rms_norm_eps) == (500000.0, 1e-5)
    assert cfg.rope_scaling == Llama3RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                 original_max_position_embeddings=8192)


def test_rope_parameters_spelling_of_transformers_5_reads_the_same(tmp_path) -> None:
    for published in (LLAMA_3_2_1B_PUBLISHED, QWEN2_5_0_5B_PUBLISHED):
        want = ModelConfig.from_hf_json(_write(tmp_path, published))
        assert ModelConfig.from_hf_json(_write(tmp_path, _transformers5(published))) == want
        both = {**_transformers5(published), "rope_theta": published["rope_theta"]}  # both spellings, agreeing
        assert ModelConfig.from_hf_json(_write(tmp_path, both)) == want


def test_legacy_type_key_and_missing_original_context(tmp_path) -> None:
    """``"type"`` is the older ``"rope_type"``; without original_max_position_embeddings
    transformers takes max_position_embeddings, and so do we."""
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    cfg = ModelConfig.from_hf_json(_write(tmp_path, {**LLAMA_3_2_1B_PUBLISHED, "rope_scaling": scaling}))
    assert cfg.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 131072)


def test_qwen2_5_published_spelling(tmp_path) -> None:
    cfg = ModelConfig.from_hf_json(_write(tmp_path, QWEN2_5_0_5B_PUBLISHED))
    assert (cfg.architecture, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        "Qwen2ForCausalLM", 64, 14, 2)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.tie_word_embeddings) == (1e6, None, True)


def test_rope_theta_defaults_to_transformers_default(tmp_path) -> None:
    data = {k: v for k, v in QWEN2_5_0_5B_PUBLISHED.items() if k != "rope_theta"}
    assert ModelConfig.from_hf_json(_write(tmp_path, data)).rope_theta == 10000.0


@pytest.mark.parametrize("theta", [float("inf"), float("-inf"), float("nan"), "1e6", True, 0.0, -5.0])
@pytest.mark.parametrize("spelling", ["published", "transformers5"])
def test_non_finite_or_invalid_rope_theta_is_refused(tmp_path, theta, spelling) -> None:
    data = {**LLAMA_3_2_1B_PUBLISHED, "rope_theta": theta}
    if spelling == "transformers5":
        data = _transformers5(data)
    with pytest.raises(ValueError, match="rope_theta"):
        ModelConfig.from_hf_json(_write(tmp_path, data))


@pytest.mark.parametrize("theta", [float("inf"), float("nan")])
def test_model_config_refuses_non_finite_rope_theta(theta) -> None:
    with pytest.raises(ValueError, match="rope_theta"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=4, rope_theta=theta)


LLAMA3 = LLAMA_3_2_1B_PUBLISHED["rope_scaling"]


@pytest.mark.parametrize("over, match", [
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
     "rope type 'yarn' is not implemented"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope type 'linear' is not implemented"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope type 'dynamic' is not implemented"),
    (dict(rope_scaling={**LLAMA3, "low_freq_factor": None}), "low_freq_factor"),
    (dict(rope_scaling={k: v for k, v in LLAMA3.items() if k != "high_freq_factor"}), "lacks 'high_freq_factor'"),
    (dict(rope_scaling={**LLAMA3, "high_freq_factor": 1.0}), "low_freq_factor < high_freq_factor"),
    (dict(rope_scaling={**LLAMA3, "factor": float("inf")}), "factor"),
    (dict(rope_scaling={**LLAMA3, "mscale": 1.0}), r"unsupported RoPE setting\(s\) \['mscale'\]"),
    (dict(rope_scaling={"rope_type": "default", "factor": 2.0}), r"\['factor'\] for rope type 'default'"),
    (dict(rope_scaling={**LLAMA3, "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    (dict(rope_scaling={**LLAMA3, "rope_theta": 10000.0}), "rope_theta given twice and differently"),
    (dict(rope_scaling={**LLAMA3, "type": "default"}), "rope type given twice"),
    (dict(rope_scaling={"full_attention": LLAMA3}), "per-layer RoPE"),
    (dict(use_sliding_window=True, sliding_window=4096), "sliding-window"),
    (dict(layer_types=["full_attention"] * 15 + ["sliding_attention"]), r"non-full-attention layers \[15\]"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(mlp_bias=True), "mlp_bias"),
])
def test_what_we_cannot_honour_is_refused(tmp_path, over, match) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_json(_write(tmp_path, {**LLAMA_3_2_1B_PUBLISHED, **over}))
