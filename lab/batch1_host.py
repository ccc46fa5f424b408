"""Question: where does a Qwen3-0.6B batch-1 step spend the wall time its GPU kernels do not
account for (1.5-2.3 ms a token against 0.9 ms of kernels in some runs, 0.95 in others)?

Builds the 0.6B-shaped engine with dummy weights once, then times batch-1 runs (128-token
prompt, 256 greedy tokens) with torch's default intra-op threads and with one, in turn;
then the wall time of each ``engine.step`` of one run (its distribution), and one run under
cProfile (the functions of most own time)::

    PYTHONPATH=. python3 lab/batch1_host.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from benchmarks.throughput import run_batch1
from minivllm import LLM
from minivllm.testing import write_random_config


def time_steps(llm: LLM) -> None:
    """One batch-1 round with each ``engine.step``'s wall time kept; prints their distribution."""
    engine = llm.engine
    real_step, walls = engine.step, []

    def timed_step():
        t0 = time.perf_counter()
        out = real_step()
        walls.append(time.perf_counter() - t0)
        return out

    engine.step = timed_step
    run_batch1(llm, 200, "steps timed", False, 10000)
    engine.step = real_step
    w = sorted(walls)
    print(f"engine.step wall over {len(w)} steps: median {1e3 * w[len(w) // 2]:.3f} ms, p10 "
          f"{1e3 * w[len(w) // 10]:.3f}, p90 {1e3 * w[9 * len(w) // 10]:.3f}, max {1e3 * w[-1]:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    path = write_random_config("/tmp/qwen3-0.6b-config", "qwen3-0.6b")
    llm = LLM(path, device="cuda", seed=0, skip_tokenizer_init=True, max_num_seqs=256, max_model_len=2048,
              load_format="dummy")
    default = torch.get_num_threads()
    for r in range(args.rounds):
        for threads in (default, 1):
            torch.set_num_threads(threads)
            run_batch1(llm, 100 + r, f"{threads} torch threads", False, 10000)
    torch.set_num_threads(default)

    time_steps(llm)

    prof = cProfile.Profile()
    prof.enable()
    run_batch1(llm, 300, "under cProfile", False, 10000)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    llm.close()


if __name__ == "__main__":
    main()
