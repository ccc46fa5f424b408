"""Fusing small element-wise functions on CUDA with ``torch.compile``.

A Qwen3 layer run op by op launches about 70 kernels, most of them tiny
element-wise ones (the norms' pow/mean/rsqrt/mul, RoPE's halves, SiLU-and-mul).
At small batches their launch cost, not arithmetic or bandwidth, sets the step
time, even inside a CUDA graph (a graph node still costs ~1-2 us). Compiling
each of these pure functions once fuses it into one or two kernels.

Only CUDA inputs take the compiled path: on the CPU the plain function runs (no
compiler needed in CI, and the CPU parity tests check the same function).
``MINIVLLM_COMPILE=0`` turns fusion off, for these and for the hand-written
Triton kernels that replaced the hottest of them (``use_kernels``).

Where host time matters, a hand-written kernel beats a compiled function: with
dynamic shapes each call of a compiled function cost 100-160 µs of host time on
the H200 machine (guards over symbolic sizes, the wrapper computing the grid),
a Triton launch 60-90 µs. Outside a CUDA graph (prefill, mixed steps) that host
time, not the GPU's, sets the step's length, so RMSNorm (with its residual add)
and SiLU-and-mul call kernels (``minivllm/kernels/rms_norm.py``,
``silu_and_mul.py``) through ``use_kernels``; the compiled path remains for the
q/k norm + RoPE of the unfused attention path.

Rounding: the functions cast to the model dtype where Hugging Face's Qwen3 does
(RMSNorm rounds the normalised value before the weight multiply, SiLU rounds
before the multiply by ``up``, ...). By default inductor computes a fused chain
of bf16 ops in fp32 and drops those intermediate roundings
(``torch._inductor.config.emulate_precision_casts``, default False in torch
2.13), so the compiled CUDA function would round differently from the eager
one the CPU tests check. Each function is therefore compiled with that option
on: it rounds where its eager code rounds (on CPU inductor: bit-identical to
eager for rms_norm, silu_and_mul and qk_norm_rope, add_rms_norm within one bf16
ulp from the reduction order). Dropping the roundings is not a precision loss
(it is slightly closer to fp32: about 2% of the bf16-vs-fp32 logits error on a
4-layer Qwen3-0.6B-wide model), so the option buys consistency, not accuracy.
"""

from __future__ import annotations

import functools
import os
from types import MappingProxyType
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., torch.Tensor])

# Inductor options of every fused function (per function: the global config is untouched).
INDUCTOR_OPTIONS = MappingProxyType({"emulate_precision_casts": True})

COMPILE_ENV = "MINIVLLM_COMPILE"  # "0": no fusion, compiled or hand-written (module doc)


def compile_fused(fn: F) -> F:
    """``fn`` compiled as ``fused`` compiles it: dynamic shapes, one graph, eager's roundings."""
    return torch.compile(fn, dynamic=True, fullgraph=True, options=dict(INDUCTOR_OPTIONS))  # type: ignore[return-value]


def fused(fn: F) -> F:
    """``fn`` compiled (dynamic shapes) for CUDA tensors, as written elsewhere."""
    compiled: list[Callable] = []

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args, **kwargs):
        if x.device.type != "cuda" or os.environ.get(COMPILE_ENV, "1") == "0":
            return fn(x, *args, **kwargs)
        if not compiled:  # compiled on first CUDA use: no import-time side effects
            compiled.append(compile_fused(fn))
        return compiled[0](x, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def use_kernels(x: torch.Tensor) -> bool:
    """Whether a layer calls its Triton kernel for ``x`` rather than its torch reference:
    CUDA tensors, unless ``MINIVLLM_COMPILE=0`` (tests force it on the CPU interpreter)."""
    return x.device.type == "cuda" and os.environ.get(COMPILE_ENV, "1") != "0"
