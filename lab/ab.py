"""A/B timing shared by the experiments: each variant's graph time, the variants in turn."""

from __future__ import annotations

from typing import Any, Callable

from benchmarks.gpu_timing import graph_us


def alternating_medians(variants: dict[str, Callable[[int], Any]], calls: int, rounds: int = 3) -> dict[str, float]:
    """Median graph us per call of each variant over ``rounds`` rounds, the variants timed in
    turn within each round (so that a drift of the device's clock reaches all of them)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(graph_us(fn, calls))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}
