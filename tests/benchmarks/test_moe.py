"""benchmarks/moe.py on the CPU: the Qwen3-30B-A3B config as our ModelConfig reads it, the
floors' byte counts in bf16 and FP8 (against transformers' parameter count, a hand count and
our FP8 model's parameters at the real shapes), the experts' check and timing row under
Triton's interpreter (16-bit and e4m3 experts), and the smoke run end to end in both modes."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmarks import moe, report
from benchmarks.fp8 import variant_path
from benchmarks.throughput import Workload
from minivllm.config import ModelConfig
from minivllm.model.registry import build_model
from minivllm.ops.dispatch import MOE_GEMV_MAX_TOKENS, Ops
from minivllm.testing import SMOKE_MOE_SHAPES, SMOKE_SHAPES, write_random_config

BF16 = moe.WeightFormat(2)
FP8 = moe.WeightFormat(2, fp8=True)


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> tuple[str, ModelConfig]:
    path = write_random_config(str(tmp_path_factory.mktemp("a3b")), moe.SHAPES_NAME)
    return path, ModelConfig.from_hf_json(path)


@pytest.fixture(scope="module")
def full_fp8(full) -> tuple[str, ModelConfig]:
    path = variant_path(full[0], "fp8-weights")
    return path, ModelConfig.from_hf_json(path)


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory) -> ModelConfig:
    path = write_random_config(str(tmp_path_factory.mktemp("tiny-fp8")), moe.SHAPES_NAME, dtype="float32",
                               **moe.SMOKE_FP8_MOE_SHAPES)
    return ModelConfig.from_hf_json(variant_path(path, "fp8-weights"))


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
    assert moe.all_weight_bytes(c, BF16) == 2 * sum(p.numel() for p in hf.parameters()) + 48 * moe.KV_SCALE_BYTES
    # batch 1 reads 8 of the 128 experts of each layer, one embedding row and everything dense
    one_step = moe.step_weight_bytes(c, 1, BF16)
    assert one_step == moe.dense_bytes(c, 1, BF16) + 48 * 8 * 3 * 2048 * 768 * 2
    assert moe.dense_bytes(c, 1, BF16) - moe.dense_bytes(c, 0, BF16) == 2048 * 2


def test_fp8_weight_bytes_by_hand_and_against_our_fp8_model_at_the_real_shapes(full_fp8) -> None:
    path, c = full_fp8
    assert c.quantization is not None
    # An expert: gate/up (1536, 2048) and down (2048, 768) in e4m3, a float32 scale per 128-block.
    expert = 3 * 2048 * 768 + 4 * (12 * 16 + 16 * 6)
    assert moe.expert_bytes(c, FP8) == expert
    qkv = (32 + 2 * 4) * 128 * 2048 + 4 * 40 * 16
    o = 2048 * 32 * 128 + 4 * 16 * 32
    bf16 = 2 * (2 * 2048 + 2 * 128) + 2 * 128 * 2048     # norms and the router of a layer
    head = 2 * 151936 * 2048 + 2 * 2048                   # LM head and the final norm
    assert moe.dense_bytes(c, 0, FP8) == 48 * (qkv + o + bf16) + head
    assert moe.dense_bytes(c, 1, FP8) - moe.dense_bytes(c, 0, FP8) == 2048 * 2   # an embedding row in bf16
    assert moe.step_weight_bytes(c, 1, FP8) == moe.dense_bytes(c, 1, FP8) + 48 * 8 * expert
    total = moe.dense_bytes(c, 0, FP8) + 48 * 128 * expert + 151936 * 2048 * 2 + 48 * moe.KV_SCALE_BYTES
    assert moe.all_weight_bytes(c, FP8) == total
    # what the engine's FP8 model holds (bf16 where not e4m3), built without memory
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = build_model(c)
    finally:
        torch.set_default_dtype(default)
    assert total == sum(p.numel() * p.element_size() for p in model.parameters())
    assert moe.step_weight_bytes(c, 1, FP8) / moe.step_weight_bytes(c, 1, BF16) == pytest.approx(0.553, abs=1e-3)


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
    assert_timed(row)


def test_the_sweep_checks_and_times_each_stage_s_tiles_and_names_the_fastest(tiny, monkeypatch) -> None:
    ops = Ops.build("triton", torch.device("cpu"), torch.float32)   # under the interpreter
    times = iter(range(100, 0, -1))                                   # each call faster than the last
    # Not called through: the sweep runs every tiling once itself, to check it.
    monkeypatch.setattr(moe, "graph_us", lambda call, calls: float(next(times)))
    monkeypatch.setattr(moe, "GEMV_SWEEP", [(4, 16, 4, 2), (16, 32, 2, 3)])
    row = moe.kernel_row(ops, tiny, 2, "cpu", torch.float32, gbs=100.0, timed=True, copies=1, calls=1, sweep=True)
    for stage in ("gate_up_config", "down_config"):
        assert list(row["gemv_sweep"][stage]["us"]) == ["4x16w4s2", "16x32w2s3"]
        assert row["gemv_sweep"][stage]["best"] == "16x32w2s3"
    paths = moe.forced_paths()
    wrong = dict(paths, **{"per-pair GEMV": lambda *a, **tiles: paths["per-pair GEMV"](*a, **tiles) + len(tiles)})
    monkeypatch.setattr(moe, "forced_paths", lambda: wrong)            # a tiling that changes the output
    inp = moe.kernel_inputs(tiny, 2, 1, 1, "cpu", torch.float32, seed=2, fp8=False)
    with pytest.raises(AssertionError, match="per-pair GEMV, gate_up with 4x16w4s2: max error"):
        moe.sweep_per_pair(lambda i: (*inp.operands(i), tiny.num_experts_per_tok, tiny.norm_topk_prob), inp, 1)


def test_the_grouped_sweep_checks_and_times_each_tiling_and_names_the_fastest(tiny, monkeypatch) -> None:
    ops = Ops.build("triton", torch.device("cpu"), torch.float32)   # under the interpreter
    times = iter(range(100, 0, -1))
    monkeypatch.setattr(moe, "graph_us", lambda call, calls: float(next(times)))
    monkeypatch.setattr(moe, "PATHS_MAX_TOKENS", MOE_GEMV_MAX_TOKENS)  # the grouped sweep alone
    monkeypatch.setattr(moe, "GROUPED_SWEEP", [(16, 16, 16, 4, 2), (32, 16, 32, 2, 3)])
    tokens = MOE_GEMV_MAX_TOKENS + 1
    row = moe.kernel_row(ops, tiny, tokens, "cpu", torch.float32, gbs=100.0, timed=True, copies=1, calls=1,
                         sweep=True)
    assert "gemv_sweep" not in row
    assert list(row["grouped_sweep"]["us"]) == ["m16 n16 k16 w4 s2", "m32 n16 k32 w2 s3"]
    assert row["grouped_sweep"]["best"] == "m32 n16 k32 w2 s3"
    flops = tokens * tiny.num_experts_per_tok * 3 * 2 * tiny.hidden_size * tiny.moe_intermediate_size
    assert row["tflops"] == pytest.approx(flops / (row["graph_us"] * 1e-6) / 1e12)
    grouped = moe.forced_paths()["grouped GEMM"]
    wrong = {"grouped GEMM": lambda *a, block_m=16, **k: grouped(*a, block_m=block_m, **k) + (block_m > 16)}
    monkeypatch.setattr(moe, "forced_paths", lambda: wrong)            # a tiling that changes the output
    inp = moe.kernel_inputs(tiny, tokens, 1, 1, "cpu", torch.float32, seed=3, fp8=False)
    with pytest.raises(AssertionError, match="grouped GEMM with m32 n16 k32 w2 s3: max error"):
        moe.sweep_grouped(lambda i: (*inp.operands(i), tiny.num_experts_per_tok, tiny.norm_topk_prob), inp, 1)


def assert_timed(row: dict, forced: bool = True) -> None:
    """The row's rates from a graph time of 10 us against 100 GB/s; ``forced``: both forced
    paths timed too."""
    assert row["GBs"] == pytest.approx(row["expert_bytes"] / 10e-6 / 1e9)
    assert row["pct_copy"] == pytest.approx(row["GBs"])             # of 100 GB/s
    assert row["torch_us"] > 0 and row["speedup"] == pytest.approx(row["torch_us"] / 10.0)
    assert row.get("paths_us") == ({"grouped GEMM": 10.0, "per-pair GEMV": 10.0} if forced else None)


# The FP8 GEMVs (weight-only) with both paths forced, then the W8A8 grouped GEMM alone (the
# FP8 GEMVs take seconds a pair under the interpreter).
@pytest.mark.parametrize("tokens, forced", [(1, True), (5, False)])
def test_kernel_row_checks_then_times_the_fp8_triton_experts(tiny_fp8, monkeypatch, tokens, forced) -> None:
    ops = Ops.build("triton", torch.device("cpu"), torch.bfloat16)  # under the interpreter
    monkeypatch.setattr(moe, "graph_us", lambda call, calls: (call(0), 10.0)[1])
    monkeypatch.setattr(moe, "PATHS_MAX_TOKENS", tokens if forced else tokens - 1)
    row = moe.kernel_row(ops, tiny_fp8, tokens, "cpu", torch.bfloat16, gbs=100.0, timed=True, copies=1, calls=1,
                         fp8=True)
    moe.print_kernel_row(row, 100.0)
    assert 2 <= row["distinct_experts"] <= 8 and 0 <= row["max_err"] < 1   # within TOL_FP8, or the check raised
    # an expert: gate/up (256, 256) and down (256, 128) in e4m3, 4 + 2 float32 block scales
    assert row["expert_bytes"] == row["distinct_experts"] * (3 * 256 * 128 + 4 * (4 + 2))
    assert_timed(row, forced)


def test_fp8_inputs_are_block_quantized_and_each_path_has_its_reference(tiny_fp8) -> None:
    from minivllm.config import FP8_WEIGHT_BLOCK
    from minivllm.kernels.fp8 import FP8_DTYPE, dequantize_fp8_block

    inp = moe.kernel_inputs(tiny_fp8, 2, 2, 2, "cpu", torch.bfloat16, seed=0, fp8=True)
    assert len(inp.scales) == 2 and inp.w13s[1].dtype == inp.w2s[1].dtype == FP8_DTYPE
    w13, w2 = inp.operands(1)[2:]
    s13, s2 = inp.scales_of(1)
    assert s13.shape == (8, 2, 2) and s2.shape == (8, 2, 1) and s13.dtype == torch.float32
    assert dequantize_fp8_block(w13[3], s13[3], FP8_WEIGHT_BLOCK).abs().max() > 0
    x = inp.xs[0]
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    weights = torch.full((2, 2), 0.5)
    gemv = moe.experts_reference(x, w13, w2, weights, ids, (s13, s2))
    grouped = moe.experts_reference(torch.cat([x] * 3), w13, w2, torch.cat([weights] * 3), torch.cat([ids] * 3),
                                    (s13, s2))
    assert 2 <= MOE_GEMV_MAX_TOKENS < 6
    assert not torch.equal(grouped[:2], gemv)   # W8A8 quantizes x: not the weight-only GEMVs' result


# 16-bit experts, then e4m3 ones on each expert path (against the reference of the path taken: exact)
@pytest.mark.parametrize("fp8, tokens", [(False, 4), (True, MOE_GEMV_MAX_TOKENS), (True, MOE_GEMV_MAX_TOKENS + 1)])
def test_the_check_refuses_wrong_experts(request, fp8, tokens) -> None:
    c = request.getfixturevalue("tiny_fp8" if fp8 else "tiny")
    dtype = torch.bfloat16 if fp8 else torch.float32
    ref = Ops.build("torch", torch.device("cpu"), dtype)
    off = 1.2 if fp8 else 1.01                                   # beyond TOL_FP8 / TOL_FP32

    class Off:
        triton = False

        @staticmethod
        def moe(*args, **kwargs):
            return ref.moe(*args, **kwargs) * off

    inp = moe.kernel_inputs(c, tokens, 1, 1, "cpu", dtype, seed=0, fp8=fp8)
    assert moe.check_experts(ref, c, inp, 0)[1] <= (0 if fp8 else moe.TOL_FP32)
    with pytest.raises(AssertionError, match="experts: max error"):
        moe.check_experts(Off(), c, inp, 0)


def test_decode_batches_are_the_fewest_steps_of_a_first_come_first_served_schedule() -> None:
    assert moe.decode_batches([3, 1, 2], 8) == [3, 2, 1]          # every request at once, then the longest alone
    assert moe.decode_batches([2, 2, 2], 2) == [2, 2, 1, 1]       # the third waits for a free slot
    # 2 ends after step 0 and 4 takes its slot; 3 after step 3, 5 in; 0 and 4 after step 4
    assert moe.decode_batches([5, 9, 1, 4, 4, 7], 4) == [4, 4, 4, 4, 4, 2, 2, 2, 2, 1, 1]


def test_the_offline_floor_reads_the_weights_of_every_step_at_its_batch(tmp_path: Path, monkeypatch) -> None:
    """Two requests of 1 and 3 tokens: steps of 2, 1, 1 tokens, each reading its own weights."""
    c = ModelConfig.from_hf_json(moe.write_random_config(str(tmp_path / "model"), "qwen3-30b-a3b"))
    wl = SimpleNamespace(prompt_lens=[4, 6], max_tokens=[1, 3])
    monkeypatch.setattr(moe, "run_offline",
                        lambda llm, wl, stream, label: dict(tok_s=1.0, completion_tokens=4, steps=3))
    args = SimpleNamespace(max_num_seqs=256)
    r = moe.offline(None, args, c, BF16, 10, 1.0, wl, stream=1)
    weights = moe.step_weight_bytes(c, 2, BF16) + 2 * moe.step_weight_bytes(c, 1, BF16)
    kv = (4 + 6 + 7 + 8) * 10
    assert (r["floor_steps"], r["floor_batch"], r["weight_bytes"]) == (3, 2, weights)
    assert r["floor_tok_s"] == pytest.approx(4 / ((weights + kv) / 1e9))


def test_parts_run_alone(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    common = ["--smoke", "--model-dir", str(tmp_path / "model"), "--num-requests", "128", "--batch1-repeats", "1",
              "--kernel-tokens", "1"]
    moe.main([*common, "--parts", "kernel"])
    d = json.loads((tmp_path / "out" / "moe.json").read_text())
    assert "kernel" in d and not {"batch1", "offline"} & set(d)
    moe.main([*common, "--parts", "offline"])
    d = json.loads((tmp_path / "out" / "moe.json").read_text())
    assert [r["workload"] for r in d["offline"]] == ["offline-2"] and not {"kernel", "batch1"} & set(d)
    with pytest.raises(SystemExit):
        moe.parse_args(["--parts", "kernel,offlne"])


def test_summary_names_and_goals_by_mode() -> None:
    names = {tuple(a): moe.summary_name(moe.parse_args(a)) for a in
             ([], ["--weights", "fp8"], ["--kv-cache-dtype", "fp8"], ["--weights", "fp8", "--kv-cache-dtype", "fp8"])}
    assert list(names.values()) == ["moe", "moe_fp8", "moe_kv_fp8", "moe_fp8_kv_fp8"]
    assert all(report.section_of(n) == "moe" for n in names.values())
    assert moe.GOALS_MS_TOKEN == {"bf16": 2.0, "fp8": 1.2}


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
    assert len(b["rounds_ms_per_token"]) == 2 and b["floor_ms"] > 0 and b["context"] == 12
    assert b["min"] <= b["ms_per_token"] <= b["max"] and b["max"] == max(b["rounds_ms_per_token"])
    out = capsys.readouterr().out
    assert "batch-1:" in out and "goal <= 2.0 ms/token" in out and "goal >= 0.70" in out


def test_fp8_smoke_run_writes_its_own_summary_beside_bf16s(tmp_path: Path, monkeypatch, capsys) -> None:
    out_dir = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out_dir))
    common = ["--num-requests", "128", "--batch1-repeats", "1", "--kernel-tokens", "1"]
    moe.main(["--smoke", "--model-dir", str(tmp_path / "bf16"), *common])
    bf16 = (out_dir / "moe.json").read_text()
    moe.main(["--smoke", "--weights", "fp8", "--model-dir", str(tmp_path / "model"), *common])
    assert (out_dir / "moe.json").read_text() == bf16            # the FP8 run leaves bf16's summary alone
    d = json.loads((out_dir / "moe_fp8.json").read_text())
    assert json.loads((tmp_path / "model-fp8" / "config.json").read_text())["quantization_config"] == (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
         "modules_to_not_convert": ["lm_head"]})
    assert d["weights"] == "fp8" and d["bytes"]["fp8"] and d["bytes"]["dtype_bytes"] == 4   # float32 smoke model
    assert d["bytes"]["all_weights"] == d["bytes"]["parameters"]   # the formula counts every parameter
    assert d["bytes"]["expert"] == 3 * 256 * 128 + 4 * (4 + 2)
    assert d["bytes"]["kv_per_token"] == 2 * 2 * 1 * 128 * 4
    b, (r,) = d["batch1"], d["offline"]
    assert b["goal_ms"] == 1.2 and b["met"] == (b["ms_per_token"] <= 1.2) and b["context"] == 12
    assert b["floor_ms"] == pytest.approx(b["step_bytes"] / d["copy_gbs"] / 1e6)
    c = ModelConfig.from_hf_json(str(tmp_path / "model-fp8"))
    fmt = moe.WeightFormat(4, fp8=True)                            # its float32 model: 4 bytes a 16-bit value
    assert d["bytes"]["dense_batch1"] == moe.dense_bytes(c, 1, fmt)
    # 2 layers x 2 experts a token, and the K/V of 12 positions
    assert b["step_bytes"] == pytest.approx(d["bytes"]["dense_batch1"] + 2 * 2 * d["bytes"]["expert"] + 12 * 2048)
    assert r["workload"] == "offline-2" and r["completion_tokens"] > 0
    assert 0 < r["floor_fraction"] == pytest.approx(r["tok_s"] / r["floor_tok_s"])
    assert [k["tokens"] for k in d["kernel"]] == [1] and d["kernel"][0]["expert_bytes"] == 2 * d["bytes"]["expert"]
    assert "goal <= 1.2 ms/token" in capsys.readouterr().out
    # the page's moe section: both summaries, each with its goal
    lines = report.moe_section(report.load(out_dir)["moe"])
    goals = {cells[0]: cells[5] for line in lines if line.startswith("|")
             for cells in [[c.strip() for c in line.strip("|").split("|")]] if cells[1] == "batch-1 ms/token"}
    assert goals == {"moe": "<= 2.0 ms/token", "moe_fp8": "<= 1.2 ms/token"}


def test_fp8_kv_cache_smoke_run_counts_one_byte_a_kv_value(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    moe.main(["--smoke", "--kv-cache-dtype", "fp8", "--model-dir", str(tmp_path / "model"), "--num-requests", "128",
              "--batch1-repeats", "1", "--kernel-tokens", "1"])
    d = json.loads((tmp_path / "out" / "moe_kv_fp8.json").read_text())
    assert d["bytes"]["kv_dtype_bytes"] == 1 and not d["bytes"]["fp8"]
    assert d["bytes"]["kv_per_token"] == 2 * 2 * 2 * 16 * 1       # layers, K and V, KV heads, head_dim
    assert d["bytes"]["all_weights"] == d["bytes"]["parameters"]
    b = d["batch1"]
    assert b["goal_ms"] == 2.0 and b["step_bytes"] == pytest.approx(
        d["bytes"]["dense_batch1"] + 2 * 2 * d["bytes"]["expert"] + 12 * d["bytes"]["kv_per_token"])
