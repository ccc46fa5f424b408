"""benchmarks/moe.py on the CPU: the Qwen3-30B-A3B config as our ModelConfig reads it, the
floors' byte counts (against transformers' parameter count at the real shapes), the
experts' check and timing row under Triton's interpreter, and the smoke run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import moe
from benchmarks.qwen3_shapes import SMOKE_MOE_SHAPES, SMOKE_SHAPES, write_random_config
from benchmarks.throughput import Workload
from minivllm.config import ModelConfig
from minivllm.layers.ops import Ops


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> tuple[str, ModelConfig]:
    path = write_random_config(str(tmp_path_factory.mktemp("a3b")), moe.SHAPES_NAME)
    return path, ModelConfig.from_hf_json(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> ModelConfig:
    path = write_random_config(str(tmp_path_factory.mktemp("tiny")), moe.SHAPES_NAME, dtype="float32",
                               **SMOKE_SHAPES, **SMOKE_MOE_SHAPES)
    return ModelConfig.from_hf_json(path)


def test_the_config_reads_back_as_published(full) -> None:
    _, c = full
    assert (c.architecture, c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.intermediate_size) == (
        "Qwen3MoeForCausalLM", 151936, 2048, 48, 32, 4, 128, 6144)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (128, 8, 768, True)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings, c.tie_word_embeddings) == (1e6, 1e-6, 40960, False)
    assert (c.bos_token_id, c.eos_token_id, c.torch_dtype) == (151643, 151645, "bfloat16")
    assert moe.sparse_layers(c) == 48


def test_smoke_overrides_make_a_tiny_moe(tiny) -> None:
    c = tiny
    assert (c.architecture, c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (
        "Qwen3MoeForCausalLM", 64, 8, 2, 32)
    assert moe.sparse_layers(c) == c.num_hidden_layers == 2


def test_weight_bytes_match_transformers_parameters_at_the_real_shapes(full) -> None:
    import transformers

    path, c = full
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(transformers.AutoConfig.from_pretrained(path))
    # transformers' parameters, and our KV cache scales (a float32 pair a layer)
    assert moe.all_weight_bytes(c, 2) == 2 * sum(p.numel() for p in hf.parameters()) + 48 * moe.KV_SCALE_BYTES
    # batch 1 reads 8 of the 128 experts of each layer, one embedding row and everything dense
    one_step = moe.step_weight_bytes(c, 1, 2)
    assert one_step == moe.dense_bytes(c, 1, 2) + 48 * 8 * 3 * 2048 * 768 * 2
    assert moe.dense_bytes(c, 1, 2) - moe.dense_bytes(c, 0, 2) == 2048 * 2


def test_expected_distinct_experts_is_what_uniform_routing_gives(full) -> None:
    _, c = full
    assert moe.expected_distinct_experts(c, 0) == 0
    assert moe.expected_distinct_experts(c, 1) == pytest.approx(8)
    assert moe.expected_distinct_experts(c, 1024) == pytest.approx(128)
    rng = np.random.default_rng(0)
    for batch in (2, 16, 64):
        counts = [len({int(e) for _ in range(batch) for e in rng.choice(128, 8, replace=False)})
                  for _ in range(400)]
        assert np.mean(counts) == pytest.approx(moe.expected_distinct_experts(c, batch), rel=0.02), batch


def test_workload_kv_bytes_counts_every_decoded_tokens_context() -> None:
    wl = Workload(prompt_lens=[3, 10], max_tokens=[2, 1], id_limit=5, seed=0)
    assert moe.workload_kv_bytes(wl, kv_token=7) == ((3 + 4) + 10) * 7


@pytest.mark.parametrize("tokens", [2, 5])  # Ops.moe's per-pair GEMVs, then its grouped GEMM
def test_kernel_row_checks_then_times_the_triton_experts(tiny, monkeypatch, tokens) -> None:
    ops = Ops.build("triton", torch.device("cpu"), torch.float32)   # under the interpreter
    assert ops.triton
    monkeypatch.setattr(moe, "graph_us", lambda call, calls: (call(0), 10.0)[1])
    row = moe.kernel_row(ops, tiny, tokens, "cpu", torch.float32, gbs=100.0, timed=True, copies=2, calls=2)
    moe.print_kernel_row(row, 100.0)
    assert 2 <= row["distinct_experts"] <= 8 and row["max_err"] <= moe.TOL_FP32
    assert row["expert_bytes"] == row["distinct_experts"] * 3 * 64 * 32 * 4
    assert row["GBs"] == pytest.approx(row["expert_bytes"] / 10e-6 / 1e9)
    assert row["pct_copy"] == pytest.approx(row["GBs"])             # of 100 GB/s
    assert row["torch_us"] > 0 and row["speedup"] == pytest.approx(row["torch_us"] / 10.0)
    assert row["paths_us"] == {"grouped GEMM": 10.0, "per-pair GEMV": 10.0}


def test_the_check_refuses_wrong_experts(tiny) -> None:
    ref = Ops.build("torch", torch.device("cpu"), torch.float32)

    class Off:
        triton = False

        @staticmethod
        def moe(*args):
            return ref.moe(*args) * 1.01

    inp = moe.kernel_inputs(tiny, 4, 1, 1, "cpu", torch.float32, seed=0)
    assert moe.check_experts(ref, tiny, inp, 0)[1] <= moe.TOL_FP32
    with pytest.raises(AssertionError, match="experts: max error"):
        moe.check_experts(Off(), tiny, inp, 0)


def test_smoke_run_writes_every_part(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    moe.main(["--smoke", "--model-dir", str(tmp_path / "model"), "--num-requests", "128,256",
              "--batch1-repeats", "2", "--kernel-tokens", "1,16"])
    d = json.loads((tmp_path / "out" / "moe.json").read_text())
    assert d["bytes"]["all_weights"] == d["bytes"]["parameters"]   # the formula counts every parameter
    assert [r["tokens"] for r in d["kernel"]] == [1, 4]
    assert [r["workload"] for r in d["offline"]] == ["offline-2", "offline-4"]
    for r in d["offline"]:
        assert r["completion_tokens"] > 0 and 0 < r["floor_fraction"] == pytest.approx(r["tok_s"] / r["floor_tok_s"])
    b = d["batch1"]
    assert len(b["runs_ms_per_token"]) == 2 and b["floor_ms"] > 0 and b["context"] == 12
    out = capsys.readouterr().out
    assert "batch-1:" in out and "goal <= 2.0 ms/token" in out and "goal >= 0.70" in out
