"""GPU suite guard: without a CUDA device (or with the Triton interpreter forced on)
`make test-gpu` stops before collecting anything, with a plain message and a failing
exit code, instead of skipping quietly and reporting success."""

import os

import pytest

try:
    import torch
except ImportError as e:  # fail with a plain message, not a conftest traceback
    raise pytest.UsageError(f"tests_gpu needs torch with CUDA ({e})") from e


def pytest_configure(config: pytest.Config) -> None:
    """Refuse to run the GPU suite where it cannot mean anything."""
    if not torch.cuda.is_available():
        raise pytest.UsageError(
            "tests_gpu needs a CUDA device, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}). "
            "Run `make test-gpu` on the GPU machine.")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise pytest.UsageError("tests_gpu runs compiled Triton kernels: unset TRITON_INTERPRET")
