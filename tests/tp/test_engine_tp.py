"""Tensor parallelism end to end on the CPU: 2 processes over gloo.

TP=2 must give TP=1's greedy tokens (prefix caching and preemption on, one step
in flight and not) and its logits; a worker that fails at load or mid-run must
surface as a clear error in the driver; and no worker process may outlive its
``LLM``: after ``close``, a ``with`` block, interpreter exit or Ctrl-C.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.llm_engine import LLMEngine
from minivllm.testing import TinyConfig, make_hf_model, save_hf_model

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = str(ROOT / "fixtures" / "tiny-qwen3")
# Heads and intermediate divide by 2; the odd vocabulary pads rank 1's shard.
CFG = TinyConfig(vocab_size=113, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
# A pool of 20 blocks of 4 for 8 sequences of up to ~45 tokens: preemption is forced.
ENGINE = dict(device="cpu", kernels="torch", skip_tokenizer_init=True, block_size=4,
              max_model_len=96, num_blocks=20, max_num_seqs=8, max_num_batched_tokens=32,
              enable_prefix_caching=True)


# Another family: Qwen2's q/k/v biases, sharded by heads; its one KV head (and that head's
# bias) replicated on both ranks.
QWEN2_CFG = TinyConfig(family="qwen2", vocab_size=113, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                       num_key_value_heads=1, head_dim=8, max_position_embeddings=128)


@pytest.fixture(scope="module")
def random_model(tmp_path_factory) -> str:
    return save_hf_model(make_hf_model(CFG, seed=5), tmp_path_factory.mktemp("tp"))


def prompts(vocab: int, n: int = 8, seed: int = 0) -> list[list[int]]:
    """Two shared prefixes (prefix-cache hits) with short random tails."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab, 9).tolist(), rng.integers(0, vocab, 14).tolist()]
    return [prefixes[i % 2] + rng.integers(0, vocab, int(rng.integers(1, 8))).tolist() for i in range(n)]


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in state


def wait_for_exits(pids: list[int], timeout_s: float) -> None:
    """Wait until every process in ``pids`` has ended or ``timeout_s`` passes: each one's
    pidfd becomes readable when it terminates (an event, also for a process that is not
    our child)."""
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:  # already gone
            pass
    deadline = time.monotonic() + timeout_s
    try:
        pending = list(fds)
        while pending and (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(pending, [], [], left)
            pending = [fd for fd in pending if fd not in ready]
    finally:
        for fd in fds:
            os.close(fd)


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.engine.executor.workers]


LOGPROBS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=20, prompt_logprobs=20)


def logprobs_of(llm: LLM, ps: list[list[int]]) -> list[list[dict[int, float]]]:
    """Each prompt's prompt logprobs and sampled tokens' logprobs (top 20 of the whole rows)."""
    outs = llm.generate(ps, LOGPROBS, use_tqdm=False)
    return [[{k: v for k, v in pos.items()} for pos in (o.prompt_logprobs or [])[1:] + o.logprobs] for o in outs]


def assert_logprobs_close(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        for gp, wp in zip(g, w, strict=True):
            assert gp.keys() == wp.keys()
            np.testing.assert_allclose([gp[k] for k in wp], [wp[k] for k in wp], rtol=1e-5, atol=1e-5)


def test_tp2_greedy_and_logprobs_equal_tp1(random_model: str) -> None:
    """Greedy tokens with preemption and prefix hits, both scheduling modes, and the top-20
    logprobs of prompts and samples (whole rows, gathered over ranks) equal TP=1's."""
    ps = prompts(CFG.vocab_size)
    with LLM(random_model, **ENGINE) as one:
        want = [o.token_ids for o in one.generate(ps, GREEDY, use_tqdm=False)]
        logprobs_one = logprobs_of(one, ps[:2])
    with LLM(random_model, **ENGINE, tensor_parallel_size=2) as two:
        pids = worker_pids(two)
        for async_scheduling in (False, True):
            two.engine.set_async_scheduling(async_scheduling)
            before = two.engine.stats.num_preemptions
            got = [o.token_ids for o in two.generate(ps, GREEDY, use_tqdm=False)]
            assert got == want, f"async_scheduling={async_scheduling}"
            assert two.engine.stats.num_preemptions > before
        assert two.engine.stats.num_cached_tokens > 0
        logprobs_two = logprobs_of(two, ps[:2])
    assert_logprobs_close(logprobs_two, logprobs_one)
    assert not any(alive(p) for p in pids)


def test_tp2_qwen2_with_qkv_bias_equals_tp1(tmp_path: Path) -> None:
    path = save_hf_model(make_hf_model(QWEN2_CFG, seed=6), tmp_path)
    ps = prompts(QWEN2_CFG.vocab_size, n=4, seed=2)
    outs, logprobs = [], []
    for tp in (1, 2):
        with LLM(path, **ENGINE, tensor_parallel_size=tp) as llm:
            outs.append([o.token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)])
            logprobs.append(logprobs_of(llm, ps[:1]))
    assert outs[0] == outs[1]
    assert_logprobs_close(logprobs[1], logprobs[0])


