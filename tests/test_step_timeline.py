"""benchmarks/step_timeline.py's arithmetic: steps grouped by kind and batch, and the
bandwidth floor of each step (its K/V and the weights read once)."""

from __future__ import annotations

import numpy as np

from benchmarks.step_timeline import floor_ms, summarise


def test_groups_and_floor() -> None:
    rows = [dict(ms=30.0, seqs=15, prefill=8000, decode=0, kv_tokens=8000),
            dict(ms=6.0, seqs=200, prefill=0, decode=200, kv_tokens=200 * 600),
            dict(ms=5.0, seqs=193, prefill=0, decode=193, kv_tokens=193 * 600),
            dict(ms=2.0, seqs=4, prefill=0, decode=4, kv_tokens=4 * 900)]
    floor = floor_ms(rows, kv_bytes_per_token=1000, weight_bytes=10**9, gbs=1000.0)
    # 1 GB of weights at 1000 GB/s is 1 ms; each K/V token adds 1000 B = 1 ns.
    assert np.allclose(floor, [1.008, 1.12, 1.1158, 1.0036])
    groups = {g["group"]: g for g in summarise(rows, floor)}
    assert groups["steps with prefill"]["steps"] == 1 and groups["steps with prefill"]["seconds"] == 0.03
    top = groups["decode, batch 193-256"]
    assert top["steps"] == 2 and np.isclose(top["seconds"], 0.011) and top["decode_tokens"] == 393
    assert np.isclose(top["floor_seconds"], (1.12 + 1.1158) / 1e3)
    assert groups["decode, batch 1-8"]["steps"] == 1 and groups["decode, batch 9-32"]["steps"] == 0
    assert sum(g["steps"] for g in groups.values()) == len(rows)
