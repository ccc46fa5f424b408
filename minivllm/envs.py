"""Every environment variable minivllm reads, with its meaning, in one place.

Settings are config fields (``minivllm/config.py``); these few come from the environment
because they concern the process, not the engine. Each is read when it is needed, through
the function beside it, never at import.
"""

from __future__ import annotations

import os

# API key the OpenAI-compatible server requires (``Authorization: Bearer KEY``) when
# ``--api-key`` is not given; unset: no key.
API_KEY = "MINIVLLM_API_KEY"
# Seconds a tensor-parallel collective or start-up may wait for a peer before it is an
# error (default 300: generous for slow CPUs).
TP_TIMEOUT_S = "MINIVLLM_TP_TIMEOUT_S"
# Triton's own switch, read here too: "1" runs Triton kernels on the CPU through its
# interpreter (how the CPU tests run them).
TRITON_INTERPRET = "TRITON_INTERPRET"
# OpenMP's own thread count, read here too: set, the server's engine process and the chat
# command keep the torch thread count it gives instead of sizing it from the CPUs they may use.
OMP_NUM_THREADS = "OMP_NUM_THREADS"

DEFAULT_TP_TIMEOUT_S = 300.0


def api_key() -> str | None:
    """The server's API key from the environment, or None."""
    return os.environ.get(API_KEY) or None


def tp_timeout_s() -> float:
    """``MINIVLLM_TP_TIMEOUT_S`` as seconds (default 300).

    Raises:
        ValueError: not a positive number.
    """
    raw = os.environ.get(TP_TIMEOUT_S)
    if raw is None:
        return DEFAULT_TP_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TP_TIMEOUT_S} must be a positive number of seconds, got {raw!r}")
    return value


def omp_num_threads_set() -> bool:
    """Whether the user chose OpenMP's (and so torch's) thread count with ``OMP_NUM_THREADS``."""
    return bool(os.environ.get(OMP_NUM_THREADS))


def triton_interpreted() -> bool:
    """Whether Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get(TRITON_INTERPRET) == "1"
