"""Host cost of the engine alone: schedule + plan + numpy inputs + apply, per decode step
at batch 256 (512-token prompts, block_size 16), with an executor that only runs
``prepare_inputs`` and returns a token per sequence: the time a device step must cover for
the host never to be the bottleneck. Runs on any CPU.

    python3 -m benchmarks.engine_host [--batch 256] [--steps 200] [--output-kind delta] [--profile]

Summary: ``$OUT/engine_host.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

from benchmarks.report import write_summary
from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.plan import StepPlan, StepResult
from minivllm.executor.base import DoneStep
from minivllm.executor.inputs import prepare_inputs
from minivllm.sampling import SamplingParams


class InputsOnlyExecutor:
    """Computes the step's index arrays (as every executor does) and samples token 7."""

    def num_kv_blocks(self) -> int:
        return 100_000

    def state_pool(self) -> tuple[int, int]:
        return 0, 0

    def execute(self, plan: StepPlan) -> StepResult:
        prepare_inputs(plan)
        return StepResult({s: 7 for s, smp in zip(plan.seq_ids, plan.sample) if smp})

    def submit(self, plan: StepPlan) -> DoneStep:
        return DoneStep(self.execute(plan))


def decoding_engine(batch: int, max_tokens: int, output_kind: str = "delta") -> LLMEngine:
    """An engine whose ``batch`` requests (512-token prompts, ``max_tokens`` each) are all
    admitted and prefilled: its next steps are decode steps. ``output_kind`` "delta" is a
    server's streaming, "final_only" offline ``generate()``."""
    engine = LLMEngine(SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=8192, max_model_len=2048),
                       CacheConfig(block_size=16, num_blocks=100_000), InputsOnlyExecutor())
    rng = np.random.default_rng(0)
    for i in range(batch):
        engine.add_request(f"r{i}", rng.integers(0, 10000, 512).tolist(),
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=output_kind))
    for _ in range(40):  # admit and prefill everyone
        engine.step()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--output-kind", choices=("delta", "final_only"), default="delta",
                    help="delta: an output per request per step (serving); final_only: offline generate()")
    args = ap.parse_args()
    engine = decoding_engine(args.batch, args.steps + 100, output_kind=args.output_kind)
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(args.steps):
        engine.step()
    if prof:
        prof.disable()
    dt = (time.perf_counter() - t0) / args.steps
    print(f"batch {args.batch} decode, output_kind {args.output_kind}: {dt * 1e3:.2f} ms/step of engine host work"
          + (" (profiled)" if prof else ""))
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(15)
    else:  # a profiled run's time is the profiler's too
        write_summary("engine_host", {"batch": args.batch, "steps": args.steps, "output_kind": args.output_kind,
                                      "ms_per_step": dt * 1e3})


if __name__ == "__main__":
    main()
