"""GPU timing shared by the benchmarks: calls replayed from a CUDA graph, as a captured
decode step runs them, and the device's copy bandwidth, the ceiling that bandwidth-bound
kernels are compared with.

``graph_us(call, calls)`` warms ``call`` up on a side stream (compilation, autotuning and
lazy allocations stay out of the capture), captures ``call(0) .. call(calls - 1)`` in one
graph, replays it once untimed, then times ``replays`` replays with CUDA events and returns
the median per call, in us. ``capture_graph`` and ``replay_us`` are its two halves, for a
benchmark that fills static buffers between capture and replay.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


def capture_graph(call: Callable[[int], Any], calls: int) -> tuple[torch.cuda.CUDAGraph, list[Any]]:
    """A graph of ``call(0) .. call(calls - 1)``, after one warm-up of each on a side stream;
    also what each captured call returned (graph-pool memory, rewritten by every replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(calls):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [call(i) for i in range(calls)]
    return graph, outputs


def replay_us(graph: torch.cuda.CUDAGraph, calls: int = 1, replays: int = 20,
              before_replay: Callable[[], None] | None = None) -> float:
    """Median GPU us per call over ``replays`` timed replays of ``graph`` (which holds
    ``calls`` calls), after one untimed replay. ``before_replay`` runs before each timed
    replay (a barrier, when the calls talk to other processes)."""
    graph.replay()
    times = []
    for _ in range(replays):
        torch.cuda.synchronize()
        if before_replay is not None:
            before_replay()
        times.append(_cuda_seconds(graph.replay) * 1e6 / calls)
    return statistics.median(times)


def graph_us(call: Callable[[int], Any], calls: int, replays: int = 20,
             before_replay: Callable[[], None] | None = None) -> float:
    """Median GPU us per call of ``call(i)``, i in ``range(calls)``, captured in one graph."""
    graph, _ = capture_graph(call, calls)
    us = replay_us(graph, calls, replays, before_replay)
    del graph
    return us


def copy_bandwidth_gbs(device: str = "cuda", nbytes: int = 1 << 30, iters: int = 20) -> float:
    """GB/s of a device-to-device ``copy_`` of ``nbytes``, counting bytes read + written
    (median of ``iters``). 1 GiB is far beyond L2, so it is the memory's rate; on the CPU
    (smoke runs) a smaller ``nbytes`` keeps it quick."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = _cuda_seconds if torch.device(device).type == "cuda" else _host_seconds
    return 2 * nbytes / statistics.median(seconds(lambda: dst.copy_(src)) for _ in range(iters)) / 1e9


def _cuda_seconds(fn: Callable[[], Any]) -> float:
    """Seconds of GPU time of ``fn()``, between two CUDA events."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _host_seconds(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
