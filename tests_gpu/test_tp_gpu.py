"""Tensor parallelism on two GPUs (the `nvidia-h200-x2` machine): Qwen3-0.6B shapes.

The first TP=2 engine of the process reduces through the one-shot symmetric-memory
kernel, later ones through NCCL (``layers/all_reduce.py``: once per process); the
fault test and the fused all-reduce + RMSNorm test run their engines in subprocesses,
one-shot again.

float32 greedy TP=2 must be token-identical to TP=1 and to HF over 16 prompts with
shared prefixes (CUDA graphs on, prefix caching on, both scheduling modes); bf16 TP=2
against HF by the top-5 rule at the first difference. Skipped (loudly, with the
reason) on a machine with fewer than two GPUs.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.layers import all_reduce
from tests_gpu.test_model_gpu import CONFIGS, NEW, hf_greedy, make_checkpoint, shared_prefix_prompts

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                reason=f"needs 2 GPUs, {torch.cuda.device_count()} visible")
ROOT = Path(__file__).resolve().parent.parent
POOL = dict(num_blocks=2048, max_num_seqs=16, max_model_len=512, skip_tokenizer_init=True)


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


def generate(path: str, prompts: list[list[int]], dtype: str, tp: int, **opts) -> tuple[list, int]:
    first = not all_reduce.used_in_this_process()  # the one-shot path runs once per process
    with LLM(path, dtype=dtype, tensor_parallel_size=tp, **POOL, **opts) as llm:
        outs = [list(o.token_ids) for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW),
                                                        use_tqdm=False)]
        replays = llm.engine.executor.graph_runner.num_replays
        if tp > 1:  # the one-shot symmetric-memory all-reduce unless disabled or set up before
            path_taken = llm.engine.executor.all_reduce_path
            want = "nccl" if opts.get("disable_custom_all_reduce") or not first else "one-shot"
            assert path_taken.startswith(want), path_taken
    gc.collect()
    torch.cuda.empty_cache()
    return outs, replays


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_fp32_tp2_equals_tp1_and_hf(reference, async_scheduling: bool) -> None:
    path, prompts, expected, _ = reference
    one, _ = generate(path, prompts, "float32", 1, async_scheduling=async_scheduling)
    two, replays = generate(path, prompts, "float32", 2, async_scheduling=async_scheduling)
    assert replays > 0, "TP=2 ran no CUDA graph"
    assert one == expected
    assert two == one


def test_fp32_tp2_nccl_only_equals_tp1(reference) -> None:
    """``disable_custom_all_reduce``: every all-reduce through NCCL, same tokens."""
    path, prompts, expected, _ = reference
    two, _ = generate(path, prompts, "float32", 2, disable_custom_all_reduce=True)
    assert two == expected


def test_fp32_tp2_prefill_graphs_equals_hf(reference) -> None:
    """Prefill graphs under TP (the default): prefill and mixed steps replayed from CUDA
    graphs captured on both ranks, collectives inside."""
    path, prompts, expected, _ = reference
    with LLM(path, dtype="float32", tensor_parallel_size=2, **POOL) as llm:
        assert llm.engine.executor.captures_prefill_graphs
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW), use_tqdm=False)
        replays = llm.engine.executor.local.prefill_graph_runner.num_replays
    gc.collect()
    torch.cuda.empty_cache()
    assert replays > 0, "no prefill step replayed a graph"
    assert [list(o.token_ids) for o in outs] == expected


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
    ours, _ = generate(path, prompts, "bfloat16", 2)
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


FAULT_SCRIPT = textwrap.dedent("""
    import os, sys
    from minivllm import LLM, SamplingParams

    def main():
        llm = LLM(sys.argv[1], skip_tokenizer_init=True, num_blocks=256, max_model_len=64,
                  tensor_parallel_size=2)
        print("PATH", llm.engine.executor.all_reduce_path, flush=True)
        try:
            llm.generate([[1, 2, 3, 4]] * 4, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                         use_tqdm=False)
            print("NO ERROR", flush=True)
        except RuntimeError as e:
            print("CAUGHT", " ".join(str(e).split())[:300], flush=True)
        llm.close()
        print("CLOSED", flush=True)
        os._exit(0)  # rank 0's stream may hold a one-shot kernel its dead peer never releases

    if __name__ == "__main__":  # spawned workers import this module
        main()
