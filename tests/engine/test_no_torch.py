"""The engine core and the simulator run with torch made unimportable; the product never
imports the simulator."""

from __future__ import annotations

import ast
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


def sim_imports(path: Path) -> list[str]:
    """``file:line`` of every import of ``sim`` in ``path``, function-level ones included."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            names = [node.module]
        else:
            continue
        if any(n == "sim" or n.startswith("sim.") for n in names):
            hits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return hits


def test_the_product_never_imports_the_simulator() -> None:
    """``sim/`` is the product's verification harness: what both need (the trace format and
    its recorder) lives in ``minivllm.engine.trace``, and ``sim/`` imports it from there."""
    files = sorted((ROOT / "minivllm").rglob("*.py"))
    assert len(files) > 20
    hits = [h for f in files for h in sim_imports(f)]
    assert not hits, f"minivllm/ imports sim/ at {hits}"
