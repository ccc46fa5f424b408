"""Online serving: the OpenAI server under Poisson arrivals, against offline ``generate()``.

    PYTHONPATH=. python3 -m benchmarks.serving [--rates 8,32,128,inf] [--num-requests 256]
        [--max-duration 20] [--seed 0] [--model DIR] [--device auto] [--client-procs N]
        [--tokenizer auto|synthetic] [--out FILE] [--smoke]

The workload is throughput.py's offline-256 (Qwen3-0.6B shapes, random weights, unless
``--model``). ``python -m minivllm serve`` runs in its own process group on 127.0.0.1; the
client (httpx, asyncio, in ``--client-procs`` processes: one process parsing 256 streams is
a busy core, and its recorded times would lag) streams every request as token ids to
``/v1/completions`` with ``ignore_eos`` and the request's ``max_tokens``. At each rate the
requests arrive as a seeded Poisson process (``inf``: all at once; a finite rate sends the
first ``rate * --max-duration``), on fresh token ids, after one untimed warm-up. Per rate:
req/s and output tok/s (over first send to last token), TTFT, TPOT and ITL percentiles. A
request that ends otherwise than by length, or with another token count (the usage chunk),
is a failure. Then the ``inf`` requests go through ``LLM.generate()`` with the same engine
options, and the ratio server / offline tok/s is reported (target >= 0.9).

A checkpoint without a tokenizer (the random ones) is served beside a synthetic word-level
tokenizer that decodes id ``i`` as ``" t<i>"``: every token has text, so chunks = tokens.
Summary: ``$OUT/serving.json``, or ``--out FILE``. ``--smoke``/``--device cpu``: tiny sizes.
``--load-format dummy``: server and offline engine fill random weights on the device, no checkpoint written.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.report import write_summary
from benchmarks.throughput import (Workload, add_common_args, bench_device, met, model_path,
                                   offline_workload, run_offline)
from minivllm.executor.distributed import free_port

TARGET_RATIO = 0.9
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP_STREAM = 1000
RATE_STREAM = 10  # rate i draws its token ids from stream RATE_STREAM + i


# ---- the checkpoint --------------------------------------------------------------

@dataclass(frozen=True)
class Setup:
    """What a run serves: the device, the checkpoint and the workload."""

    device: str
    path: str                # the checkpoint (maybe without a tokenizer)
    workload: Workload       # token ids inside the model's vocabulary
    vocab_size: int
    options: dict[str, Any]  # engine options of the server and the offline LLM



def has_tokenizer(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f))
               for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def is_model_file(name: str) -> bool:
    """What the engine reads of a checkpoint: its config and weights (no tokenizer file)."""
    return (name in ("config.json", "generation_config.json")
            or name.endswith((".safetensors", ".safetensors.index.json")))


def write_word_tokenizer(path: str, vocab_size: int) -> None:
    """A fast word-level tokenizer in ``path`` that decodes id ``i`` as ``t<i>`` (joined by
    spaces), with no special tokens: every id has text of its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast",
                   "clean_up_tokenization_spaces": False}, f)


def with_tokenizer(path: str, vocab_size: int, choice: str, scratch: str) -> str:
    """``path`` if it has a tokenizer and ``choice`` is ``auto``; else ``scratch``, holding
    links to its model files and the synthetic tokenizer (the checkpoint stays as it is)."""
    if choice == "auto" and has_tokenizer(path):
        return path
    for name in filter(is_model_file, os.listdir(path)):
        os.symlink(os.path.abspath(os.path.join(path, name)), os.path.join(scratch, name))
    write_word_tokenizer(scratch, vocab_size)
    print(f"serving {path} with a synthetic word-level tokenizer of {vocab_size} ids", flush=True)
    return scratch


# ---- the server process ----------------------------------------------------------

def engine_options(args: argparse.Namespace, max_model_len: int) -> dict[str, Any]:
    """Engine options shared by the server (as CLI flags) and the offline ``LLM``; the step
    budget is named, since the two defaults differ (serve 8192, ``LLM`` on CUDA 16384)."""
    opts: dict[str, Any] = dict(max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens)
    if args.enforce_eager:
        opts["enforce_eager"] = True
    if args.load_format != "auto":
        opts["load_format"] = args.load_format
    return opts


