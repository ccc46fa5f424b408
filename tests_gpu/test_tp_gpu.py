"""Tensor parallelism on two GPUs of one host: Qwen3-0.6B shapes.

The first TP=2 engine of a process reduces over symmetric memory (torch's one-/two-shot
kernels, and the all-reduce fused with the residual add + RMSNorm after every row-parallel
layer), later ones through NCCL (``executor/distributed.py``: once per process). The tests
that need the symmetric path whatever ran before (both all-reduce paths against HF, bf16
at batch 1, the fault) run their engines in subprocesses.

float32 greedy TP=2 must be token-identical to TP=1 and to HF over 16 prompts with
shared prefixes (CUDA graphs of decode and prefill steps, prefix caching, both scheduling
modes); bf16 TP=2 against HF by the top-5 rule at the first difference. Skipped (loudly,
with the reason) on a machine with fewer than two GPUs.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.executor import distributed
from tests_gpu.test_model_gpu import CONFIGS, NEW, hf_greedy, make_checkpoint, shared_prefix_prompts

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                reason=f"needs 2 GPUs, {torch.cuda.device_count()} visible")
ROOT = Path(__file__).resolve().parent.parent
POOL = dict(num_blocks=2048, max_num_seqs=16, max_model_len=512, skip_tokenizer_init=True)
LAYERS = CONFIGS["qwen3-0.6b"]["num_hidden_layers"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    hf, path = make_checkpoint("qwen3-0.6b", str(tmp_path_factory.mktemp("tp")))
    prompts = shared_prefix_prompts(CONFIGS["qwen3-0.6b"]["vocab_size"])
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    hf16 = hf.to(torch.bfloat16)
    yield path, prompts, expected, hf16
    del hf, hf16
    gc.collect()
    torch.cuda.empty_cache()


def fused_calls(executor: Any) -> int | None:
    """Rank 0's calls of the fused all-reduce + residual add + RMSNorm kernel so far (program
    0's epoch counter in its signal pad: every call runs program 0), or None without
    symmetric memory. Read before the engine closes."""
    from minivllm.kernels.all_reduce_rms_norm import MAX_PROGRAMS

    comm = executor.local.ops.comm
    if comm is None or comm.symm is None:
        return None
    return int(comm.symm.pad[MAX_PROGRAMS * comm.world_size].item())


def generate(path: str, prompts: list[list[int]], dtype: str, tp: int, **opts) -> tuple[list, int, int]:
    """Greedy tokens, decode-graph replays and prefill-graph replays of one engine; at TP=2
    the all-reduce path it took is the one expected (symmetric memory, its fused kernel
    run, unless disabled or set up earlier in this process)."""
    first = not distributed._symm_mem_used  # symmetric memory is set up once per process
    with LLM(path, dtype=dtype, tensor_parallel_size=tp, **POOL, **opts) as llm:
        outs = [list(o.token_ids) for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW),
                                                        use_tqdm=False)]
        executor = llm.engine.executor
        replays = executor.graph_runner.num_replays
        prefill_replays = executor.prefill_graph_runner.num_replays if tp == 1 \
            else executor.local.prefill_graph_runner.num_replays
        if tp > 1:
            path_taken = executor.all_reduce_path
            symm = first and not opts.get("disable_custom_all_reduce")
            assert path_taken.startswith("one-shot" if symm else "nccl"), path_taken
            fused = fused_calls(executor)
            assert (fused is not None and fused > 0) if symm else fused is None, (path_taken, fused)
    gc.collect()
    torch.cuda.empty_cache()
    return outs, replays, prefill_replays


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_fp32_tp2_equals_tp1_and_hf(reference, async_scheduling: bool) -> None:
    """Both ranks capture and replay CUDA graphs of decode and of prefill / mixed steps
    (collectives inside); the tokens equal TP=1's and HF's."""
    path, prompts, expected, _ = reference
    one, _, _ = generate(path, prompts, "float32", 1, async_scheduling=async_scheduling)
    two, replays, prefill_replays = generate(path, prompts, "float32", 2, async_scheduling=async_scheduling)
    assert replays > 0, "TP=2 ran no decode CUDA graph"
    assert prefill_replays > 0, "TP=2 replayed no prefill graph"
    assert one == expected
    assert two == one


def test_fp32_tp2_temperature_sampling_from_vocab_shards_equals_tp1(reference) -> None:
    """Temperature rows, seeded and not, sample from the vocab shards under TP (an (S, 2)
    all-gather instead of the logits; ``Sampler.forward_vocab_parallel``): TP=1's tokens."""
    path, prompts, _, _ = reference
    params = [SamplingParams(temperature=0.8, seed=i if i % 2 else None, max_tokens=NEW) for i in range(len(prompts))]
    outs = []
    for tp in (1, 2):
        with LLM(path, dtype="float32", tensor_parallel_size=tp, **POOL) as llm:
            outs.append([list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)])
        gc.collect()
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]


