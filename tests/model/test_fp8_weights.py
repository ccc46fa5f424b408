"""FP8 weights through the engine: a Qwen3-FP8-style checkpoint (``fixtures/fp8_checkpoint.py``
from a tiny 16-bit one) loads into e4m3 layers with their 128 x 128 block scales, and
``quantization="fp8"`` quantizes a 16-bit checkpoint per channel at load; both answer as the
16-bit model they came from by the top-5 rule and a KL bound, through the torch references
and the Triton kernels (TRITON_INTERPRET=1 here); what cannot be served is refused by name."""

from __future__ import annotations

import json
import os
import shutil
import dataclasses
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import (conftest sets it too)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from fixtures.fp8_checkpoint import convert_checkpoint  # noqa: E402
from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.config import ModelConfig  # noqa: E402
from minivllm.kernels.fp8 import FP8_DTYPE  # noqa: E402
from minivllm.layers.linear import LinearBase  # noqa: E402
from minivllm.testing import (  # noqa: E402
    TinyConfig, agreement, make_hf_model, make_model_executor, random_tokens, save_hf_model,
)

BS = 4
# Every packed part and rank on a 128 edge (q 256 rows, k and v 128, gate and up 256).
TINY = TinyConfig(vocab_size=97, hidden_size=256, intermediate_size=256, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=128, max_position_embeddings=128)
EXECUTOR = dict(device="cpu", block_size=BS, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    """(the 16-bit checkpoint, its FP8 conversion)."""
    root = tmp_path_factory.mktemp("fp8-weights")
    src = save_hf_model(make_hf_model(TINY, seed=0, std=0.05), root / "bf16")
    convert_checkpoint(src, root / "fp8")
    return src, str(root / "fp8")


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [random_tokens(rng, 12, TINY.vocab_size) for _ in range(n)]


def linear_layers(ex) -> list[LinearBase]:
    return [m for m in ex.model.modules() if isinstance(m, LinearBase)]


def source_and_ours(src: str, path: str, kernels: str = "torch", **options):
    """Executors, bf16: the 16-bit source through the references, and ours over ``path``."""
    return (make_model_executor(src, dtype="bfloat16", kernels="torch", **EXECUTOR),
            make_model_executor(path, dtype="bfloat16", kernels=kernels, **options, **EXECUTOR))


def assert_agrees(ref, ours, batch: list[list[int]], n: int, max_kl: float, label: str) -> None:
    """``ours`` against ``ref`` over ``batch`` (``n`` greedy tokens each): the top-5 rule at every
    first difference, and the mean KL under ``max_kl`` (minivllm.testing.agreement)."""
    a = agreement(ref, ours, batch, n, tuple(range(16)), BS)
    print(f"\n[{label}] {a}")
    assert a.top5_failures == 0 and a.mean_kl <= max_kl


def test_the_checkpoint_loads_into_e4m3_layers_with_its_block_scales(checkpoints) -> None:
    _, fp8 = checkpoints
    c = ModelConfig.from_hf_json(fp8)
    assert c.quantization is not None and c.quantization.weight_block_size == (128, 128)
    ex = make_model_executor(fp8, dtype="bfloat16", kernels="torch", **EXECUTOR)
    layers = linear_layers(ex)
    assert len(layers) == 4 * TINY.num_hidden_layers
    from safetensors.torch import load_file

    stored = load_file(os.path.join(fp8, "model.safetensors"))
    qkv = ex.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8_DTYPE and qkv.weight_scale.shape == (4, 2)
    # The packed q | k | v rows and their scale rows, each part where the loader put it.
    q = stored["model.layers.0.self_attn.q_proj.weight"]
    v_scale = stored["model.layers.0.self_attn.v_proj.weight_scale_inv"]
    assert torch.equal(qkv.weight[:256].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(qkv.weight_scale[3:], v_scale)
    # The LM head and the embedding stay 16-bit.
    assert ex.model.lm_head.weight.dtype == torch.bfloat16


def test_fp8_checkpoint_agrees_with_the_model_it_came_from(checkpoints) -> None:
    """bf16 activations; 8 prompts x 16 greedy tokens against the 16-bit checkpoint, through the
    references (the Triton kernels run in the MoE test below, whose checkpoint has a dense
    layer too). Measured on this model (weights std 0.05): 2 of 8 prompts identical, the
    other 6 by the top-5 rule, mean KL 3.8e-3, where bf16 against float32 gives 5.3e-5 (FP8's
    error grows with the weights' scale as bf16's does: 3.3e-4 at std 0.02, 2.4e-2 at 0.1)."""
    ref, ours = source_and_ours(*checkpoints)
    assert_agrees(ref, ours, prompts(8), 16, 2e-2, "fp8 weights")


def test_quantization_fp8_quantizes_a_16_bit_checkpoint_per_channel(checkpoints) -> None:
    src, _ = checkpoints
    ref, ours = source_and_ours(src, src, quantization="fp8")
    for layer in linear_layers(ours):
        assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (layer.weight.shape[0],)
    assert_agrees(ref, ours, prompts(8), 16, 2e-2, "fp8 on the fly")  # measured: mean KL 3.5e-3


def test_the_engine_serves_an_fp8_checkpoint(checkpoints) -> None:
    """Through LLM with prefix caching and preemption: every request gets its tokens, and the
    cached prefixes hit."""
    _, fp8 = checkpoints
    shared = prompts(1, seed=3)[0]
    batch = [shared + p[:4] for p in prompts(5, seed=4)]
    with LLM(fp8, device="cpu", dtype="bfloat16", kernels="torch", skip_tokenizer_init=True, block_size=BS,
             num_blocks=16, max_num_seqs=4, max_num_batched_tokens=32) as llm:
        outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert [len(o.token_ids) for o in outs] == [8] * 5
        assert llm.engine.stats.num_cached_tokens > 0


def test_dummy_fp8_weights_are_random_e4m3_with_block_scales(checkpoints) -> None:
    _, fp8 = checkpoints
    ex = make_model_executor(fp8, dtype="bfloat16", kernels="torch", load_format="dummy", **EXECUTOR)
    for layer in linear_layers(ex):
        w = layer.weight.float() * layer.weight_scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        assert torch.isfinite(w).all() and 0.015 < w.std() < 0.025  # the dummy std 0.02
        assert (layer.weight_scale > 0).all()


def with_config(src: str, dst: Path, **change) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(change)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_what_cannot_be_served_is_refused_by_name(checkpoints, tmp_path) -> None:
    src, fp8 = checkpoints
    qc = json.loads((Path(fp8) / "config.json").read_text())["quantization_config"]
    awq = with_config(src, tmp_path / "awq", quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(ValueError, match="quant_method 'awq' is not served"):
        ModelConfig.from_hf_json(awq)
    kept = with_config(fp8, tmp_path / "kept", quantization_config={
        **qc, "modules_to_not_convert": ["model.layers.0.self_attn.q_proj"]})
    with pytest.raises(ValueError, match="modules_to_not_convert keeps decoder linear layers"):
        ModelConfig.from_hf_json(kept)
    channel = with_config(fp8, tmp_path / "channel", quantization_config={**qc, "weight_block_size": None})
    with pytest.raises(ValueError, match="per-channel scales"):
        ModelConfig.from_hf_json(channel)
    # A 16-bit checkpoint that claims to be FP8: its tensors are refused, not cast.
    claims = with_config(src, tmp_path / "claims", quantization_config=qc)
    with pytest.raises(ValueError, match=r"q_proj.weight -> .*qkv_proj.weight: QKVParallelLinear shard .q.: the checkpoint holds torch.float32, the model torch.float8_e4m3fn"):
        make_model_executor(claims, dtype="bfloat16", kernels="torch", **EXECUTOR)
    # Heads of 64 over 2 ranks: each rank's q part would be 64 rows, refused before any process starts.
    from minivllm.layers.weights import check_tp_divisibility

    with pytest.raises(ValueError, match=r"at tp_size 2 a rank holds \{'query heads': 64"):
        check_tp_divisibility(ModelConfig.from_hf_json(with_config(fp8, tmp_path / "d64", head_dim=64)), 2)
    check_tp_divisibility(ModelConfig.from_hf_json(fp8), 2)
    # Heads of 16: the k and v parts start off a 128 edge, so a block scale would span two.
    small = save_hf_model(make_hf_model(TinyConfig(), seed=0), tmp_path / "small")
    convert_checkpoint(small, tmp_path / "small-fp8")
    with pytest.raises(ValueError, match=r"QKVParallelLinear: an FP8 block-scaled layer needs every part"):
        make_model_executor(str(tmp_path / "small-fp8"), dtype="bfloat16", kernels="torch", **EXECUTOR)


def test_quantization_is_an_option_of_the_config_and_the_cli() -> None:
    from minivllm.__main__ import _engine_options, _parser
    from minivllm.config import ExecutorConfig

    with pytest.raises(ValueError, match="quantization must be one of"):
        ExecutorConfig(quantization="int4")
    args = _parser().parse_args(["generate", "--model", "m", "x", "--quantization", "fp8"])
    assert _engine_options(args)["quantization"] == "fp8"
    assert "quantization" not in _engine_options(_parser().parse_args(["generate", "--model", "m", "x"]))


# ---- Qwen3-MoE: the experts in FP8 ---------------------------------------------------------

# Experts of 128 (a block), 4 of them, top-2; layer 1 dense (intermediate 256): both kinds of MLP.
MOE = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_attention_heads=2,
           num_key_value_heads=1, head_dim=128, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
           mlp_only_layers=[1])


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory) -> tuple[str, str]:
    from minivllm.testing import randomize_weights
    from tests.model.test_qwen3_moe import moe_config

    root = tmp_path_factory.mktemp("fp8-moe")
    import transformers

    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(moe_config(**MOE)).float().eval()
    randomize_weights(hf, 0.03)
    hf.save_pretrained(root / "bf16")
    convert_checkpoint(root / "bf16", root / "fp8")
    return str(root / "bf16"), str(root / "fp8")


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_fp8_moe_checkpoint_agrees_with_the_model_it_came_from(moe_checkpoints, kernels) -> None:
    """The experts' block scales stacked at load; prefill (the grouped W8A8 GEMM, the dense
    layer's and the attention's FP8 GEMMs) and decode (the weight-only GEMVs) against the
    16-bit checkpoint. Measured (weights std 0.03; a
    routing that flips one expert moves a token far, so the scale is smaller than the dense
    test's): references mean KL 8.9e-4, per channel 9.2e-4, every first difference in the
    top-5."""
    ref, ours = source_and_ours(*moe_checkpoints, kernels=kernels)
    experts = ours.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == FP8_DTYPE and experts.scales[0].shape == (4, 2, 2)
    assert ours.model.model.layers[1].mlp.gate_up_proj.weight.dtype == FP8_DTYPE  # the dense layer
    # The interpreter's FP8 GEMV costs seconds a step: one prompt, its prefill and one decode step.
    n = 8 if kernels == "torch" else 1
    assert_agrees(ref, ours, prompts(n, seed=5), 12 if kernels == "torch" else 2, 5e-3, f"fp8 moe, {kernels}")


def test_quantization_fp8_quantizes_the_experts_too(moe_checkpoints) -> None:
    src, _ = moe_checkpoints
    ref, ours = source_and_ours(src, src, quantization="fp8")
    experts = ours.model.model.layers[0].mlp.experts
    assert experts.down_proj.dtype == FP8_DTYPE and [s.shape for s in experts.scales] == [(4, 256), (4, 256)]
    assert ours.model.model.layers[0].mlp.gate.weight.dtype == torch.bfloat16  # the router stays 16-bit
    assert_agrees(ref, ours, prompts(8, seed=6), 12, 5e-3, "fp8 moe on the fly")


def test_dummy_fp8_experts(moe_checkpoints) -> None:
    _, fp8 = moe_checkpoints
    ex = make_model_executor(fp8, dtype="bfloat16", kernels="torch", load_format="dummy", **EXECUTOR)
    experts = ex.model.model.layers[0].mlp.experts
    s13, _ = experts.scales
    w = experts.gate_up_proj.float() * s13.repeat_interleave(128, 1).repeat_interleave(128, 2)
    assert torch.isfinite(w).all() and 0.015 < w.std() < 0.025 and (s13 > 0).all()
    assert not torch.equal(experts.gate_up_proj[0].view(torch.uint8), experts.gate_up_proj[1].view(torch.uint8))


def test_tensor_parallel_fp8_equals_one_rank(tmp_path) -> None:
    """TP=2 on gloo over an FP8 checkpoint with an FP8 KV cache: each rank reads its rows
    (column-parallel) or columns (row-parallel) of every e4m3 weight and the matching block
    scales, experts split along I, and quantizes and reads its own KV head (of 2); float32
    activations, so the ranks' partial sums meet as one rank's sum does."""
    from minivllm.testing import randomize_weights
    from tests.model.test_qwen3_moe import moe_config
    import transformers

    torch.manual_seed(1)
    hf = transformers.Qwen3MoeForCausalLM(moe_config(**{**MOE, "moe_intermediate_size": 256, "num_key_value_heads": 2})).float().eval()
    randomize_weights(hf, 0.03)
    hf.save_pretrained(tmp_path / "bf16")
    convert_checkpoint(tmp_path / "bf16", tmp_path / "fp8")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = []
    for tp in (1, 2):
        with LLM(str(tmp_path / "fp8"), device="cpu", dtype="float32", kernels="torch", skip_tokenizer_init=True,
                 block_size=BS, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=64,
                 kv_cache_dtype="fp8", tensor_parallel_size=tp) as llm:
            outs.append([list(o.token_ids) for o in llm.generate(prompts(4, seed=7), greedy, use_tqdm=False)])
    assert outs[0] == outs[1]


def test_cli_and_server_serve_fp8_weights_and_an_fp8_cache(tmp_path, capsys) -> None:
    """The tiny fixture's tokenizer beside an FP8 checkpoint of its vocabulary: the OpenAI
    server answers what the offline LLM answers, both with an FP8 KV cache, and the CLI runs
    ``--quantization fp8 --kv-cache-dtype fp8`` on the 16-bit checkpoint."""
    from minivllm.__main__ import main as cli_main
    from tests.server.utils import add_fixture_tokenizer, assert_server_completes_as_llm

    src = save_hf_model(make_hf_model(dataclasses.replace(TINY, vocab_size=100), seed=2, std=0.05), tmp_path / "bf16")
    add_fixture_tokenizer(src)
    convert_checkpoint(src, tmp_path / "fp8")
    opts = dict(device="cpu", dtype="bfloat16", block_size=BS, num_blocks=16, max_model_len=64, kv_cache_dtype="fp8")
    with LLM(str(tmp_path / "fp8"), **opts) as llm:
        assert llm.engine.executor.kv_cache.dtype == FP8_DTYPE
        assert_server_completes_as_llm(llm, "12+34=")
    assert cli_main(["generate", "--model", src, "--device", "cpu", "--dtype", "bfloat16", "--block-size", "4",
                     "--num-blocks", "16", "--max-model-len", "64", "--max-tokens", "4", "--ignore-eos",
                     "--quantization", "fp8", "--kv-cache-dtype", "fp8", "12+34="]) == 0
    assert "12+34=" in capsys.readouterr().out