def cli_flags(opts: dict[str, Any]) -> list[str]:
    """``{"max_num_seqs": 8, "enforce_eager": True}`` -> ``--max-num-seqs 8 --enforce-eager``."""
    flags: list[str] = []
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def _die_with_parent() -> None:
    """In a child process (server, client): SIGTERM it when the benchmark dies, however it
    dies (Linux only; elsewhere the benchmark's own teardown has to do)."""
    if sys.platform != "linux":
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ServerProcess:
    """``python -m minivllm serve`` in its own process group; ``stop()`` ends the group.

    Args:
        model: checkpoint directory (with a tokenizer).
        port: the port to bind on 127.0.0.1.
        device, seed: the server's ``--device`` and ``--seed``.
        options: engine options (``engine_options``).
        log_path: the server's stdout and stderr go here.
    """

    def __init__(self, model: str, port: int, device: str, seed: int, options: dict[str, Any],
                 log_path: str, engine_process: bool = True) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "minivllm", "serve", model, "--host", "127.0.0.1",
               "--port", str(port), "--device", device, "--seed", str(seed), *cli_flags(options),
               "--engine-process" if engine_process else "--no-engine-process"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p))
        print("server:", " ".join(cmd), flush=True)
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, preexec_fn=_die_with_parent)

    def wait_healthy(self, timeout: float) -> float:
        """Poll ``/health`` until it answers 200; returns the seconds it took.

        Raises:
            RuntimeError: the server exited or ``timeout`` passed first (its log tail attached).
        """
        import httpx

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {timeout:.0f}s\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the group (uvicorn shuts down, the engine closes), SIGKILL after ``grace``;
        returns once the server has exited, so its GPU memory is free."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                print(f"server still up {grace:.0f}s after SIGTERM: SIGKILL", flush=True)
        _signal_group(self.proc.pid, signal.SIGKILL)  # stragglers of the group (TP workers)
        self.proc.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # the group is gone already


def server_counters(url: str) -> dict[str, float]:
    """The server's ``/metrics`` counters (``minivllm_*_total``, labels kept in the name,
    prefix dropped); empty when ``/metrics`` does not answer 200 (a diagnostic only)."""
    import httpx

    resp = httpx.get(url + "/metrics", timeout=10.0)
    if resp.status_code != 200:
        return {}
    counters = {}
    for line in resp.text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("minivllm_") and name.split("{")[0].endswith("_total"):
            counters[name.removeprefix("minivllm_")] = float(value)
    return counters


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if k in before}


# ---- the client ------------------------------------------------------------------

@dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one streamed request (times: ``time.perf_counter()`` s).

    Attributes:
        scheduled: when the arrival process wanted it sent.
        sent: when the POST began.
        chunk_times: arrival of each SSE chunk of the completion (not ``[DONE]``).
        num_output_tokens: the request's max_tokens when it finished by length; else 0.
        error: None, or why the request failed.
    """

    scheduled: float
    sent: float
    chunk_times: tuple[float, ...]
    num_output_tokens: int
    error: str | None


class _SSEState:
    """The chunks of one response stream as they arrive."""

    def __init__(self) -> None:
        self.buffer = b""
        self.times: list[float] = []
        self.finish_reason: str | None = None
        self.completion_tokens: int | None = None  # from the usage chunk, if the server sent one
        self.error: str | None = None
        self.ended = False  # [DONE] seen

    def feed(self, data: bytes, now: float) -> None:
        self.buffer += data
        *events, self.buffer = self.buffer.split(b"\n\n")
        for event in events:
            self._event(event.strip(), now)

    def _event(self, event: bytes, now: float) -> None:
        if not event.startswith(b"data: "):
            return  # an SSE comment or keep-alive
        payload = event[len(b"data: "):]
        if payload == b"[DONE]":
            self.ended = True
            return
        body = json.loads(payload)
        if "error" in body:
            self.error = f"error event: {body['error'].get('message')}"
            return
        if body.get("usage"):
            self.completion_tokens = body["usage"]["completion_tokens"]
        if not body["choices"]:
            return  # the usage chunk of stream_options.include_usage
        self.times.append(now)
        self.finish_reason = body["choices"][0]["finish_reason"] or self.finish_reason


def request_body(prompt: list[int], max_tokens: int, include_usage: bool) -> dict[str, Any]:
    body: dict[str, Any] = dict(prompt=prompt, max_tokens=max_tokens, temperature=1.0,
                                ignore_eos=True, stream=True)
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


async def stream_request(client: Any, at: float, body: dict[str, Any]) -> RequestRecord:
    """Wait until ``at``, then stream one completion and record its chunks' arrivals."""
    import httpx

    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    sent, state = time.perf_counter(), _SSEState()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                state.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
            else:
                async for data in resp.aiter_bytes():
                    state.feed(data, time.perf_counter())
    except (httpx.HTTPError, ValueError) as e:  # transport failure, or a chunk that is not JSON
        state.error = f"{type(e).__name__}: {e}"
    return _record(state, at, sent, body["max_tokens"])


