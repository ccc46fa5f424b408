"""Qwen3.5 at few rows takes the GEMV kernel for its projections (``Ops.project``), and at one
row the GEMV that normalises its input for the projection after each zero-centred norm
(``Ops.norm_project``): bf16 on the CPU, the Triton kernels under the interpreter, a decode
against the same model with every projection on the general path: the same greedy tokens and
log-probabilities to bf16 rounding, and the GEMV kernel ran for the DeltaNet's, the
attention's and the MLP's projections, the norm-fused one for the three after a norm.

Planted and seen to fail: ``Ops.project`` passing the MLP's [gate | up] to the GEMV without
``gated``, ``Ops.project`` never taking the GEMV, and the fused norm without its ``1 + w``."""

from __future__ import annotations

from pathlib import Path

import pytest

import minivllm.kernels.gemv as gemv_module
from minivllm import LLM, SamplingParams
from minivllm.ops.dispatch import Ops
from tests.model.test_qwen3_5 import write_config

pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")

# Wide enough that the one-row GEMV takes every projection (at least 32 programs of 4 columns),
# and no wider: the interpreter runs each program in Python. One DeltaNet and one attention layer.
WIDE = dict(hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
            num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])


def run(path: str) -> list[tuple[list[int], list[float]]]:
    llm = LLM(path, device="cpu", dtype="bfloat16", kernels="triton", load_format="dummy", skip_tokenizer_init=True,
              block_size=4, num_blocks=16, max_num_seqs=2, max_model_len=32, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=0)
    outs = llm.generate([[5, 9, 13]], params, use_tqdm=False)  # 3 rows (the prompt), then 1
    return [(list(o.token_ids), [lp[t] for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]


def test_few_rows_take_the_gemv_and_agree_with_the_general_path(tmp_path: Path, monkeypatch) -> None:
    path = write_config(tmp_path, "Qwen3_5ForCausalLM", **WIDE)
    shapes: list[tuple[int, int]] = []
    normed: list[tuple[int, int]] = []
    kernel, normed_kernel = gemv_module.gemv, gemv_module.rms_norm_gemv

    def counted(x, weight, *args, **kwargs):
        shapes.append(tuple(weight.shape))
        return kernel(x, weight, *args, **kwargs)

    def counted_normed(x, residual, norm_weight, eps, weight, *args, **kwargs):
        assert kwargs.get("unit_offset")
        normed.append(tuple(weight.shape))
        return normed_kernel(x, residual, norm_weight, eps, weight, *args, **kwargs)

    monkeypatch.setattr(gemv_module, "gemv", counted)
    monkeypatch.setattr(gemv_module, "rms_norm_gemv", counted_normed)
    ours = run(path)
    in_proj = 2 * 2 * 32 + 2 * 4 * 32 + 2 * 4      # q, k, v, z, b, a rows
    after_norm = {(in_proj, 128), (2 * 4 * 32 + 2 * 2 * 32, 128), (2 * 128, 128)}  # in_proj, gated qkv, gate_up
    assert after_norm == set(normed)                # the 1-row decode step: one kernel each
    assert {(128, 4 * 32), (128, 128)} <= set(shapes)  # out_proj and o_proj, the MLP's (gated) down
    monkeypatch.setattr(Ops, "few_rows", lambda self, n: False)
    shapes.clear()
    normed.clear()
    general = run(path)
    assert not shapes and not normed
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(ours, general):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 0.05
