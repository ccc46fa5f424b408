"""Simulator suite setup."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The random-trace suites (``test_random_traces*``: thousands of generated traces through
    the engine) run without the coverage tracer (pytest-cov's ``no_cover``): the coverage
    report misses the same lines without them, and traced they took nearly twice as long."""
    for item in items:
        if HERE in item.path.parents and getattr(item, "originalname", "").startswith("test_random_traces"):
            item.add_marker(pytest.mark.no_cover)