def _record(state: _SSEState, at: float, sent: float, max_tokens: int) -> RequestRecord:
    error = state.error
    if error is None and state.completion_tokens not in (None, max_tokens):
        error = f"usage says {state.completion_tokens} completion tokens, expected {max_tokens}"
    if error is None and not state.ended:
        error = "stream ended without [DONE]"
    if error is None and state.finish_reason != "length":
        error = f"finish_reason {state.finish_reason!r}, expected 'length' (eos is ignored)"
    if error is None and not state.times:
        error = "no chunk"
    return RequestRecord(at, sent, tuple(state.times), 0 if error else max_tokens, error)


async def run_requests(url: str, bodies: list[dict[str, Any]], starts: list[float],
                       timeout: float) -> list[RequestRecord]:
    """Send request i at ``time.perf_counter() == starts[i]``; every request's record."""
    import httpx

    # One connection per request in flight: a pool limit would queue requests in the client.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, limits=limits,
                                 timeout=httpx.Timeout(timeout, connect=30.0)) as client:
        return list(await asyncio.gather(*(
            stream_request(client, at, body) for at, body in zip(starts, bodies))))


def client_share(url: str, bodies: list[dict[str, Any]], starts: list[float], timeout: float
                 ) -> tuple[list[RequestRecord], float]:
    """One client process's requests: their records and the process's CPU seconds."""
    cpu0 = time.process_time()
    records = asyncio.run(run_requests(url, bodies, starts, timeout))
    return records, time.process_time() - cpu0


class Client:
    """Sends requests from ``procs`` processes, request i from process ``i % procs``.

    One asyncio process parses every SSE chunk in Python (h11, JSON): at a few
    hundred concurrent streams that is a whole core, and a busy client delays the
    arrival times it records. ``time.perf_counter()`` is the system's monotonic
    clock, so the processes' times compare. ``procs`` 1 runs in this process.
    """

    LEAD_S = 0.2  # the first request leaves this long after run(): time to hand out the work

    def __init__(self, url: str, procs: int, timeout: float) -> None:
        self.url, self.procs, self.timeout = url, procs, timeout
        self.pool = (multiprocessing.get_context("spawn").Pool(procs, _die_with_parent)
                     if procs > 1 else None)

    def run(self, bodies: list[dict[str, Any]], arrivals: np.ndarray
            ) -> tuple[list[RequestRecord], float]:
        """Request i sent ``arrivals[i]`` s after the start; the records in request order,
        and the client processes' CPU seconds."""
        t0 = time.perf_counter() + self.LEAD_S
        starts = [t0 + float(a) for a in arrivals]
        if self.pool is None:
            return client_share(self.url, bodies, starts, self.timeout)
        shares = [self.pool.apply_async(client_share, (self.url, bodies[k::self.procs],
                                                       starts[k::self.procs], self.timeout))
                  for k in range(self.procs)]
        records: list[Any] = [None] * len(bodies)
        cpu = 0.0
        for k, share_result in enumerate(shares):
            share, share_cpu = share_result.get()
            records[k::self.procs] = share
            cpu += share_cpu
        return records, cpu

    def close(self) -> None:
        """End the client processes, also in the middle of a run (after an error)."""
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Send times (s) of ``n`` requests: 0, then exponential gaps of mean 1/rate; all 0 at inf."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.exponential(1.0 / rate, n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def requests_at(rate: float, n: int, max_duration: float) -> int:
    """How many of the workload's requests a rate sends: all at inf, else those arriving
    within about ``max_duration`` seconds."""
    return n if math.isinf(rate) else max(1, min(n, int(rate * max_duration)))