def test_tp2_fixture_model_and_random_sampling(random_model: str) -> None:
    """The trained fixture, greedy; and seeded random sampling equal across TP sizes."""
    ps = prompts(100, n=4, seed=1)
    seeded = SamplingParams(temperature=1.0, top_k=20, max_tokens=12, seed=3, ignore_eos=True)
    outs = []
    for tp in (1, 2):
        with LLM(FIXTURE, **{**ENGINE, "num_blocks": 64, "max_model_len": 64}, tensor_parallel_size=tp) as llm:
            greedy = [o.token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
            sampled = [o.token_ids for o in llm.generate(ps, seeded, use_tqdm=False)]
            outs.append((greedy, sampled))
    assert outs[0] == outs[1]


def test_tp2_samples_from_vocab_shards_as_tp1_samples_whole_rows(random_model: str) -> None:
    """Greedy, seeded and unseeded temperature rows in one batch take the shard path (no
    gather of the logits; the odd vocabulary pads rank 1's shard) and give TP=1's tokens;
    a top-k request gathers the rows as before."""
    ps = prompts(CFG.vocab_size, n=6, seed=4)
    params = [SamplingParams(temperature=t, seed=s, max_tokens=10, ignore_eos=True)
              for t, s in ((0.0, None), (0.8, 7), (1.0, None), (1.3, 11), (0.0, None), (1.0, None))]
    top_k = SamplingParams(temperature=1.0, top_k=5, seed=2, max_tokens=10, ignore_eos=True)
    outs, shard_calls = [], []
    for tp in (1, 2):
        with LLM(random_model, **ENGINE, tensor_parallel_size=tp) as llm:
            if tp == 2:
                sampler = llm.engine.executor.local.sampler
                real = sampler.forward_vocab_parallel
                sampler.forward_vocab_parallel = lambda *a, **k: (shard_calls.append(1), real(*a, **k))[1]
            outs.append(([o.token_ids for o in llm.generate(ps, params, use_tqdm=False)],
                         [o.token_ids for o in llm.generate(ps[:2], top_k, use_tqdm=False)]))
            if tp == 2:
                calls_before_top_k = len(shard_calls)
    assert outs[0] == outs[1]
    assert calls_before_top_k > 0 and len(shard_calls) == calls_before_top_k


def tp_engine(path: str, fault: tuple[int, str]) -> LLMEngine:
    """ENGINE's settings at TP=2 as ``LLM`` builds them, with the executor's fault hook."""
    from minivllm.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig
    from minivllm.executor.distributed import TPExecutor

    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96)
    cache = CacheConfig(block_size=4, num_blocks=20)
    executor = TPExecutor(ModelConfig.from_hf_json(path), path, sched, cache,
                          ExecutorConfig(device="cpu", kernels="torch", tensor_parallel_size=2), fault=fault)
    return LLMEngine(sched, cache, executor)


