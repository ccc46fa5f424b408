"""The sampling features on the GPU path (CUDA graphs, pinned output ring,
one step in flight): n completions, logprobs, prompt logprobs and penalties give what
the CPU executor gives on the tiny fixture model (float32)."""

from __future__ import annotations

import gc

import pytest
import torch

from minivllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROMPTS = ["12+34=", "50+27=", "8+81="]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=2, logprobs=3, prompt_logprobs=2,
                        presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3)


def run(device: str) -> list:
    with LLM("fixtures/tiny-qwen3", device=device, dtype="float32", num_blocks=256, max_num_seqs=8) as llm:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    gc.collect()
    return outs


def close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-3 for k in a)


def test_gpu_matches_cpu_with_every_feature() -> None:
    gpu, cpu = run("cuda"), run("cpu")
    assert [(o.request_id, o.index) for o in gpu] == [(o.request_id, o.index) for o in cpu]
    assert len(gpu) == 2 * len(PROMPTS)
    for g, c in zip(gpu, cpu):
        assert g.token_ids == c.token_ids
        assert len(g.logprobs) == len(g.token_ids)
        assert all(close(a, b) for a, b in zip(g.logprobs, c.logprobs))
        assert g.prompt_logprobs[0] is None and c.prompt_logprobs[0] is None
        assert all(close(a, b) for a, b in zip(g.prompt_logprobs[1:], c.prompt_logprobs[1:]))


def test_structured_outputs_on_the_gpu_match_the_cpu() -> None:
    """A masked step samples after its forward, when the bitmask comes (pinned bitmask ring,
    pinned output ring): the same constrained tokens as the CPU executor, in both scheduling modes."""
    params = [SamplingParams(temperature=0, max_tokens=12, structured_outputs={"regex": "[0-9]{2}=[0-9]{1,3}"}),
              SamplingParams(temperature=0, max_tokens=12, structured_outputs={"choice": ["yes", "no"]}),
              SamplingParams(temperature=0, max_tokens=6)]
    outs = {}
    for device in ("cuda", "cpu"):
        with LLM("fixtures/tiny-qwen3", device=device, dtype="float32", num_blocks=256, max_num_seqs=8) as llm:
            for mode in (False, True):
                llm.engine.set_async_scheduling(mode)
                outs[device, mode] = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        gc.collect()
    assert outs["cuda", False] == outs["cpu", False] == outs["cuda", True]


def test_request_shaping_on_the_gpu_matches_the_cpu() -> None:
    """logit_bias and allowed_token_ids (applied to the device's logits), min_tokens and bad_words
    (token rules in the host's bitmask), random rows seeded: the CPU executor's tokens, in both
    scheduling modes, and every request's own promise kept."""
    params = [SamplingParams(temperature=0.8, seed=1, max_tokens=8, logit_bias={25: 5.0, 2: -100}),
              SamplingParams(temperature=1.0, seed=2, max_tokens=8, ignore_eos=True, allowed_token_ids=[21, 22, 23]),
              SamplingParams(temperature=0, max_tokens=8, min_tokens=6),
              SamplingParams(temperature=0, max_tokens=8, bad_words=["46", "7"])]
    outs = {}
    for device in ("cuda", "cpu"):
        with LLM("fixtures/tiny-qwen3", device=device, dtype="float32", num_blocks=256, max_num_seqs=8) as llm:
            for mode in (False, True):
                llm.engine.set_async_scheduling(mode)
                outs[device, mode] = llm.generate(PROMPTS[:1] * 4, params, use_tqdm=False)
        gc.collect()
    tokens = {k: [o.token_ids for o in v] for k, v in outs.items()}
    assert tokens["cuda", False] == tokens["cpu", False] == tokens["cuda", True] == tokens["cpu", True]
    biased, allowed, held, banned = outs["cuda", True]
    assert 2 not in biased.token_ids and set(allowed.token_ids) <= {21, 22, 23}
    assert len(held.token_ids) >= 6 and "46" not in banned.text and "7" not in banned.text
