"""The engine core and the simulator run with torch made unimportable (that the product never
imports the simulator is checked with the other import rules, in ``tests/test_layout.py``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import importlib.abc
    import sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this test (import of {name!r})")
            return None

    sys.meta_path.insert(0, NoTorch())
    import minivllm.engine.llm_engine
    import minivllm.engine.trace
    import minivllm.executor.inputs
    import sim
    import sim.__main__
    from sim.runner import run_trace
    from sim.traces import generate_trace

    for seed in range(5):
        result = run_trace(generate_trace(seed))
        assert result.ok, result.violations
    assert sim.__main__.main(["run", "--traces", "5", "--seed", "1", "--quiet"]) == 0
    assert "torch" not in sys.modules, "torch was imported"
    print("NO-TORCH-OK")
""")


def test_engine_and_sim_run_without_torch() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NO-TORCH-OK" in proc.stdout

