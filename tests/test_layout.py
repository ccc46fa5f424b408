"""Who may import whom. Among the top-level folders: helpers that tests and benchmarks both need
live in ``minivllm/testing.py``, which both import: no benchmark imports the tests, no test
imports a benchmark except the tests of the benchmarks themselves (``tests/benchmarks/``), and
the rest of the package never imports ``minivllm.testing``. Inside the package: ``config.py`` is
the ground floor (it imports nothing of the package), the dispatch point (``minivllm/ops/``) is
the only road to the kernels, and a kernel file gets what it needs as arguments and shares device
helpers through files that launch nothing, never through another kernel file's ``_`` names."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, function-level ones included;
    ``from a import b`` yields ``a.b`` too (``b`` may be a module), relative imports resolved."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, *([base] if base else [])])
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def offending_imports(files: list[Path], forbidden: str) -> list[str]:
    """``file:line module`` of each import statement of ``forbidden`` (or a module under it) in
    ``files``, one entry a statement."""
    hits: dict[str, str] = {}
    for f in files:
        for line, name in imported_modules(f):
            if name == forbidden or name.startswith(forbidden + "."):
                hits.setdefault(f"{f.relative_to(ROOT)}:{line}", name)
    return [f"{where} {name}" for where, name in hits.items()]


def python_files(folder: str, *, outside: str | None = None) -> list[Path]:
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, folder
    return [f for f in files if outside is None or not f.is_relative_to(ROOT / outside)]


def test_benchmarks_never_import_the_tests() -> None:
    files = python_files("benchmarks")
    hits = offending_imports(files, "tests") + offending_imports(files, "tests_gpu")
    assert not hits, f"benchmarks/ imports the tests (move the helper to minivllm/testing.py): {hits}"


def test_tests_import_benchmarks_only_to_test_them() -> None:
    files = python_files("tests", outside="tests/benchmarks") + python_files("tests_gpu")
    hits = offending_imports(files, "benchmarks")
    assert not hits, f"a test outside tests/benchmarks/ imports benchmarks/ (move the helper to " \
                     f"minivllm/testing.py): {hits}"


def test_the_package_never_imports_its_test_helpers() -> None:
    files = [f for f in python_files("minivllm") if f != ROOT / "minivllm" / "testing.py"]
    hits = offending_imports(files, "minivllm.testing")
    assert not hits, f"minivllm/ imports minivllm.testing (for tests, benchmarks, fixtures and lab only): {hits}"


def test_the_product_never_imports_the_simulator() -> None:
    """``sim/`` is the product's verification harness: what both need (the trace format and
    its recorder) lives in ``minivllm.engine.trace``, and ``sim/`` imports it from there."""
    hits = offending_imports(python_files("minivllm"), "sim")
    assert not hits, f"minivllm/ imports sim/: {hits}"


def test_config_is_the_ground_floor() -> None:
    hits = offending_imports([ROOT / "minivllm" / "config.py"], "minivllm")
    assert not hits, f"minivllm/config.py imports the package above it: {hits}"


def test_only_the_dispatch_point_reaches_the_kernels() -> None:
    files = [f for f in python_files("minivllm", outside="minivllm/kernels")
             if not f.is_relative_to(ROOT / "minivllm" / "ops") and f != ROOT / "minivllm" / "testing.py"]
    hits = offending_imports(files, "minivllm.kernels")
    assert not hits, f"only minivllm/ops/ imports minivllm/kernels/ (add the op to Ops): {hits}"


def test_kernel_files_take_their_settings_as_arguments() -> None:
    files = python_files("minivllm/kernels")
    hits = offending_imports(files, "minivllm.config") + offending_imports(files, "minivllm.envs")
    assert not hits, f"a kernel file reads the config or the environment (pass it as an argument): {hits}"


def test_kernel_files_share_device_helpers_only_through_files_that_launch_nothing() -> None:
    """No kernel file imports another kernel file's ``_`` names; helpers shared between kernels
    live in ``_``-named files (such as ``_softmax.py``) and are imported from there."""
    hits = []
    for f in python_files("minivllm/kernels"):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"), str(f))):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            source = node.module.split(".")[-1]
            if (node.module.startswith("minivllm.kernels.") or node.level) and not source.startswith("_"):
                hits += [f"{f.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}"
                         for a in node.names if a.name.startswith("_")]
    assert not hits, f"a kernel file imports another kernel file's private names: {hits}"
