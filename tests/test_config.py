"""Every config and SamplingParams error names the field at fault."""

from __future__ import annotations

import json

import pytest

from minivllm.config import CacheConfig, ModelConfig, SchedulerConfig
from minivllm.sampling import SamplingParams


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
])
def test_sampling_params_errors(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_valid_edges() -> None:
    assert SamplingParams(temperature=0).greedy
    SamplingParams(top_k=0), SamplingParams(top_k=-1), SamplingParams(top_p=1.0, min_p=1.0)
    p = SamplingParams(stop_token_ids=(3,), seed=7)
    assert SamplingParams.from_dict(p.to_dict()) == p


def _hf(tmp_path, **over) -> str:
    cfg = dict(architectures=["Qwen3ForCausalLM"], vocab_size=100, hidden_size=32,
               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, rope_theta=10000.0, eos_token_id=[5, 6])
    cfg.update(over)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_model_config_from_hf_json(tmp_path) -> None:
    cfg = ModelConfig.from_hf_json(_hf(tmp_path))
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.eos_token_id, cfg.rope_theta) == (8, 2, 5, 10000.0)


@pytest.mark.parametrize("over, match", [
    (dict(architectures=["LlamaForCausalLM"]), "unsupported architectures"),
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