# ---- metrics ---------------------------------------------------------------------

def _percentiles_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    a = np.asarray(values) * 1e3
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "mean": float(a.mean())}


def summarize(rate: float, records: list[RequestRecord], client_cpu_s: float,
              client_procs: int) -> dict[str, Any]:
    """The per-rate metrics of the module docstring (times in ms, rates per second)."""
    ok = [r for r in records if r.error is None]
    start = min(r.sent for r in records)
    end = max((r.chunk_times[-1] for r in ok), default=start)
    duration = max(end - start, 1e-9)
    tokens = sum(r.num_output_tokens for r in ok)
    tpot = [(r.chunk_times[-1] - r.chunk_times[0]) / (r.num_output_tokens - 1)
            for r in ok if r.num_output_tokens > 1]
    itl = [float(g) for r in ok for g in np.diff(r.chunk_times)]
    errors = sorted({r.error for r in records if r.error is not None})
    return dict(rate=rate_label(rate), requests=len(records), completed=len(ok),
                failures=len(records) - len(ok), errors=errors[:5], duration_s=duration,
                request_throughput=len(ok) / duration, output_tokens=tokens,
                output_tok_s=tokens / duration, chunks=sum(len(r.chunk_times) for r in ok),
                ttft_ms=_percentiles_ms([r.chunk_times[0] - r.sent for r in ok]),
                tpot_ms=_percentiles_ms(tpot), itl_ms=_percentiles_ms(itl),
                send_lag_ms=_percentiles_ms([r.sent - r.scheduled for r in records]),
                client_cpu_s=client_cpu_s, client_procs=client_procs)


def run_rate(client: Client, wl: Workload, index: int, rate: float, include_usage: bool,
             args: argparse.Namespace) -> dict[str, Any]:
    """One rate: its requests, their metrics, and the server's counters over the run."""
    n = requests_at(rate, len(wl.prompt_lens), args.max_duration)
    bodies = [request_body(p, m, include_usage)
              for p, m in zip(wl.prompts(stream=RATE_STREAM + index, n=n), wl.max_tokens)]
    arrivals = poisson_arrivals(n, rate, np.random.default_rng([args.seed, index]))
    before = server_counters(client.url)
    records, cpu = client.run(bodies, arrivals)
    result = summarize(rate, records, cpu, client.procs)
    result["server_counters"] = counter_deltas(before, server_counters(client.url))
    _print_rate(result)
    return result


def _fmt(p: dict[str, float | None]) -> str:
    if p["p50"] is None:
        return "-"
    return f"{p['p50']:.1f}/{p['p99']:.1f}"


def _print_rate(r: dict[str, Any]) -> None:
    steps = r["server_counters"].get("engine_steps_total")
    print(f"rate {r['rate']:>5}: {r['completed']}/{r['requests']} ok in {r['duration_s']:.2f}s, "
          f"{r['request_throughput']:.2f} req/s, {r['output_tok_s']:,.0f} tok/s, TTFT p50/p99 "
          f"{_fmt(r['ttft_ms'])} ms, TPOT {_fmt(r['tpot_ms'])} ms, ITL {_fmt(r['itl_ms'])} ms "
          f"(server steps {'?' if steps is None else f'{steps:.0f}'}, "
          f"client CPU {r['client_cpu_s']:.1f}s)", flush=True)
    for e in r["errors"]:
        print(f"  error: {e}")
    if r["client_cpu_s"] > 0.8 * r["duration_s"] * r["client_procs"]:
        print("  WARNING: the client was busy most of the run: it may be the bottleneck "
              "(more --client-procs?)")


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'rate':>6} {'reqs':>5} {'fail':>4} {'dur s':>7} {'req/s':>7} {'tok/s':>8} "
          f"{'TTFT p50/p99 ms':>18} {'TPOT p50/p99 ms':>16} {'ITL p50/p99 ms':>16}")
    for r in rows:
        print(f"{r['rate']:>6} {r['requests']:>5} {r['failures']:>4} {r['duration_s']:>7.2f} "
              f"{r['request_throughput']:>7.2f} {r['output_tok_s']:>8,.0f} "
              f"{_fmt(r['ttft_ms']):>18} {_fmt(r['tpot_ms']):>16} {_fmt(r['itl_ms']):>16}")