""")


def test_worker_failing_mid_run_is_an_error_not_a_hang(tmp_path) -> None:
    """Rank 1 raises before its third step: rank 0's third step waits in a one-shot
    all-reduce that no abort releases. The driver must still raise within seconds
    (it polls its step while the watchdog looks at the workers) and close."""
    script = tmp_path / "fault.py"
    script.write_text(FAULT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MINIVLLM_TP_FAULT": "1:step3"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), str(ROOT / "fixtures" / "tiny-qwen3")],
                          capture_output=True, text=True, env=env, timeout=240)
    out = proc.stdout
    assert "PATH one-shot" in out, out + proc.stderr[-3000:]
    assert "CAUGHT" in out and "injected fault at step 3" in out, out + proc.stderr[-3000:]
    assert "CLOSED" in out and proc.returncode == 0, out + proc.stderr[-3000:]
    assert time.monotonic() - t0 < 200


FUSED_SCRIPT = textwrap.dedent("""
    import json, sys
    from minivllm import LLM, SamplingParams

    def main():
        path, prompts_file, new, pool = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
        fused = sys.argv[5] == "fused"
        prompts = json.load(open(prompts_file))
        with LLM(path, dtype="float32", tensor_parallel_size=2, fuse_all_reduce_norm=fused, **pool) as llm:
            print("PATH", llm.engine.executor.all_reduce_path, flush=True)
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new), use_tqdm=False)
            print("REPLAYS", llm.engine.executor.graph_runner.num_replays, flush=True)
        print("TOKENS", json.dumps([list(o.token_ids) for o in outs]), flush=True)

    if __name__ == "__main__":  # spawned workers import this module
        main()
""")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_fp32_tp2_all_reduce_norm_equals_hf(reference, tmp_path, fused: bool) -> None:
    """``fuse_all_reduce_norm`` on (the default): o_proj's and down_proj's sums taken
    inside the residual add + RMSNorm kernel (kernels/all_reduce_rms_norm.py); off:
    torch's one-/two-shot kernels, then the norm. CUDA graphs on; float32 greedy tokens
    identical to HF's. In a subprocess: the symmetric-memory path is set up by the first
    tensor-parallel engine of a process only."""
    import json

    path, prompts, expected, _ = reference
    script, prompts_file = tmp_path / "fused.py", tmp_path / "prompts.json"
    script.write_text(FUSED_SCRIPT)
    prompts_file.write_text(json.dumps(prompts))
    proc = subprocess.run([sys.executable, str(script), path, str(prompts_file), str(NEW), json.dumps(POOL),
                           "fused" if fused else "unfused"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          timeout=240)
    out = proc.stdout
    assert proc.returncode == 0 and "PATH one-shot" in out, out + proc.stderr[-3000:]
    assert ("fused with" in out) == fused, out
    assert "REPLAYS 0" not in out, "TP=2 ran no CUDA graph"
    tokens = json.loads(out.split("TOKENS ", 1)[1])
    assert tokens == expected


PUSH_SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def rank_main(rank, port, iters):
        from minivllm.kernels.gemv import gemv, rms_norm_gemv
        from minivllm.layers import all_reduce
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
        dev, dtype, k, n, n2, eps = torch.device("cuda", rank), torch.bfloat16, 2048, 4096, 3072, 1e-6
        why = all_reduce.install_symm_mem_all_reduce(dev, dtype, fuse_norm=True, push=True)
        assert why is None, why
        path = all_reduce.installed()
        gen = torch.Generator(device=dev).manual_seed(1)  # the same draws on both ranks
        rand = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=gen, device=dev)).to(dtype)
        ws = [rand(n, k, scale=0.02) for _ in range(2)]
        w2, nw = rand(n2, n, scale=0.02), 1 + rand(n, scale=0.1)
        x, residual = rand(1, k), rand(1, n)
        outs = []

        def call(standalone):
            row = path.push_target((1, n), dtype)
            gemv(x, ws[rank], out=row.out, push=row.channel)
            if standalone:
                outs.append(path.add_rms_norm(row.out, residual, nw, eps))
            else:
                outs.append(rms_norm_gemv(row.slots, residual, nw, eps, w2, reduce=row.channel))

        bad = 0
        xs_all = [rand(1, k) for _ in range(2)]  # drawn on both ranks alike; this rank's x is xs_all[rank]
        for it in range(iters):  # eager: the consumer alternates between the GEMV and the norm kernel
            x.copy_(xs_all[rank])
            outs.clear()
            call(standalone=it % 3 == 2)
            torch.cuda.synchronize()
            parts = [gemv(xs_all[r], ws[r]) for r in range(2)]
            total = (parts[0].float() + parts[1].float()).to(dtype)
            want = rms_norm_gemv(total, residual, nw, eps, w2)
            if it % 3 == 2:
                s = (total.float() + residual.float()).to(dtype)
                ok = torch.equal(outs[0][1], s)
            else:
                ok = torch.equal(outs[0][0], want[0]) and torch.equal(outs[0][1], want[1])
            bad += not ok
            xs_all = [rand(1, k) for _ in range(2)]
        outs.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call(False), call(False)
        for it in range(iters):  # replayed: two calls, one per half
            x.copy_(xs_all[rank])
            graph.replay()
            torch.cuda.synchronize()
            parts = [gemv(xs_all[r], ws[r]) for r in range(2)]
            total = (parts[0].float() + parts[1].float()).to(dtype)
            want = rms_norm_gemv(total, residual, nw, eps, w2)
            bad += sum(not (torch.equal(y, want[0]) and torch.equal(s, want[1])) for y, s in outs)
            xs_all = [rand(1, k) for _ in range(2)]
        counts = path.pad[path.pad_at:].tolist()
        print(f"RANK {rank} BAD {bad} COUNTS {counts}", flush=True)
        dist.barrier()
        all_reduce.uninstall()
        dist.destroy_process_group()

    if __name__ == "__main__":
        from minivllm.executor.distributed import free_port
        mp.spawn(rank_main, args=(free_port(), int(sys.argv[1])), nprocs=2)
""")


