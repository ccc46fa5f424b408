"""The prefill graph runner's padding, on the CPU interpreter (``capture=False``: the padded
static buffers run eagerly, what a CUDA graph of the bucket would replay): a prefill or
mixed step through it gives the plain executor's logits and K/V cache, tokens padded to
the bucket write nothing, and what it does not cover runs eagerly as before."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from minivllm.executor.prefill_graph import PrefillGraphRunner, default_prefill_buckets  # noqa: E402
from minivllm.testing import (  # noqa: E402
    TinyConfig, make_hf_model, make_model_executor, make_plan, save_hf_model,
)

BS = 4


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return save_hf_model(make_hf_model(TinyConfig()), tmp_path_factory.mktemp("prefill-graph"))


def executors(path: str, dtype: str = "float32", **cache) -> tuple:
    """A plain executor and one with a runner of buckets 4, 16 and 32 (both Triton; up to 8
    sequences a step, so bucket 4's graph holds 5 sequence slots, the others 9)."""
    plain, padded = (make_model_executor(path, device="cpu", dtype=dtype, kernels="triton", block_size=BS,
                                         num_blocks=24, max_num_seqs=8, max_num_batched_tokens=64, **cache)
                     for _ in range(2))
    padded.prefill_graph_runner = padded.make_prefill_graph_runner(capture=False, buckets=[4, 16, 32])
    return plain, padded


def test_padded_buckets_equal_the_eager_step(path: str) -> None:
    plain, padded = executors(path)
    runner = padded.prefill_graph_runner
    a, b, c = [3, 14, 15, 92, 65, 35, 8], [9, 79, 32, 38, 46], [26, 43, 38, 32, 79, 50, 28, 84, 19, 71, 69]
    plans = [
        make_plan([(a, 0, (9, 2), True), (b, 0, (5, 11), True)], BS),                   # 12 tokens -> 16
        make_plan([([1], 7, (9, 2), True), ([2], 5, (5, 11), True)], BS),               # decode: decode path
        make_plan([(c[:6], 0, (3, 12), False), ([7], 8, (9, 2, 14), True)], BS),        # mixed: chunk + decode
        make_plan([(c[6:], 6, (3, 12, 7), True), (a[:3], 0, (1,), True)], BS),          # a prefix read -> 16
        make_plan([(c + a + b + c, 0, tuple(range(10)), True)], BS),                    # 34 tokens: eager
        make_plan([(b[:2], 0, (15,), True), ([5], 9, (9, 2, 14), True)], BS),          # 3 tokens -> 4
    ]
    replays = []
    for plan in plans:
        want, got = (ex.compute_logits(plan).float() for ex in (plain, padded))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(padded.kv_cache, plain.kv_cache, atol=1e-5, rtol=1e-5)
        replays.append(runner.num_replays)
    assert replays == [1, 1, 2, 3, 3, 4]  # the decode step and the 34-token step ran without it
    assert runner.replays_by_bucket[4] == 1 and runner._meta(4).cu_seqlens_q.shape == (6,)


def test_padded_buckets_with_an_fp8_cache_keep_the_model_dtype(path: str) -> None:
    """The runner's static activations are the model's dtype, not the e4m3 cache's: a bf16
    model with an FP8 cache gives the plain executor's logits through a bucket."""
    plain, padded = executors(path, "bfloat16", kv_cache_dtype="fp8")
    assert padded.kv_cache.dtype == torch.float8_e4m3fn and padded.prefill_graph_runner.hidden.dtype == torch.bfloat16
    plan = make_plan([([3, 14, 15, 92, 65, 35, 8], 0, (9, 2), True), ([9, 79, 32, 38, 46], 0, (5, 11), True)], BS)
    want, got = (ex.compute_logits(plan).float() for ex in (plain, padded))
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    assert padded.prefill_graph_runner.num_replays == 1


def test_buckets_and_tile_maps() -> None:
    assert default_prefill_buckets(8192) == [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert default_prefill_buckets(100) == [64, 100]
    assert default_prefill_buckets(8192, hybrid=True)[:6] == [2, 4, 8, 16, 64, 128]
    assert default_prefill_buckets(12, hybrid=True) == [2, 4, 8, 12]
    runner = PrefillGraphRunner(lambda *a: None, torch.zeros(1, 2, 4, BS, 2, 16), torch.zeros(4, dtype=torch.int64),
                                32, torch.float32, 4, 2, 16, max_num_seqs=4, max_blocks_per_seq=8, buckets=[16, 64],
                                capture=False)
    assert runner.bucket_for(16, 2, 3, False) == 16 and runner.bucket_for(17, 2, 3, False) == 64
    assert runner.bucket_for(65, 2, 3, False) is None and runner.bucket_for(2, 2, 3, True) is None
    assert runner.bucket_for(8, 5, 3, False) is None and runner.bucket_for(8, 2, 9, False) is None
    # fp32 at head_dim 16 tiles 16 rows = 8 tokens (GQA 2); 12 tokens in 2 sequences + 4 padding
    tile_map = runner.tile_map_for(np.array([0, 7, 12]), 16)
    assert tile_map.shape == (runner.capacity[16], 2)
    assert sorted(map(tuple, tile_map[tile_map[:, 0] >= 0].tolist())) == [(0, 0), (1, 0), (2, 0)]


def test_engine_with_the_runner_generates_what_it_generates_without(path: str) -> None:
    """Through LLM (Triton backend, interpreter, one step in flight): shared-prefix prompts, a
    small pool that preempts and a budget that chunks, so the runner sees prefill, chunked
    and mixed steps whose decode tokens come by reference from the step in flight; greedy
    tokens equal."""
    from minivllm import LLM, SamplingParams

    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 64, 13).tolist()
    prompts = [prefix + rng.integers(0, 64, int(k)).tolist() for k in rng.integers(1, 9, 5)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs, replays = [], 0
    for with_runner in (False, True):
        llm = LLM(path, device="cpu", kernels="triton", skip_tokenizer_init=True, block_size=BS,
                  num_blocks=20, max_num_seqs=4, max_num_batched_tokens=32, async_scheduling=True)
        ex = llm.engine.executor
        if with_runner:
            ex.prefill_graph_runner = ex.make_prefill_graph_runner(capture=False, buckets=[16, 32])
        outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if with_runner:
            replays = ex.prefill_graph_runner.num_replays
            assert llm.engine.stats.num_preemptions > 0 or llm.engine.stats.num_chunked_prefills > 0
    assert outs[0] == outs[1]
    assert replays > 0
