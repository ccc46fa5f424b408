"""Does the server's host side keep up with the engine? The real server, no model (CPU).

    python -m benchmarks.serving_host [--streams 256] [--max-tokens 300]
        [--step-ms 2.0] [--seq-us 16] [--engine-process]

The GPU is replaced by ``TimedExecutor``: the simulator's fake model, whose step N
completes ``step-ms + seq-us x sequences`` after step N-1 completed (one stream, in
order; about a 6 ms step at batch 256, an H200's Qwen3-0.6B decode step), and whose
``result()`` sleeps until then, releasing the GIL as a wait on a CUDA event does. The
same engine runs twice on ``--streams`` requests of ``--max-tokens`` tokens each:

- offline: ``add_request`` all, ``step()`` until done (what ``LLM.generate`` does);
- served: the real app (uvicorn, the tiny fixture's tokenizer) in a child process
  (with ``--engine-process`` the engine in a process of its own, as ``serve
  --engine-process`` runs it), all requests streamed at once by one async client in
  this process (``benchmarks.serving``'s), output tok/s = tokens / (last chunk -
  first sent).

Their ratio is the part of the serving target (>= 0.9 of offline) that the host
decides. On a 2-core machine the client competes with the server for a core: the
ratio is then a floor.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import multiprocessing
import json
import os
import re
import time
from typing import Any

import numpy as np

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling import SamplingParams
from sim.fake_executor import FakeExecutor

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tiny-qwen3")
VOCAB = 100  # the fixture's
PROMPT_LEN = 16


class _TimedHandle:
    def __init__(self, handle: Any, done_at: float) -> None:
        self.handle, self.done_at = handle, done_at

    def result(self) -> Any:
        wait = self.done_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return self.handle.result()


class TimedExecutor:
    """A ``FakeExecutor`` whose steps take device time: step N is done ``step_s +
    seq_s x its sequences`` after the later of its submission and step N-1's end."""

    def __init__(self, inner: FakeExecutor, step_s: float, seq_s: float) -> None:
        self.inner, self.step_s, self.seq_s = inner, step_s, seq_s
        self.free_at = 0.0

    def submit(self, plan: Any) -> _TimedHandle:
        handle = self.inner.submit(plan)
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + self.step_s + self.seq_s * len(plan.seq_ids)
        return _TimedHandle(handle, self.free_at)

    def execute(self, plan: Any) -> Any:
        return self.submit(plan).result()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def make_engine(args: argparse.Namespace) -> LLMEngine:
    blocks = args.streams * (-(-(PROMPT_LEN + args.max_tokens) // 16)) + 16
    executor = TimedExecutor(FakeExecutor(VOCAB, 16, blocks), args.step_ms / 1e3, args.seq_us / 1e6)
    return LLMEngine(SchedulerConfig(max_num_seqs=args.streams, max_num_batched_tokens=8192,
                                     max_model_len=PROMPT_LEN + args.max_tokens, async_scheduling=True),
                     CacheConfig(block_size=16, num_blocks=blocks), executor)


class FakeLLM:
    """What the engine process needs of an ``LLM``, over the timed fake engine."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.engine = make_engine(args)
        self.scheduler_config = self.engine.scheduler_config

    def close(self) -> None:
        pass


def prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, VOCAB, PROMPT_LEN).tolist() for _ in range(n)]


def run_offline(args: argparse.Namespace) -> dict[str, float]:
    engine = make_engine(args)
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, output_kind="final_only")
    t0 = time.perf_counter()
    for i, p in enumerate(prompts(args.streams)):
        engine.add_request(f"o{i}", p, params)
    while engine.has_unfinished_requests():
        engine.step()
    dt = time.perf_counter() - t0
    return dict(seconds=dt, tok_s=args.streams * args.max_tokens / dt, steps=engine.stats.num_steps)


def serve(args: argparse.Namespace, port: int) -> None:
    """The child process: the app over the timed engine, on 127.0.0.1:port."""
    import uvicorn

    from minivllm import LLM
    from minivllm.server.app import build_app
    from minivllm.server.engine_loop import AsyncEngine
    from minivllm.server.protocol import ServerConfig

    llm = LLM(FIXTURE, device="cpu", num_blocks=8, max_model_len=64)  # its tokenizer and prompt check
    if args.engine_process:
        from minivllm.server.engine_process import ProcessAsyncEngine
        engine: Any = ProcessAsyncEngine(functools.partial(FakeLLM, args), {}, llm.tokenizer)
    else:
        engine = AsyncEngine(make_engine(args), llm.tokenizer)
    app = build_app(llm, ServerConfig("fake"), engine=engine)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


USAGE = re.compile(rb'"completion_tokens":(\d+)')


async def lean_request(port: int, body: bytes) -> tuple[float, float, float, int, int]:
    """One streamed request over a raw connection, parsed no more than needed: (sent,
    first bytes, last bytes, SSE chunks, completion tokens from the usage chunk). A
    client that parses every chunk (httpx, JSON) is itself the limit on two cores."""
    sent = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    parts, first = [], 0.0
    while data := await reader.read(1 << 16):
        if not first:
            first = time.perf_counter()
        parts.append(data)
    last = time.perf_counter()
    writer.close()
    raw = b"".join(parts)
    tokens = USAGE.findall(raw)
    return sent, first, last, raw.count(b"data: ") - 1, int(tokens[-1]) if tokens else 0


async def lean_client(port: int, bodies: list[bytes]) -> list[tuple[float, float, float, int, int]]:
    return list(await asyncio.gather(*(lean_request(port, b) for b in bodies)))


def run_served(args: argparse.Namespace) -> dict[str, float]:
    import httpx

    from benchmarks.serving import request_body
    from minivllm.executor.distributed import free_port

    port = free_port()
    proc = multiprocessing.get_context("spawn").Process(target=serve, args=(args, port))  # may spawn
    proc.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or not proc.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.1)  # no event crosses the process boundary: poll with a deadline
        bodies = [json.dumps(request_body(p, args.max_tokens, True)).encode() for p in prompts(args.streams)]
        cpu0 = time.process_time()
        records = asyncio.run(lean_client(port, bodies))
        client_cpu = time.process_time() - cpu0
    finally:
        proc.terminate()
        proc.join(10)
    short = [r for r in records if r[4] != args.max_tokens]
    if short:
        raise RuntimeError(f"{len(short)} requests did not stream {args.max_tokens} tokens")
    first = min(r[0] for r in records)
    last = max(r[2] for r in records)
    chunks = sum(r[3] - 1 for r in records)  # less the usage chunk
    tokens = sum(r[4] for r in records)
    return dict(seconds=last - first, tokens=tokens, tok_s=tokens / (last - first), chunks=chunks,
                tokens_per_chunk=tokens / chunks, client_cpu_s=client_cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--step-ms", type=float, default=2.0, help="device time of a step, fixed part")
    ap.add_argument("--seq-us", type=float, default=16.0, help="device time per sequence of a step")
    ap.add_argument("--engine-process", action="store_true", help="the engine in its own process")
    args = ap.parse_args()
    off = run_offline(args)
    print(f"offline: {off['tok_s']:,.0f} tok/s ({off['seconds']:.2f} s, {off['steps']} steps)", flush=True)
    srv = run_served(args)
    print(f"served:  {srv['tok_s']:,.0f} tok/s ({srv['seconds']:.2f} s, {srv['chunks']} chunks, "
          f"{srv['tokens_per_chunk']:.2f} tokens/chunk, client CPU {srv['client_cpu_s']:.1f} s)")
    print(f"served / offline: {srv['tok_s'] / off['tok_s']:.3f} (target >= 0.9)")


if __name__ == "__main__":
    main()