@pytest.mark.parametrize("stage", ["load", "step3"])
def test_worker_failure_is_a_clear_error(random_model: str, stage: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 failed(.|\n)*injected fault") as info:
        engine = tp_engine(random_model, (1, stage))
        try:
            for i, p in enumerate(prompts(CFG.vocab_size)):
                engine.add_request(f"r{i}", p, GREEDY)
            while engine.has_unfinished_requests():
                engine.step()
        finally:
            pids = [p.pid for p in engine.executor.workers]
            engine.executor.close()
            assert not any(alive(p) for p in pids)
    assert time.monotonic() - t0 < 60, "the failure took too long to surface"
    assert {"load": "at load", "step3": "at step 3"}[stage] in str(info.value)


def test_killed_worker_is_named_in_the_error(random_model: str) -> None:
    """A worker killed mid-run (SIGKILL: no traceback of its own) is a RuntimeError naming
    it and its exit code, within seconds, and nothing is left running."""
    llm = LLM(random_model, **ENGINE, tensor_parallel_size=2)
    try:
        pids = worker_pids(llm)
        llm.generate(prompts(CFG.vocab_size, n=2), GREEDY, use_tqdm=False)
        os.kill(pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"worker minivllm-tp-rank1 exited \(code -9\)"):
            llm.generate(prompts(CFG.vocab_size, n=2), GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 30
    finally:
        llm.close()
    assert not any(alive(p) for p in pids)


SCRIPT = textwrap.dedent("""
    import signal, sys, time
    from minivllm import LLM, SamplingParams

    def main():
        # Ctrl-C as in a terminal. Started from a background job (``make test &``, some CI
        # runners) this process inherits SIGINT ignored, which Python keeps: the interrupt
        # would never arrive (seen: the test hung on such a run).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        llm = LLM(sys.argv[1], device="cpu", kernels="torch", skip_tokenizer_init=True,
                  block_size=4, max_model_len=96, num_blocks=40, tensor_parallel_size=2)
        print("PIDS", *[p.pid for p in llm.engine.executor.workers], flush=True)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
        print("READY", flush=True)
        if sys.argv[2] == "loop":
            while True:
                print("LOOP", flush=True)
                llm.generate([[1, 2, 3]] * 4, params, use_tqdm=False)

    if __name__ == "__main__":
        main()
""")


@pytest.mark.parametrize("ending", ["exit", "ctrl-c"])
def test_no_worker_outlives_the_driver(random_model: str, tmp_path: Path, ending: str) -> None:
    """Leaving without ``close`` (interpreter exit) and Ctrl-C in the middle of generating."""
    script = tmp_path / "driver.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(script), random_model, "loop" if ending == "ctrl-c" else "exit"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()[1:]]
        assert pids, proc.stderr.read()
        assert proc.stdout.readline().strip() == "READY"
        if ending == "ctrl-c":
            assert proc.stdout.readline().strip() == "LOOP"  # a generate call is under way
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_for_exits(pids, 10)  # the driver has exited; its workers are being ended
    assert not any(alive(p) for p in pids), f"worker(s) left behind after {ending}"


def test_close_leaves_a_stuck_gpu_stream_alone(random_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """(The decision only; the stuck stream itself exists on GPUs.) After a worker died
    with the symmetric-memory path installed, a step already queued on rank 0's stream
    may wait for good in an all-reduce; ``close`` must then not synchronise or abort the
    group (either hangs: seen on two H200s), only end the workers, and warn that the
    process must restart."""
    from minivllm.executor import distributed

    llm = LLM(random_model, **ENGINE, tensor_parallel_size=2)
    ex = llm.engine.executor
    pids = worker_pids(llm)
    left: list[bool] = []
    real_leave = distributed._leave_group
    monkeypatch.setattr(distributed, "_leave_group", lambda: left.append(True))
    monkeypatch.setattr(distributed.TPExecutor, "_symm_mem", True)  # "symmetric memory in use"
    monkeypatch.setattr(distributed.TPExecutor, "_gpu_drains", lambda self, timeout_s=0.0: False)
    try:
        os.kill(pids[0], signal.SIGKILL)
        ex._healthy = False  # what the watchdog (CUDA) or a failed step records
        with pytest.warns(RuntimeWarning, match="restart"):
            llm.close()
        assert not left, "close() left the group (an NCCL abort there hung on GPUs)"
        assert not any(alive(p) for p in pids)
    finally:
        real_leave()  # this test's own cleanup: the gloo group of this process


UNGUARDED_SCRIPT = textwrap.dedent("""
    import sys
    from minivllm import LLM

    # No `if __name__ == "__main__":` guard: each spawned worker re-runs this line while
    # importing the main module and dies before it joins the process group.
    LLM(sys.argv[1], device="cpu", kernels="torch", skip_tokenizer_init=True,
        block_size=4, max_model_len=96, num_blocks=40, tensor_parallel_size=2)
""")


def test_worker_dying_before_it_joins_is_an_error_not_a_hang(random_model: str, tmp_path: Path) -> None:
    """A worker that never reaches the rendezvous (here: a script without a main guard, a
    mistake users make) is a clear error within seconds, naming the likely cause, where
    the driver would otherwise wait in ``init_process_group`` for the whole timeout."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), random_model], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 60, "the dead worker took too long to surface"
    assert "minivllm-tp-rank1 exited" in proc.stderr and "__main__" in proc.stderr, proc.stderr[-3000:]


def test_tp_size_the_model_cannot_split_is_refused_before_any_process(random_model: str) -> None:
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(random_model, **ENGINE, tensor_parallel_size=3)
    assert not multiprocessing.active_children()


def test_cli_tensor_parallel_size(capsys: pytest.CaptureFixture[str]) -> None:
    from minivllm.__main__ import main as cli_main

    args = ["generate", "--model", FIXTURE, "--device", "cpu", "--max-tokens", "6", "12+34=", "50+27="]
    assert cli_main(args) == 0
    one = capsys.readouterr().out
    assert cli_main(args + ["--tensor-parallel-size", "2"]) == 0
    assert capsys.readouterr().out == one
    assert not multiprocessing.active_children()


def test_tp2_speculative_decoding_equals_tp1(random_model: str) -> None:
    """Under tensor parallelism every rank scores the same drafts over the gathered logits:
    greedy with n-gram drafts, and with the target as its own draft model (its weights and
    cache sharded as the target's), gives TP=1's tokens without drafts, drafts kept."""
    ps = [p * 3 for p in prompts(CFG.vocab_size, n=4)]  # repeats, which n-gram lookup finds
    engine = dict(ENGINE, num_blocks=64, max_model_len=128)
    with LLM(random_model, **engine) as one:
        want = [o.token_ids for o in one.generate(ps, GREEDY, use_tqdm=False)]
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
                 {"model": random_model, "num_speculative_tokens": 3}):
        with LLM(random_model, **engine, tensor_parallel_size=2, speculative_config=spec) as two:
            got = [o.token_ids for o in two.generate(ps, GREEDY, use_tqdm=False)]
            stats = two.engine.stats
        assert got == want, spec
        kept = 0.98 * stats.num_draft_tokens if "model" in spec else 1  # the target drafts what it says
        assert stats.num_accepted_tokens >= kept > 0, (spec, stats)