# ---- the runs --------------------------------------------------------------------

def supports_usage(url: str, prompt: list[int]) -> bool:
    """Whether the server takes ``stream_options.include_usage`` (an older one answers 400)."""
    import httpx

    resp = httpx.post(url + "/v1/completions", json=request_body(prompt, 2, True), timeout=60.0)
    if resp.status_code == 400 and "stream_options" in resp.text:
        return False
    resp.raise_for_status()
    return True


def warm_up(client: Client, wl: Workload, include_usage: bool) -> None:
    """Untimed short requests at once (Triton compiles, client processes, connections)."""
    n = min(64, len(wl.prompt_lens))
    prompts = wl.prompts(stream=WARMUP_STREAM, n=n)
    bodies = [request_body(p, min(m, 16), include_usage) for p, m in zip(prompts, wl.max_tokens)]
    t0 = time.perf_counter()
    records, _ = client.run(bodies, np.zeros(n))
    failed = [r.error for r in records if r.error is not None]
    if failed:
        raise RuntimeError(f"warm-up: {len(failed)}/{n} requests failed, e.g. {failed[0]}")
    print(f"warm-up: {n} requests in {time.perf_counter() - t0:.1f}s", flush=True)


def run_server(args: argparse.Namespace, served: str, su: Setup, scratch: str
               ) -> dict[str, Any]:
    """Start the server on checkpoint ``served``, run every rate, stop it (on any error too)."""
    wl = su.workload
    server = ServerProcess(served, args.port or free_port(), su.device, args.seed, su.options,
                           os.path.join(scratch, "server.log"), engine_process=args.engine_process)
    client: Client | None = None
    try:
        client = Client(server.url, args.client_procs, args.request_timeout)
        print(f"server healthy after {server.wait_healthy(args.startup_timeout):.1f}s", flush=True)
        usage = supports_usage(server.url, wl.prompts(stream=WARMUP_STREAM, n=1)[0])
        print(f"output tokens checked against {'the usage chunk' if usage else 'max_tokens'}; "
              f"{args.client_procs} client process(es)", flush=True)
        warm_up(client, wl, usage)
        rows = [run_rate(client, wl, i, rate, usage, args) for i, rate in enumerate(args.rates)]
    except BaseException:
        print(f"---- server log tail ----\n{server.log_tail()}", flush=True)
        raise
    finally:
        server.stop()   # first: it ends any stream still open, on any path
        if client is not None:
            client.close()
    return {"rates": rows, "usage_from_server": usage}


def run_offline_llm(args: argparse.Namespace, su: Setup) -> dict[str, Any]:
    """The ``inf`` run's requests through ``LLM.generate()`` in this process."""
    from minivllm import LLM

    inf_index = [math.isinf(r) for r in args.rates].index(True)
    with LLM(su.path, device=su.device, seed=args.seed, skip_tokenizer_init=True,
             **su.options) as llm:
        return run_offline(llm, su.workload, stream=RATE_STREAM + inf_index,
                           label="offline generate()")


def compare(results: dict[str, Any]) -> None:
    inf = [r for r in results["rates"] if r["rate"] == "inf"]
    offline = results.get("offline")
    if not inf or offline is None:
        return
    ratio = inf[0]["output_tok_s"] / offline["tok_s"]
    results["ratio_server_offline"] = ratio
    print(f"server at rate inf: {inf[0]['output_tok_s']:,.0f} tok/s; offline generate(): "
          f"{offline['tok_s']:,.0f} tok/s; ratio {ratio:.3f} (target >= {TARGET_RATIO}) "
          f"{met(ratio, TARGET_RATIO)}")