def test_pushed_all_reduce_between_two_gpus(tmp_path) -> None:
    """The one-row pushed all-reduce (``kernels/_push_all_reduce.py``) over real symmetric
    memory on two GPUs: each rank's GEMV (Qwen3-8B TP=2 ``o_proj``: 2048 -> 4096) pushes
    its partial sum into both inboxes, the normed qkv GEMV (or, every third call, the fused
    norm kernel) on each rank sums them. 300 eager calls, then 300 replays of a CUDA graph
    of two calls: every result equals, bit for bit, the plain GEMVs' rank-order sum through
    ``rms_norm_gemv`` (computed on each rank from both ranks' weights, drawn alike), and the
    counters end at N per call and half."""
    script = tmp_path / "push.py"
    script.write_text(PUSH_SCRIPT)
    iters = 300
    # Its own session: a rank stuck in a wait (a broken protocol) is killed with the rest.
    proc = subprocess.Popen([sys.executable, str(script), str(iters)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail("the ranks did not finish in 300 s (a wait that never ended?):\n" + out + err[-3000:])
    assert proc.returncode == 0, out + err[-3000:]
    calls_per_half = iters // 2 + iters  # eager calls alternate halves; each replay makes one call per half
    for rank in (0, 1):
        assert f"RANK {rank} BAD 0 COUNTS {[4096 * calls_per_half] * 4}" in out, out


BATCH1_SCRIPT = textwrap.dedent("""
    import json, sys
    from minivllm import LLM, SamplingParams
    from minivllm.layers import all_reduce

    def main():
        path, prompts, new, pool, push = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5] == "on"
        with LLM(path, dtype="bfloat16", tensor_parallel_size=2, push_all_reduce=push, **pool) as llm:
            print("PATH", llm.engine.executor.all_reduce_path, flush=True)
            params = SamplingParams(temperature=0, max_tokens=new)
            tokens = [list(llm.generate([p], params, use_tqdm=False)[0].token_ids) for p in prompts]  # batch 1
            print("REPLAYS", llm.engine.executor.graph_runner.num_replays, flush=True)
            fast = all_reduce.installed()
            print("PUSHED", sum(fast.pad[fast.pad_at:fast.pad_at + 2].tolist()), flush=True)
            print("WARM", all_reduce.warm_l2_bytes(), flush=True)
        print("TOKENS", json.dumps(tokens), flush=True)

    if __name__ == "__main__":  # spawned workers import this module
        main()
""")


@pytest.mark.parametrize("push", ["on", "off", "warm"])
def test_bf16_tp2_batch1_with_and_without_the_push_stays_in_hf_top5(reference, tmp_path, push: str) -> None:
    """bf16 TP=2, prompts one at a time (batch-1 decode steps, CUDA graphs): with
    ``push_all_reduce`` the row-parallel GEMVs push their sums and the next
    GEMV or norm collects them (rank 0's arrived counters move); off, the fused all-reduce +
    norm kernel takes them (the counters stay 0); "warm": off, with the fused kernel warming
    L2 for the next GEMV (``MINIVLLM_AR_WARM_MB=16``) and the GEMVs launched early
    (``MINIVLLM_PDL=1``). Each token stream stays in HF bf16's top-5 at its first difference."""
    import json

    path, prompts, _, hf16 = reference
    prompts = prompts[:4]
    script = tmp_path / "batch1.py"
    script.write_text(BATCH1_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if push == "warm":
        env.update(MINIVLLM_AR_WARM_MB="16", MINIVLLM_PDL="1")
    proc = subprocess.run([sys.executable, str(script), path, json.dumps(prompts), str(NEW), json.dumps(POOL), push],
                          capture_output=True, text=True, env=env, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0 and "PATH one-shot" in out, out + proc.stderr[-3000:]
    assert f"WARM {16_000_000 if push == 'warm' else 0}" in out, out
    assert ("pushed by the GEMV" in out) == (push == "on"), out
    assert "REPLAYS 0" not in out, "TP=2 ran no CUDA graph"
    pushed = int(out.split("PUSHED ", 1)[1].split()[0])
    assert (pushed > 0) == (push == "on"), out
    ours = json.loads(out.split("TOKENS ", 1)[1])
    assert_in_hf_top5(hf16, prompts, ours, f"TP=2 bf16 batch 1 (push {push})")
