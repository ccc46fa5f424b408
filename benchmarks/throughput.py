"""Offline throughput and batch-1 decode latency, minivllm (one step in flight and
synchronous) against Hugging Face transformers. The workload "offline-256": 256 requests,
prompt lengths uniform in [100, 1024] of random token ids < 10000, max_tokens uniform in
[100, 1024], eos ignored, Qwen3-0.6B shapes in bf16.

    PYTHONPATH=. python3 -m benchmarks.throughput [--engines minivllm,hf] [--async both]
        [--num-requests 256] [--hf-requests 32] [--seed 0] [--kernels auto|triton|torch]
        [--shapes qwen3-0.6b|qwen2.5-0.5b|llama-3.2-1b|qwen3-8b] [--tensor-parallel-size N] [--smoke]
        [--load-format auto|dummy]

Throughput = completion tokens / wall time of one ``generate()`` of the whole workload,
once per scheduling mode, each on fresh token ids (no prefix-cache hits between runs) after
a short warm-up. Batch-1: a 128-token prompt, 256 greedy tokens, wall time / 256 (the
prefill included), in ``--batch1-repeats`` rounds (each a fresh prompt after a warm-up): the
median is the figure, every round's ms/token and the min and max are kept beside it. On
CUDA the GPU kernel time of a decode step (batch 1 and 256, torch profiler) and the
all-reduce's share of it are recorded too.

HF, the baseline, as fast as transformers documents: ``generate(cache_implementation=
"static")`` in bf16, which compiles the decode forward into CUDA graphs; batches of
``--hf-batch`` requests, longest first, left-padded, each warmed up once; only each
request's own max_tokens count. It runs first, on the first ``--hf-requests`` requests
(its figure is a rate, compared as such).

With several ``--engines``, each runs in a process of its own (spawned, gone before the next
starts) and the parent merges their results into one summary: what an engine leaves in its
process (HF's compiled graphs and caches, the CUDA allocator's pool, torch's threads) would
otherwise slow the engine measured after it. One engine runs in this process.

Summary: ``$OUT/throughput[_<shapes>][_tpN].json``. ``--smoke``: a tiny model on the CPU.
``--load-format dummy`` (with ``--engines minivllm``): random weights filled on the device, no checkpoint written.
The module also holds what the other end-to-end benchmarks share (options, model, device,
mode switch, the offline workload).
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import gc
import itertools
import multiprocessing
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from benchmarks.report import write_summary
from minivllm.config import KERNEL_CHOICES, LOAD_FORMATS
from minivllm.testing import SHAPES, SMOKE_SHAPES, write_random_checkpoint, write_random_config

GOAL_TOK_S, STRETCH_TOK_S = 25_000, 30_000
# offline-256 goals (tok/s on one H200) by shapes.
SHAPES_GOAL_TOK_S: dict[str, int] = {"qwen3-0.6b": GOAL_TOK_S, "qwen2.5-0.5b": 45_000, "llama-3.2-1b": 30_000}
DEFAULT_SHAPES = "qwen3-0.6b"
GOAL_MS_TOKEN, STRETCH_MS_TOKEN = 1.5, 1.0
GOAL_RATIO = 25.0


# ---- helpers shared by the end-to-end benchmarks ------------------------------

def add_common_args(ap: argparse.ArgumentParser) -> None:
    """--shapes, --model-dir, --seed, --smoke, --load-format."""
    ap.add_argument("--shapes", choices=sorted(SHAPES), default=DEFAULT_SHAPES,
                    help="the random checkpoint's model and shapes (minivllm/testing.py)")
    ap.add_argument("--model-dir", default=None,
                    help="where the random checkpoint is written once (default /tmp/<shapes>-random)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny random model on the CPU, small workload: checks the code paths only")
    ap.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                    help="dummy: minivllm fills random weights on the device from config.json alone "
                         "(no checkpoint written; minivllm only, the HF baseline needs one)")


def require_checkpoint_unless_dummy(ap: argparse.ArgumentParser, args: argparse.Namespace, hf: bool,
                                    hf_off: str) -> None:
    """--load-format dummy writes no weights, so it runs without the HF side (``hf``: it is on;
    ``hf_off``: the option that turns it off)."""
    if args.load_format == "dummy" and hf:
        ap.error(f"--load-format dummy runs minivllm only: the HF baseline needs a checkpoint (pass {hf_off})")


def model_path(args: argparse.Namespace) -> str:
    """``--shapes`` (default Qwen3-0.6B) in bf16, or (--smoke) a tiny float32 model of the
    same family; written once (``--load-format dummy``: its config.json only)."""
    shapes = args.shapes
    dummy = args.load_format == "dummy"
    write, kind = (write_random_config, "config") if dummy else (write_random_checkpoint, "random")
    if args.smoke:
        tiny = dict(SMOKE_SHAPES)
        if shapes == "qwen2.5-0.5b":  # Qwen2 derives head_dim (64 / 4 heads = 16)
            del tiny["head_dim"]
        smoke_dir = f"/tmp/minivllm-smoke-{shapes}" + ("-config" if dummy else "")
        return write(smoke_dir, shapes, dtype="float32", **tiny)
    return write(args.model_dir or f"/tmp/{shapes}-{kind}", shapes)


def bench_device(args: argparse.Namespace) -> str:
    """cpu under --smoke, else cuda (a missing GPU is an error, not a silent CPU run)."""
    if args.smoke:
        return "cpu"
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke for a CPU check of the code paths")
    return "cuda"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def set_async_scheduling(llm: Any, on: bool) -> None:
    """Switch an idle engine between one step in flight (on) and synchronous steps (off)
    (``LLMEngine.set_async_scheduling``; raises ``RuntimeError`` unless idle)."""
    llm.engine.set_async_scheduling(on)
    llm.scheduler_config = llm.engine.scheduler_config


def modes_of(flag: str) -> list[bool]:
    """--async on|off|both -> [True], [False], [True, False]."""
    return {"on": [True], "off": [False], "both": [True, False]}[flag]


def mode_name(on: bool) -> str:
    return "async on" if on else "async off"


def met(value: float, goal: float, lower_is_better: bool = False) -> str:
    ok = value <= goal if lower_is_better else value >= goal
    return "MET" if ok else "not met"


# ---- the workload --------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """Prompt lengths and max_tokens of each request; the token ids come per run."""

    prompt_lens: list[int]
    max_tokens: list[int]
    id_limit: int
    seed: int

    def prompts(self, stream: int, n: int | None = None) -> list[list[int]]:
        """Random token ids < id_limit for the first ``n`` requests; another ``stream``
        gives other ids (so no prefix-cache hits between runs)."""
        rng = np.random.default_rng([self.seed, stream])
        return [rng.integers(0, self.id_limit, k).tolist() for k in self.prompt_lens[:n]]


def offline_workload(n: int, seed: int, smoke: bool) -> Workload:
    """offline-N: prompts uniform in [100, 1024] ids < 10000, max_tokens uniform in [100, 1024]."""
    lo, hi, id_limit = (4, 24, SMOKE_SHAPES["vocab_size"]) if smoke else (100, 1024, 10000)
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, n).tolist()
    if smoke:
        maxes = rng.integers(4, 13, n).tolist()
    else:
        maxes = rng.integers(100, 1025, n).tolist()
    return Workload(lens, maxes, id_limit, seed)


# ---- minivllm ------------------------------------------------------------------

def build_llm(args: argparse.Namespace, path: str, device: str, **options: Any) -> Any:
    """The engine of the benchmark arguments (``options``: more LLM options, e.g. a KV
    cache dtype)."""
    from minivllm import LLM

    t0 = time.perf_counter()
    opts: dict[str, Any] = dict(options)  # what is not given takes the LLM's default
    budget = 64 if args.smoke else args.max_num_batched_tokens
    if budget is not None:
        opts["max_num_batched_tokens"] = budget
    if args.block_size is not None:
        opts["block_size"] = args.block_size
    if args.kernels != "auto":
        opts["kernels"] = args.kernels
    llm = LLM(path, device=device, seed=args.seed, skip_tokenizer_init=True, **opts,
              max_num_seqs=args.max_num_seqs, max_model_len=64 if args.smoke else 2048,
              enforce_eager=args.enforce_eager,
              tensor_parallel_size=args.tensor_parallel_size,
              disable_custom_all_reduce=args.disable_custom_all_reduce, load_format=args.load_format)
    print(f"minivllm start-up {time.perf_counter() - t0:.1f}s, KV pool {llm.engine.num_blocks} blocks "
          f"of {llm.engine.cache_config.block_size}, "
          f"step budget {llm.scheduler_config.max_num_batched_tokens} tokens", flush=True)
    return llm


def timed_generate(llm: Any, prompts: list[list[int]], params: list[Any]) -> tuple[list[Any], float, Any, Any]:
    """``(outputs, wall seconds, engine stats before, after)`` of one ``generate()``."""
    before = dataclasses.replace(llm.engine.stats)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, time.perf_counter() - t0, before, llm.engine.stats


def run_offline(llm: Any, wl: Workload, stream: int, label: str) -> dict[str, Any]:
    """One timed generate() of the whole workload; tok/s = completion tokens / wall."""
    from minivllm import SamplingParams

    warm = wl.prompts(stream=1000 + stream, n=64)
    llm.generate(warm, [SamplingParams(temperature=1.0, max_tokens=min(m, 16), ignore_eos=True)
                        for m in wl.max_tokens[:len(warm)]], use_tqdm=False)
    prompts = wl.prompts(stream=stream)
    params = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True) for m in wl.max_tokens]
    outs, wall, before, s = timed_generate(llm, prompts, params)
    ntok = sum(len(o.token_ids) for o in outs)
    if ntok != sum(wl.max_tokens):
        print(f"WARNING: {ntok} completion tokens, expected {sum(wl.max_tokens)} (eos is ignored)")
    r = dict(completion_tokens=ntok, wall_s=wall, tok_s=ntok / wall,
             steps=s.num_steps - before.num_steps,
             preemptions=s.num_preemptions - before.num_preemptions)
    print(f"minivllm offline-{len(prompts)} [{label}]: {ntok} completion tokens in {wall:.2f}s = "
          f"{ntok / wall:,.0f} tok/s (steps {r['steps']}, preemptions {r['preemptions']})", flush=True)
    return r


def run_batch1(llm: Any, stream: int, label: str, smoke: bool, id_limit: int) -> dict[str, Any]:
    """One round: a warm-up generation, then greedy on a fresh 128-token prompt, 256 new tokens
    (smoke: 8 and 8); ms/token includes the prefill."""
    from minivllm import SamplingParams

    plen, new = (8, 8) if smoke else (128, 256)
    rng = np.random.default_rng([stream, 7])
    greedy = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate([rng.integers(0, id_limit, plen).tolist()],
                 dataclasses.replace(greedy, max_tokens=8), use_tqdm=False)  # warm-up
    prompt = rng.integers(0, id_limit, plen).tolist()
    # Every round starts with no garbage pending, so a full collection of what earlier work
    # left (an offline run's 256 outputs) does not land inside one round and not another. No
    # gc.freeze() here: the engine froze the imported objects at start-up (LLM's
    # freeze_imported_objects), and a freeze now would pin the live engine itself, which the
    # benchmarks that build one engine after another (fp8, moe) must be able to free.
    gc.collect()
    t0 = time.perf_counter()
    out = llm.generate([prompt], greedy, use_tqdm=False)[0]
    dt = time.perf_counter() - t0
    ms = dt * 1e3 / len(out.token_ids)
    print(f"minivllm batch-1 [{label}]: {len(out.token_ids)} tokens in {dt * 1e3:.0f} ms = "
          f"{ms:.2f} ms/token (prefill of {plen} included)", flush=True)
    return dict(tokens=len(out.token_ids), wall_s=dt, ms_per_token=ms)


def median_run(runs: list[dict[str, Any]], label: str) -> dict[str, Any]:
    """The batch-1 round of median ms/token (the upper median of an even count) with the
    spread of all rounds: each round's ms/token in order (``rounds_ms_per_token``), ``min`` and
    ``max``; printed when there is more than one round. A figure that differs between runs
    at one commit shows here as a wide range, not as a jump between two medians."""
    ms = [r["ms_per_token"] for r in runs]
    pick = dict(sorted(runs, key=lambda r: r["ms_per_token"])[len(runs) // 2])
    pick.update(rounds_ms_per_token=ms, min=min(ms), max=max(ms))
    if len(runs) > 1:
        print(f"minivllm batch-1 [{label}]: median {pick['ms_per_token']:.3f} ms/token over {len(runs)} rounds, "
              f"min {pick['min']:.3f}, max {pick['max']:.3f} ({', '.join(f'{m:.3f}' for m in ms)})", flush=True)
    return pick


def run_minivllm(args: argparse.Namespace, path: str, device: str, wl: Workload) -> dict[str, Any]:
    llm = build_llm(args, path, device)
    results: dict[str, Any] = {"kv_blocks": llm.engine.num_blocks}
    for i, on in enumerate(modes_of(args.async_mode)):
        set_async_scheduling(llm, on)
        results[mode_name(on)] = dict(offline=run_offline(llm, wl, stream=1 + i, label=mode_name(on)))
    for i, on in enumerate(modes_of(args.async_mode)):
        set_async_scheduling(llm, on)
        runs = [run_batch1(llm, 100 + i + 10 * r, mode_name(on), args.smoke, wl.id_limit)
                for r in range(args.batch1_repeats)]
        results[mode_name(on)]["batch1"] = median_run(runs, mode_name(on))
    if device == "cuda":
        results["decode_kernels"] = profile_decode(llm, wl.id_limit)
        results["decode_kernels_batch256"] = profile_decode(llm, wl.id_limit, batch=min(256, args.max_num_seqs),
                                                            steps=16)
    return results


_PROFILE_ROUNDS = itertools.count()  # request ids of profile_decode's rounds, unique per process


def profile_decode(llm: Any, id_limit: int, batch: int = 1, steps: int = 32, prompt_len: int = 128) -> dict[str, Any]:
    """GPU kernel time per decode step at ``batch`` over prompts of ``prompt_len`` tokens (rank
    0's GPU, under the torch profiler) and the all-reduce share of it (NCCL kernels; 0 at
    TP=1). Decode only: the requests go to the engine directly, which steps until a step
    schedules no prefill token; then ``steps`` steps are profiled (each call submits one,
    and the device is synchronised before and after), and the requests are aborted. The
    whole round runs once unprofiled first (compiles, graphs), on other prompts. Without CUDA
    the window runs unprofiled (kernel times 0: the CPU tests)."""
    from minivllm import SamplingParams

    rng = np.random.default_rng(11)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True)  # outlasts the window
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def decode_steps() -> None:
        for _ in range(steps):
            engine.step()
        sync(device)

    def one_round(profiled: bool) -> tuple[collections.Counter, int]:
        ids = [f"profile-decode-{next(_PROFILE_ROUNDS)}-{i}" for i in range(batch)]
        for rid in ids:  # fresh prompts each round: no prefix-cache hits
            engine.add_request(rid, rng.integers(0, id_limit, prompt_len).tolist(), params)
        for _ in range(batch * prompt_len + 2):  # a step computes >= 1 token: the prefills end
            engine.step()
            last = engine.last_step  # what this call scheduled
            if not last.num_prefill_tokens and len(last.scheduled) == batch:
                break
        sync(device)
        before = engine.stats.num_prefill_tokens
        kernels: collections.Counter = collections.Counter()
        if profiled and device == "cuda":
            kernels = profiled_kernel_us(decode_steps)
        else:  # the warm-up round; or no CUDA, no kernels to time (the CPU tests' case)
            decode_steps()
        prefill_tokens = engine.stats.num_prefill_tokens - before
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
        return kernels, prefill_tokens

    one_round(profiled=False)
    decode, prefill_tokens = one_round(profiled=True)
    if prefill_tokens:
        raise RuntimeError(f"the profiled decode steps scheduled {prefill_tokens} prefill tokens")
    total = sum(decode.values())
    nccl = sum(t for name, t in decode.items() if is_all_reduce_kernel(name))
    top = [dict(name=name[:120], us_per_step=t / steps) for name, t in decode.most_common(TOP_KERNELS)]
    r = dict(batch=batch, prompt_len=prompt_len, decode_steps=steps, kernel_us_per_step=total / steps,
             allreduce_us_per_step=nccl / steps, allreduce_share=nccl / total if total > 0 else 0.0,
             top_kernels=top)
    print(f"decode at batch {batch} (prompts of {prompt_len}): GPU kernels {r['kernel_us_per_step']:.0f} us/step, all-reduce "
          f"{r['allreduce_us_per_step']:.0f} us/step = {100 * r['allreduce_share']:.1f}% (rank 0)", flush=True)
    for k in top:
        print(f"  {k['us_per_step']:8.1f} us/step  {k['name'][:100]}")
    return r


def profile_prefill(llm: Any, id_limit: int, prompts: int = 16, length: int = 1024) -> dict[str, Any]:
    """GPU kernel time of prefilling ``prompts`` fresh prompts of ``length`` tokens (max_tokens
    1: one sampled token each, no decode step), per 1,000 prompt tokens, and the costliest
    kernels; with a step budget of at least prompts x length, one step."""
    from minivllm import SamplingParams

    rng = np.random.default_rng(12)

    def run() -> None:
        batch = [rng.integers(0, id_limit, length).tolist() for _ in range(prompts)]
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)

    run()                                                                # warm-up, same shapes
    kernels = profiled_kernel_us(run)
    per_1k = 1000 / (prompts * length)
    r = dict(prompts=prompts, length=length, kernel_us_per_1k_tokens=sum(kernels.values()) * per_1k,
             top_kernels=[dict(name=name[:120], us_per_1k_tokens=t * per_1k)
                          for name, t in kernels.most_common(TOP_KERNELS)])
    print(f"prefill of {prompts} x {length} tokens: GPU kernels {r['kernel_us_per_1k_tokens']:.0f} us per 1,000 "
          f"prompt tokens", flush=True)
    for k in r["top_kernels"]:
        print(f"  {k['us_per_1k_tokens']:8.1f} us/1k tokens  {k['name'][:100]}")
    return r


TOP_KERNELS = 12


def is_all_reduce_kernel(name: str) -> bool:
    """NCCL's kernels and torch's symmetric-memory all-reduce kernels."""
    n = name.lower()
    return "nccl" in n or "allreduce" in n or "all_reduce" in n


def profiled_kernel_us(fn: Any) -> collections.Counter:
    """CUDA kernel time in us by kernel name while ``fn()`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    times: collections.Counter = collections.Counter()
    for ev in prof.events():
        if str(getattr(ev, "device_type", "")).endswith("CUDA"):
            times[ev.name] += getattr(ev, "device_time", None) or getattr(ev, "cuda_time", 0.0)
    return times


# ---- Hugging Face --------------------------------------------------------------

def _hf_batches(wl: Workload, n: int, batch: int) -> list[list[int]]:
    """Request indices, longest max_tokens first, ``batch`` at a time."""
    order = sorted(range(n), key=lambda i: (wl.max_tokens[i], wl.prompt_lens[i]), reverse=True)
    return [order[i:i + batch] for i in range(0, n, batch)]


def _left_pad(prompts: list[list[int]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def _hf_generate(model: Any, gen_cfg: Any, ids: torch.Tensor, mask: torch.Tensor, max_new: int,
                 stop_after: int | None = None) -> torch.Tensor:
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAfter(StoppingCriteria):
        """Ends the warm-up early; the static cache is still sized for ``max_new`` tokens."""

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            done = input_ids.shape[1] >= ids.shape[1] + (stop_after or 0)
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    crit = StoppingCriteriaList([StopAfter()]) if stop_after else None
    cfg = copy.deepcopy(gen_cfg)
    cfg.max_new_tokens = max_new
    return model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg, stopping_criteria=crit)


def _hf_model(path: str, device: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    gen_cfg = copy.deepcopy(model.generation_config)
    gen_cfg.cache_implementation = "static"   # generate() compiles the decode forward on CUDA
    gen_cfg.do_sample, gen_cfg.temperature, gen_cfg.top_k, gen_cfg.top_p = True, 1.0, 0, 1.0
    gen_cfg.eos_token_id = None               # eos ignored, as in the workload
    gen_cfg.pad_token_id = 0
    return model, gen_cfg


def run_hf(args: argparse.Namespace, path: str, device: str, wl: Workload) -> dict[str, Any]:
    """HF generate over the first --hf-requests requests; see the module docstring."""
    n = min(args.hf_requests, len(wl.prompt_lens))
    model, gen_cfg = _hf_model(path, device)
    prompts = wl.prompts(stream=1, n=n)
    batches = [(_left_pad([prompts[i] for i in b], device), max(wl.max_tokens[i] for i in b), b)
               for b in _hf_batches(wl, n, args.hf_batch)]
    torch.manual_seed(args.seed)
    for k, ((ids, mask), max_new, _) in enumerate(batches):
        for rep in range(2 if k == 0 else 1):
            t0 = time.perf_counter()
            _hf_generate(model, gen_cfg, ids, mask, max_new, stop_after=16)
            sync(device)
            print(f"HF warm-up batch {k} ({ids.shape[0]}x{ids.shape[1]}, cache for {max_new} new) "
                  f"run {rep}: {time.perf_counter() - t0:.1f}s", flush=True)
    compiled = getattr(model, "_compiled_call", None) is not None
    print(f"HF decode forward compiled by generate(): {'yes' if compiled else 'NO'}")
    t0 = time.perf_counter()
    generated = 0
    for (ids, mask), max_new, _ in batches:
        out = _hf_generate(model, gen_cfg, ids, mask, max_new)
        if out.shape[1] != ids.shape[1] + max_new:
            print(f"WARNING: HF generated {out.shape[1] - ids.shape[1]} tokens, expected {max_new}")
        generated += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    sync(device)
    wall = time.perf_counter() - t0
    counted = sum(wl.max_tokens[:n])
    how = "compiled decode" if compiled else "decode NOT compiled"
    print(f"HF generate (static cache, {how}) on {n} requests in {len(batches)} batch(es) of "
          f"<= {args.hf_batch}: {counted} completion tokens (each request's own max_tokens; "
          f"{generated} generated with the batches' over-run) in {wall:.2f}s = {counted / wall:,.0f} tok/s "
          f"(a rate over {n} requests, compared with minivllm's over {len(wl.prompt_lens)})", flush=True)
    del model
    return dict(requests=n, batches=len(batches), completion_tokens=counted, generated_tokens=generated,
                wall_s=wall, tok_s=counted / wall, compiled=compiled)


# ---- main ----------------------------------------------------------------------

ENGINE_ORDER = ("hf", "minivllm")  # the order the engines of --engines run in


def run_engine(engine: str, args: argparse.Namespace, path: str, device: str, wl: Workload) -> dict[str, Any]:
    """The results of one engine of ``--engines``."""
    run = run_hf if engine == "hf" else run_minivllm
    return run(args, path, device, wl)


def run_engine_apart(engine: str, args: argparse.Namespace, path: str, device: str,
                     wl: Workload) -> dict[str, Any]:
    """``run_engine`` in a fresh spawned process, which has exited (with all it held) when this
    returns; its exception is raised here."""
    spawn = multiprocessing.get_context("spawn")  # a fork would inherit this process's state
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        return pool.submit(run_engine, engine, args, path, device, wl).result()


def print_targets(n: int, results: dict[str, Any], shapes: str = DEFAULT_SHAPES) -> None:
    mv, hf = results.get("minivllm"), results.get("hf")
    goal = SHAPES_GOAL_TOK_S.get(shapes)
    stretch = f"; stretch {STRETCH_TOK_S:,}" if shapes == DEFAULT_SHAPES else ""
    if mv is not None:
        for name in ("async on", "async off"):
            if name in mv:
                tps, ms = mv[name]["offline"]["tok_s"], mv[name]["batch1"]["ms_per_token"]
                verdict = f"(goal >= {goal:,}{stretch}) [{name}] {met(tps, goal)}" if goal else f"[{name}]"
                print(f"offline-{n} [{shapes}]: {tps:,.0f} tok/s {verdict}")
                print(f"batch-1: {ms:.2f} ms/token (goal <= {GOAL_MS_TOKEN}; stretch {STRETCH_MS_TOKEN}) "
                      f"[{name}] {met(ms, GOAL_MS_TOKEN, lower_is_better=True)}")
    if mv is not None and hf is not None and "tok_s" in hf:
        for name in ("async off", "async on"):  # the top-level ratio: async on where it ran
            if name in mv:
                mv[name]["vs_hf"] = ratio = mv[name]["offline"]["tok_s"] / hf["tok_s"]
                results["ratio_minivllm_hf"] = ratio
                print(f"ratio minivllm [{name}] / HF: {ratio:.1f}x (goal >= {GOAL_RATIO:.0f}x) "
                      f"{met(ratio, GOAL_RATIO)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--engines", default="minivllm,hf", help="comma list of minivllm, hf")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--batch1-repeats", type=int, default=5,
                    help="batch-1 rounds to time (different prompts); the median is reported, with "
                         "every round and the min and max")
    ap.add_argument("--hf-requests", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--async", dest="async_mode", choices=("on", "off", "both"), default="both")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="token budget of a step (default: the LLM's, 16384 on CUDA as vLLM's LLM class)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="ranks (GPUs) for minivllm; the summary is throughput_tpN.json when N > 1")
    ap.add_argument("--disable-custom-all-reduce", action="store_true",
                    help="with TP: NCCL for every all-reduce (no one-shot symmetric-memory kernel)")
    ap.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto",
                    help="the fused ops' implementation (ExecutorConfig.kernels; auto: the LLM's default)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="tokens per KV cache block (default: the LLM's)")
    args = ap.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or set(engines) - {"minivllm", "hf"}:
        ap.error(f"--engines: expected a comma list of minivllm, hf; got {args.engines!r}")
    if args.batch1_repeats < 1:
        ap.error("--batch1-repeats must be >= 1")
    args.engines = [e for e in ENGINE_ORDER if e in engines]
    require_checkpoint_unless_dummy(ap, args, hf="hf" in engines, hf_off="--engines minivllm")
    if args.smoke:
        args.num_requests, args.hf_requests = min(args.num_requests, 6), min(args.hf_requests, 4)
        args.hf_batch, args.max_num_seqs = min(args.hf_batch, 2), min(args.max_num_seqs, 4)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = bench_device(args)
    path = model_path(args)
    wl = offline_workload(args.num_requests, args.seed, args.smoke)
    print(f"offline-{args.num_requests}: {sum(wl.prompt_lens)} prompt tokens, {sum(wl.max_tokens)} "
          f"completion tokens; engines {args.engines}, device {device}, smoke={args.smoke}", flush=True)
    results: dict[str, Any] = {"args": vars(args), "workload": f"offline-{args.num_requests}"}
    run = run_engine if len(args.engines) == 1 else run_engine_apart
    if "hf" in args.engines:
        try:
            results["hf"] = run("hf", args, path, device, wl)
        except Exception as e:  # reported loudly; minivllm still runs
            traceback.print_exc()
            print(f"HF: FAILED ({type(e).__name__}: {e})", flush=True)
            results["hf"] = {"error": f"{type(e).__name__}: {e}"}
    if "minivllm" in args.engines:
        results["minivllm"] = run("minivllm", args, path, device, wl)
    print_targets(args.num_requests, results, args.shapes)
    name = "throughput" + ("" if args.shapes == DEFAULT_SHAPES else f"_{args.shapes}")
    write_summary(name if args.tensor_parallel_size == 1 else f"{name}_tp{args.tensor_parallel_size}", results)
    if "error" in results.get("hf", {}):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
