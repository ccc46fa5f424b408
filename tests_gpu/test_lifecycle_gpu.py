"""GPU memory comes back: three ``LLM``s built one after another in one process each get
(nearly) the KV pool of the first, after ``close()``, after a ``with`` block and after ``del``.

Each engine sizes its pool from the memory free after its warm-up, so anything an earlier
engine left on the device (graphs and their pools, the KV pool, weights, compiled caches)
shrinks the next one's pool."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.testing import write_random_checkpoint

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("lifecycle"))
    write_random_checkpoint(path, "qwen3-0.6b")
    return path


def blocks_of(llm: LLM) -> int:
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return llm.engine.executor.num_kv_blocks()


@pytest.mark.parametrize("ending", ["close", "with", "del"])
def test_three_engines_in_one_process_each_get_the_first_one_s_pool(checkpoint: str, ending: str) -> None:
    settings = [dict(dtype="float32"), dict(dtype="bfloat16"), dict(dtype="bfloat16", enable_prefix_caching=False)]
    blocks, bytes_per_block = [], []
    for options in settings:
        if ending == "with":
            with LLM(checkpoint, skip_tokenizer_init=True, **options) as llm:
                blocks.append(blocks_of(llm))
                bytes_per_block.append(llm.engine.executor.block_bytes)
        else:
            llm = LLM(checkpoint, skip_tokenizer_init=True, **options)
            blocks.append(blocks_of(llm))
            bytes_per_block.append(llm.engine.executor.block_bytes)
            if ending == "close":
                llm.close()
            del llm
    # float32 blocks are twice as large: compare the pools' bytes.
    pools = [b * s for b, s in zip(blocks, bytes_per_block)]
    assert all(p >= 0.95 * pools[0] for p in pools[1:]) and pools[2] >= 0.95 * pools[1], (ending, blocks, pools)
    assert torch.cuda.memory_allocated() < 1 << 30, torch.cuda.memory_allocated()
