"""Fusing small element-wise functions on CUDA with ``torch.compile``.

A Qwen3 layer run op by op launches about 70 kernels, most of them tiny
element-wise ones (the norms' pow/mean/rsqrt/mul, RoPE's halves, SiLU-and-mul).
At small batches their launch cost, not arithmetic or bandwidth, sets the step
time, even inside a CUDA graph (a graph node still costs ~1-2 us). Compiling
each of these pure functions once fuses it into one or two kernels.

Only CUDA inputs take the compiled path: on the CPU the plain function runs (no
compiler needed in CI, and the CPU parity tests check the same function).
``MINIVLLM_COMPILE=0`` turns fusion off.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., torch.Tensor])


def fused(fn: F) -> F:
    """``fn`` compiled (dynamic shapes) for CUDA tensors, as written elsewhere."""
    compiled: list[Callable] = []

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args, **kwargs):
        if x.device.type != "cuda" or os.environ.get("MINIVLLM_COMPILE", "1") == "0":
            return fn(x, *args, **kwargs)
        if not compiled:  # compiled on first CUDA use: no import-time side effects
            compiled.append(torch.compile(fn, dynamic=True, fullgraph=True))
        return compiled[0](x, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
