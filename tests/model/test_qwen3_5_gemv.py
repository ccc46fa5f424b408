"""Qwen3.5 at few rows takes the GEMV kernel for its projections (``Ops.project``): bf16 on the
CPU, the Triton kernels under the interpreter, a decode against the same model with every
projection on the general path: the same greedy tokens and log-probabilities to bf16 rounding,
and the GEMV kernel ran for the DeltaNet's, the attention's and the MLP's projections.

Planted and seen to fail: ``Ops.project`` passing the MLP's [gate | up] to the GEMV without
``gated``, and ``Ops.project`` never taking the GEMV."""

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
    kernel = gemv_module.gemv

    def counted(x, weight, *args, **kwargs):
        shapes.append(tuple(weight.shape))
        return kernel(x, weight, *args, **kwargs)

    monkeypatch.setattr(gemv_module, "gemv", counted)
    ours = run(path)
    in_proj = 2 * 2 * 32 + 2 * 4 * 32 + 2 * 4      # q, k, v, z, b, a rows
    assert {(in_proj, 128), (128, 4 * 32),                  # the DeltaNet's in_proj and out_proj
            (2 * 4 * 32 + 2 * 2 * 32, 128), (128, 4 * 32),  # the attention's gated q, k, v and o_proj
            (2 * 128, 128), (128, 128)} <= set(shapes)      # the MLP's gate_up and (gated) down
    monkeypatch.setattr(Ops, "few_rows", lambda self, n: False)
    shapes.clear()
    general = run(path)
    assert not shapes
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(ours, general):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 0.05