def test_bf16_tp2_top5_against_hf(reference) -> None:
    path, prompts, _, hf16 = reference
    ours, _, _ = generate(path, prompts, "bfloat16", 2)
    assert_in_hf_top5(hf16, prompts, ours, "TP=2 bf16")


def assert_in_hf_top5(hf16, prompts: list[list[int]], ours: list[list[int]], what: str) -> None:
    """Each of our greedy streams, at its first difference from HF bf16's, picks a token in
    HF's top-5 there."""
    theirs = [hf_greedy(hf16, p, NEW) for p in prompts]
    for prompt, a, b in zip(prompts, ours, theirs):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None:
            continue
        with torch.no_grad():
            ctx = torch.tensor([prompt + b[:k]], device="cuda")
            top5 = hf16(ctx).logits[0, -1].float().topk(5).indices.tolist()
        assert a[k] in top5, f"{what} token {a[k]} at {k} not in HF's top-5 {top5}"


# One TP=2 engine in a fresh process (so symmetric memory is set up unless disabled);
# prints one JSON line: the all-reduce path, graph replays, fused-kernel calls, tokens.
RUN_SCRIPT = textwrap.dedent("""
    import json, sys
    from minivllm import LLM, SamplingParams

    def main():
        from tests_gpu.test_tp_gpu import fused_calls

        args = json.load(open(sys.argv[1]))
        params = SamplingParams(temperature=0, max_tokens=args["new"])
        with LLM(args["path"], dtype=args["dtype"], tensor_parallel_size=2,
                 disable_custom_all_reduce=args["disable_custom_all_reduce"], **args["pool"]) as llm:
            if args["batch1"]:
                tokens = [list(llm.generate([p], params, use_tqdm=False)[0].token_ids) for p in args["prompts"]]
            else:
                tokens = [list(o.token_ids) for o in llm.generate(args["prompts"], params, use_tqdm=False)]
            ex = llm.engine.executor
            result = dict(path=ex.all_reduce_path, replays=ex.graph_runner.num_replays,
                          prefill_replays=ex.local.prefill_graph_runner.num_replays,
                          fused=fused_calls(ex), tokens=tokens)
        print("RESULT", json.dumps(result), flush=True)

    if __name__ == "__main__":  # spawned workers import this module
        main()
""")


