"""Fixtures of the server tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint directory without weights for the scripted server (``tests/server/scripted.py``)."""
    from tests.server.scripted import write_model_dir
    return write_model_dir(tmp_path_factory.mktemp("scripted-qwen3"))
