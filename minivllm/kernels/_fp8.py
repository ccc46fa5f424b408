"""The FP8 KV cache's number format, shared by the kernels that write and read it.

An FP8 cache holds e4m3 values (``torch.float8_e4m3fn``: 3 mantissa bits, largest finite
448, no infinities) of each K (V) element divided by the layer's per-tensor scale::

    stored = e4m3(clamp(x / k_scale, -448, 448))     round to nearest, ties to even
    read   = stored * k_scale                          in the attention kernels' registers

An e4m3 value converts to bf16, fp16 and fp32 exactly, so the readers turn the stored
values into the model's dtype before their dots and fold the scales outside them: the
K scale into the softmax scale, the V scale into the normalised output.

The scales are one-element float32 tensors on the device (1.0 unless the checkpoint gives
``k_scale`` / ``v_scale``): kernels load them, so nothing is read on the host and a CUDA
graph keeps reading the current value.

Torch reference: :func:`minivllm.kernels.reference.quantize_kv_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, check_same_device

KV_FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0


@triton.jit
def quantize_e4m3(x, scale):
    """e4m3 of ``x / scale`` (correctly rounded fp32 division), saturated at +-448, rounded
    to nearest even by ``round_to_e4m3``."""
    y = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -448.0, 448.0)
    return round_to_e4m3(y).to(tl.float8e4nv)


@triton.jit
def round_to_e4m3(y):
    """fp32 ``y`` (|y| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32,
    so that the cast to e4m3 after it is exact.

    Why not the cast alone: the GPU's conversion rounds so, but Triton's CPU interpreter,
    which the tests run, does not (seen on triton 3.9: a value rounded up across a power of
    two loses its carry, 1.97 becoming 1.0). Rounding first makes both devices run the same
    arithmetic: with e = max(exponent of |y|, -6) (e4m3's subnormals share exponent -6) the
    e4m3 values near y are the multiples of 2^(e - 3); |y| / 2^(e - 3) is exact, and adding
    and subtracting 2^23 rounds it to an integer, ties to even, as IEEE fp32 addition rounds."""
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)           # 2^(e - 3), exact
    inv_step = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)
    r = (tl.abs(y) * inv_step + 8388608.0) - 8388608.0
    magnitude = (r * step).to(tl.int32, bitcast=True)
    return (magnitude | (bits & -2147483648)).to(tl.float32, bitcast=True)  # y's sign bit


def is_fp8_cache(cache: torch.Tensor) -> bool:
    """Whether ``cache`` holds FP8 values (module doc)."""
    return cache.dtype == KV_FP8_DTYPE


def check_kv_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales a kernel passes for this cache: for an FP8 cache, ``k_scale`` and
    ``v_scale`` themselves, which must be one-element float32 tensors on the cache's
    device; for any other cache they are not read, and the cache itself stands in.

    Raises:
        ValueError: an FP8 cache without both scales, or scales not of one element.
        TypeError: scales not float32.
    """
    if not is_fp8_cache(k_cache):
        return k_cache, k_cache
    if k_scale is None or v_scale is None:
        raise ValueError("an fp8 KV cache needs k_scale and v_scale (one-element float32 tensors)")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_dtype(name, t, (torch.float32,))
        if t.numel() != 1:
            raise ValueError(f"{name} must hold one element, got shape {tuple(t.shape)}")
    check_same_device(k_cache=k_cache, k_scale=k_scale, v_scale=v_scale)
    return k_scale, v_scale
