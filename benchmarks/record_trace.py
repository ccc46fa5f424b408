"""Record a trace of real traffic on a GPU, for replay by the simulator on any machine.

    python3 -m benchmarks.record_trace [--model DIR] [--out trace.jsonl] [--async on|off]

The tiny Qwen3 fixture (or ``--model``) serves 24 requests with shared prefixes, seeded
sampling, ``n = 2``, a stop string and an abort, through a KV pool small enough to preempt
and a token budget small enough to chunk prefills, CUDA graphs on where the device has
them. ``LLM(observer=TraceRecorder(...))`` writes every step's decisions and sampled tokens; the
simulator's engine replays them without the model (``python -m sim replay FILE --plot
OUT.png``), and ``tests/sim/test_record_trace.py`` replays the committed H200 recording.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from minivllm import LLM, SamplingParams
from minivllm.engine.trace import TraceRecorder

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "tiny-qwen3"


def record(model: str, out: str, device: str, async_scheduling: bool) -> dict[str, int]:
    """Run the traffic; returns the engine's counters of what happened."""
    with LLM(model, device=device, block_size=4, num_blocks=40, max_num_seqs=8,
             max_num_batched_tokens=24, async_scheduling=async_scheduling,
             observer=TraceRecorder(out)) as llm:
        stems = ["12+34=", "The cat sat on the", "9" * 12, "hello world, hello"]
        prompts = [stems[i % 4] + str(i) for i in range(20)]
        params = [SamplingParams(temperature=1.0 if i % 3 else 0.0, top_k=20 if i % 5 == 1 else -1,
                                 max_tokens=8 + (7 * i) % 29, ignore_eos=True, seed=i, n=1 + (i % 7 == 0))
                  for i in range(len(prompts))]
        params[5] = SamplingParams(temperature=0.0, max_tokens=30, stop=["1"])
        llm.generate(prompts, params, use_tqdm=False)
        engine = llm.engine  # the server's way: requests and an abort between steps
        for i in range(4):
            engine.add_request(f"live-{i}", llm.prompt_token_ids(i, stems[i] * 2),
                               SamplingParams(temperature=0.7, max_tokens=16, ignore_eos=True, seed=100 + i))
        for _ in range(4):
            engine.step()
        engine.abort_request("live-2")
        while engine.has_unfinished_requests():
            engine.step()
        s = engine.stats
        return dict(steps=s.num_steps, preemptions=s.num_preemptions)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(FIXTURE))
    ap.add_argument("--out", default="trace.jsonl")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--async", dest="async_mode", choices=("on", "off"), default="on")
    args = ap.parse_args()
    info = record(args.model, args.out, args.device, args.async_mode == "on")
    print(f"recorded {args.out}: {info}")


if __name__ == "__main__":
    main()
