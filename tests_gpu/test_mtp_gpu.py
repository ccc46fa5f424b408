"""Qwen3.5's MTP head as the proposer on the GPU (Triton kernels, float32, decode steps and
drafted ones in CUDA graphs): every draft the executor makes equals the reference head's
(transformers' layer classes on the CPU) from the same context, through prefix hits that resume
from snapshots and a pool that preempts, and the tokens are transformers'."""

from __future__ import annotations

import pytest
import torch

from minivllm import SamplingParams
from minivllm.testing import hf_generate
from tests.spec.test_mtp import make_llm, record_drafts, save_with_head, shared_prefix_prompts

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")]
NEW = 10


@pytest.mark.parametrize("name", ["dense-lin-first", "moe-shared-full-first"])
def test_mtp_drafts_on_the_gpu_are_the_reference_heads(name: str, tmp_path) -> None:
    hf, head = save_with_head(name, tmp_path, seed=3)
    prompts = shared_prefix_prompts(hf.config.vocab_size, seed=9)
    want = [hf_generate(hf, p, NEW) for p in prompts]
    llm = make_llm(str(tmp_path), device="cuda", kernels="triton", max_num_batched_tokens=9, num_blocks=14,
                   state_snapshot_interval=2)
    seen = record_drafts(llm, {tuple(p): w for p, w in zip(prompts, want)})
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for async_scheduling in (False, True):
        llm.engine.set_async_scheduling(async_scheduling)
        assert [list(o.token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    assert llm.engine.stats.num_preemptions > 0 and llm.engine.stats.num_cached_tokens > 0
    assert llm.engine.executor.prefill_graph_runner.num_replays > 0
    assert len(seen) >= 12 and llm.engine.stats.num_accepted_tokens > 0
    for context, drafts in seen:
        assert drafts == head.drafts(context, len(drafts)), f"drafts after {len(context)} tokens"
