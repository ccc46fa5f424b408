"""GPU time per call inside a CUDA graph, the way a captured decode step runs it.

``graph_us(call, calls)`` warms ``call`` up on a side stream (compilation, autotuning,
lazy allocations stay out of the capture), captures ``call(0) .. call(calls - 1)`` in
one graph, replays it once untimed, then times ``replays`` replays with CUDA events and
returns the median per call, in us. ``before_replay`` runs before each timed replay
(a barrier, when the calls talk to other processes).
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch


def graph_us(call: Callable[[int], Any], calls: int, replays: int = 20,
             before_replay: Callable[[], None] | None = None) -> float:
    """Median GPU us per call of ``call(i)``, i in ``range(calls)``, captured in one graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(calls):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    graph.replay()
    times = []
    for _ in range(replays):
        torch.cuda.synchronize()
        if before_replay is not None:
            before_replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)