def run_tp2(tmp_path: Path, path: str, prompts: list[list[int]], dtype: str, *, batch1: bool = False,
            disable_custom_all_reduce: bool = False) -> dict:
    """``RUN_SCRIPT``'s result for one engine in a subprocess."""
    script, args = tmp_path / "run_tp2.py", tmp_path / "args.json"
    script.write_text(RUN_SCRIPT)
    args.write_text(json.dumps(dict(path=path, prompts=prompts, new=NEW, pool=POOL, dtype=dtype, batch1=batch1,
                                    disable_custom_all_reduce=disable_custom_all_reduce)))
    proc = subprocess.run([sys.executable, str(script), str(args)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 0 and "RESULT " in proc.stdout, proc.stdout + proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


@pytest.mark.parametrize("disable_custom_all_reduce", [False, True], ids=["symm-mem", "nccl"])
def test_fp32_tp2_all_reduce_paths_equal_hf(reference, tmp_path, disable_custom_all_reduce: bool) -> None:
    """Symmetric memory (the default): o_proj's and down_proj's sums taken inside the residual
    add + RMSNorm kernel (``kernels/all_reduce_rms_norm.py``; rank 0's call counter moves);
    ``disable_custom_all_reduce``: every all-reduce through NCCL, then the norm. CUDA graphs
    on; float32 greedy tokens identical to HF's either way."""
    path, prompts, expected, _ = reference
    r = run_tp2(tmp_path, path, prompts, "float32", disable_custom_all_reduce=disable_custom_all_reduce)
    if disable_custom_all_reduce:
        assert r["path"].startswith("nccl") and r["fused"] is None, r["path"]
    else:
        assert r["path"].startswith("one-shot") and r["fused"] > 0, (r["path"], r["fused"])
    assert r["replays"] > 0 and r["prefill_replays"] > 0, "TP=2 ran no CUDA graph"
    assert r["tokens"] == expected


def test_bf16_tp2_batch1_fused_all_reduce_stays_in_hf_top5(reference, tmp_path) -> None:
    """bf16 TP=2, prompts one at a time (batch-1 steps, CUDA graphs): every forward sums all
    2 x layers row-parallel outputs in the fused all-reduce + RMSNorm kernel, and each token
    stream stays in HF bf16's top-5 at its first difference."""
    path, prompts, _, hf16 = reference
    prompts = prompts[:4]
    r = run_tp2(tmp_path, path, prompts, "bfloat16", batch1=True)
    assert r["path"].startswith("one-shot"), r["path"]
    assert r["replays"] > 0, "TP=2 ran no CUDA graph"
    # At least NEW forwards per prompt (its prefill and NEW - 1 decode steps), 2 calls a layer each.
    assert r["fused"] >= 2 * LAYERS * NEW * len(prompts), r["fused"]
    assert_in_hf_top5(hf16, prompts, r["tokens"], "TP=2 bf16 batch 1")


FAULT_SCRIPT = textwrap.dedent("""
    import os, sys

    def main():
        from minivllm import SamplingParams
        from minivllm.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig
        from minivllm.engine.llm_engine import LLMEngine
        from minivllm.executor.distributed import TPExecutor
        from minivllm.llm import CUDA_BLOCK_SIZE, CUDA_MAX_NUM_BATCHED_TOKENS

        path = sys.argv[1]
        model = ModelConfig.from_hf_json(path)
        # LLM's CUDA settings, with the executor's fault hook: rank 1 raises before its third step.
        sched = SchedulerConfig(max_model_len=64, max_num_batched_tokens=CUDA_MAX_NUM_BATCHED_TOKENS,
                                async_scheduling=True)
        cache = CacheConfig(block_size=CUDA_BLOCK_SIZE, num_blocks=256)
        executor = TPExecutor(model, path, sched, cache, ExecutorConfig(device="cuda", tensor_parallel_size=2),
                              fault=(1, "step3"))
        print("PATH", executor.all_reduce_path, flush=True)
        engine = LLMEngine(sched, cache, executor, eos_token_id=model.eos_token_id, vocab_size=model.vocab_size)
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        try:
            for i in range(4):
                engine.add_request(f"r{i}", [1, 2, 3, 4], params)
            while engine.has_unfinished_requests():
                engine.step()
            print("NO ERROR", flush=True)
        except RuntimeError as e:
            print("CAUGHT", " ".join(str(e).split())[:300], flush=True)
        executor.close()
        print("CLOSED", flush=True)
        os._exit(0)  # rank 0's stream may hold a symmetric-memory kernel its dead peer never releases

    if __name__ == "__main__":  # spawned workers import this module
        main()
""")


def test_worker_failing_mid_run_is_an_error_not_a_hang(tmp_path) -> None:
    """Rank 1 raises before its third step (``TPExecutor(..., fault=(1, "step3"))``): rank 0's
    third step waits in a symmetric-memory all-reduce that no abort releases. The driver must
    still raise within seconds (it polls its step while the watchdog looks at the workers)
    and close."""
    script = tmp_path / "fault.py"
    script.write_text(FAULT_SCRIPT)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), str(ROOT / "fixtures" / "tiny-qwen3")],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          timeout=240)
    out = proc.stdout
    assert "PATH one-shot" in out, out + proc.stderr[-3000:]
    assert "CAUGHT" in out and "injected fault at step 3" in out, out + proc.stderr[-3000:]
    assert "CLOSED" in out and proc.returncode == 0, out + proc.stderr[-3000:]
    assert time.monotonic() - t0 < 200