# ---- main ------------------------------------------------------------------------

def rate_label(rate: float) -> str:
    """4.0 -> "4", inf -> "inf"."""
    return f"{rate:g}"


def parse_rates(text: str) -> list[float]:
    """``"8,32,inf"`` -> ``[8.0, 32.0, inf]``.

    Raises:
        ValueError: an entry that is not a positive number or ``inf``.
    """
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            rate = math.nan
        if not rate > 0:
            raise ValueError(f"--rates: {part!r} is not a positive number or inf")
        rates.append(rate)
    return rates


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: random Qwen3-0.6B)")
    ap.add_argument("--device", default="auto", help="auto (cuda; --smoke: cpu), cuda or cpu")
    ap.add_argument("--rates", default="8,32,128,inf",
                    help="requests/s, comma list; inf: all at once")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-duration", type=float, default=20.0,
                    help="a finite rate sends the requests of about this many seconds")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="step budget of both the server and offline generate() (serve's default)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                    help="serve with the engine in its own process (serve's default; "
                         "--no-engine-process: in the server's thread)")
    ap.add_argument("--client-procs", type=int, default=None,
                    help="client processes (default: 4 on cuda, 1 on cpu)")
    ap.add_argument("--tokenizer", choices=("auto", "synthetic"), default="auto",
                    help="auto: the checkpoint's own, synthetic when it has none")
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=600.0,
                    help="seconds without a byte before a request fails")
    ap.add_argument("--out", default=None,
                    help="write the JSON summary here (default: $OUT/serving.json when OUT is set)")
    args = ap.parse_args(argv)
    try:
        args.rates = parse_rates(args.rates)
    except ValueError as e:
        ap.error(str(e))
    if args.num_requests < 1 or args.max_duration <= 0:
        ap.error("--num-requests must be >= 1 and --max-duration > 0")
    if args.client_procs is not None and args.client_procs < 1:
        ap.error("--client-procs must be >= 1")
    return args


def setup(args: argparse.Namespace) -> Setup:
    """Device, checkpoint (written once unless --model), workload and engine options."""
    from minivllm.config import ModelConfig

    device = bench_device(args) if args.device == "auto" else args.device
    small = args.smoke or device == "cpu"
    if args.client_procs is None:
        args.client_procs = 1 if device == "cpu" else 4
    path = args.model or model_path(args)
    cfg = ModelConfig.from_hf_json(path)
    wl = offline_workload(args.num_requests, args.seed, small)
    wl = dataclasses.replace(wl, id_limit=min(wl.id_limit, cfg.vocab_size))
    max_model_len = min(64 if small else 2048, cfg.max_position_embeddings)
    return Setup(device, path, wl, cfg.vocab_size, engine_options(args, max_model_len))


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally that stops the server


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    su = setup(args)
    wl = su.workload
    print(f"serving: {len(wl.prompt_lens)} requests ({sum(wl.prompt_lens)} prompt, "
          f"{sum(wl.max_tokens)} completion tokens), rates {args.rates}, device {su.device}, "
          f"engine options {su.options}", flush=True)
    results: dict[str, Any] = {"args": dict(vars(args), rates=[rate_label(r) for r in args.rates]),
                               "workload": f"offline-{args.num_requests}",
                               "engine_options": su.options}
    with tempfile.TemporaryDirectory(prefix="minivllm-serving-") as scratch:
        served = with_tokenizer(su.path, su.vocab_size, args.tokenizer, scratch)
        results.update(run_server(args, served, su, scratch))
    print_table(results["rates"])
    if any(math.isinf(r) for r in args.rates):
        results["offline"] = run_offline_llm(args, su)
        compare(results)
    # --out instead of $OUT/serving.json: two runs in one $OUT must not overwrite each other
    write_summary("serving", results, path=args.out)
    if any(r["failures"] for r in results["rates"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
