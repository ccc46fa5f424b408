"""Where a step's time goes: wall time per engine phase (CUDA synchronised at each
phase boundary, so the phases add up; the total is a little slower than unprofiled).

    PYTHONPATH=. python3 -m benchmarks.profile_step [--batch 256] [--seeded]
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

import numpy as np
import torch

from benchmarks.qwen3_shapes import write_random_qwen3

TIMES: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()


def timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = fn(*a, **k)
        torch.cuda.synchronize()
        TIMES[name] += time.perf_counter() - t0
        CALLS[name] += 1
        return r
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seeded", action="store_true")
    ap.add_argument("--model-dir", default="/tmp/qwen3-0.6b-random")
    args = ap.parse_args()
    from minivllm import LLM, SamplingParams
    from minivllm.layers import sampler as sampler_mod

    # Synchronous: the phase timers synchronise the device, which one step in flight cannot survive.
    llm = LLM(write_random_qwen3(args.model_dir), max_num_seqs=max(args.batch, 1), max_model_len=2048,
              async_scheduling=False)
    eng, ex = llm.engine, llm.engine.executor
    eng.scheduler.schedule = timed("schedule", eng.scheduler.schedule)
    eng._build_plan = timed("build_plan", eng._build_plan)
    eng._apply = timed("apply", eng._apply)
    ex.prepare = timed("prepare+upload", ex.prepare)
    ex._forward = timed("forward", ex._forward)
    ex.model.compute_logits = timed("lm_head", ex.model.compute_logits)
    ex.sampler.forward = timed("sampler", ex.sampler.forward)
    sampler_mod.SamplingTensors.build = staticmethod(timed("sampling_tensors", sampler_mod.SamplingTensors.build))
    step = timed("step(total)", eng.step)
    eng.step = step
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 10000, 512).tolist() for _ in range(args.batch)]
    params = [SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True,
                             seed=i if args.seeded else None) for i in range(args.batch)]
    llm.generate(prompts, params, use_tqdm=False)
    steps = CALLS["step(total)"]
    print(f"batch {args.batch}, seeded={args.seeded}: {steps} steps")
    for name, t in TIMES.most_common():
        print(f"  {name:18s} {t * 1e3 / steps:8.3f} ms/step  ({CALLS[name]} calls)")


if __name__ == "__main__":
    main()
