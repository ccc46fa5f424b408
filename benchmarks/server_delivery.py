"""The server's per-step delivery cost on the engine thread (CPU only, no model).

``AsyncEngine._deliver`` turns one engine step's streamed outputs into text deltas
(incremental detokenizing) and hands them to the event loop. It runs on the
engine thread between steps, so with hundreds of streams it adds straight to
the step time whenever it exceeds the GPU's step. This feeds it ``--streams``
outputs of one new token each, ``--steps`` times, with the fixture's Qwen
tokenizer and a running event loop on another thread, and prints the median.

    python -m benchmarks.server_delivery [--streams 256] [--steps 200]
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import numpy as np

from minivllm.detokenizer import IncrementalDetokenizer
from minivllm.server.engine_loop import AsyncEngine, RequestGroup, StepOutput, _Choice
from minivllm.server.metrics import ServerMetrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tokenizer", default="fixtures/tiny-qwen3")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = min(len(tok), 150)  # ordinary byte-level tokens of the fixture's vocabulary
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    engine = AsyncEngine.__new__(AsyncEngine)  # only _deliver's state: no engine, no thread
    engine.metrics, engine.tokenizer, engine._tracked = ServerMetrics(), tok, {}
    rng = np.random.default_rng(0)
    prompts = {f"r{i}": rng.integers(0, vocab, 20).tolist() for i in range(args.streams)}

    async def groups() -> dict[str, RequestGroup]:
        return {rid: RequestGroup([rid], 1) for rid in prompts}

    by_id = asyncio.run_coroutine_threadsafe(groups(), loop).result()
    for rid, prompt in prompts.items():
        engine._tracked[rid] = [_Choice(by_id[rid], 0, loop, IncrementalDetokenizer(tok, prompt), len(prompt),
                                        0, time.monotonic())]
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    times = []
    for _ in range(args.steps):
        outputs = []
        for rid, prompt in prompts.items():
            t = int(rng.integers(0, vocab))
            tokens[rid].append(t)
            outputs.append(StepOutput(rid, 0, (t,), len(tokens[rid]), None, None, None, time.monotonic()))
        t0 = time.perf_counter()
        engine._deliver(outputs)
        times.append(time.perf_counter() - t0)
    med = float(np.median(times))
    print(f"_deliver of {args.streams} outputs: median {med * 1e3:.2f} ms/step "
          f"({med / args.streams * 1e6:.1f} us/output)")
    loop.call_soon_threadsafe(loop.stop)


if __name__ == "__main__":
    main()
