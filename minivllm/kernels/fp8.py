"""FP8 (e4m3): the one definition of the scales that every 8-bit kernel and its torch
reference follow (the quantize/dequantize halves of the references are here, in torch), the
Triton rounding the kernels share, and the FP8 KV cache's argument checks.

A scale is a dequantization multiplier (a checkpoint's ``weight_scale_inv``):
``v ~= v_fp8.float() * scale``. Each group of values gets one::

    scale = max(amax, AMAX_FLOOR) / 448            float32; 448 = e4m3's largest finite value
    v_fp8 = e4m3(clamp(v * (1 / scale), -448, 448))   round to nearest, ties to even

The reciprocal is taken once per group and multiplied: a kernel that fuses the
activation quantization would otherwise divide every element. ``AMAX_FLOOR`` keeps an
all-zero group finite (scale 2.2e-13, every value 0: no division by zero, no NaN); it
cannot overflow, since a group whose amax is below the floor scales to less than 448.
The clamp catches the last fp32 rounding of ``amax * (1 / scale)`` above 448.

The groups, for W (N, K) and activations x (M, K)::

    block (Qwen3-FP8 checkpoints)       per channel (on-the-fly)     activations
    W   +-------+-------+---+           W  +-------------------+     x  +-------+-------+---+
        |128x128|128x128|   |  s[i, j]     |  row n            | s[n]   |1 x 128|1 x 128|   |  s[m, g]
        +-------+-------+---+              +-------------------+        +-------+-------+---+
        |       |       |   |  edge blocks (N or K not a multiple     per token and 128-column group
        +-------+-------+---+  of 128) take the amax of their part    (block), or the whole row (channel)

    scale_inv (cdiv(N,128), cdiv(K,128))   scale (N,)                 scales (M, cdiv(K,128)) or (M, 1)
"""

from __future__ import annotations

import numbers
from typing import Literal

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, check_last_dim_contiguous, check_power_of_two, check_same_device

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
# Smallest amax a scale is taken from (see the module doc); the kernels use the same value.
AMAX_FLOOR = 1e-10
# The activation group of the FP8 kernels, and the side of the square weight block of their
# "block" scale mode (a checkpoint's block, ``config.FP8_WEIGHT_BLOCK``, must be this square).
FP8_GROUP = 128
# Dtypes quantize_fp8_block stores a weight scale in: float32, or bfloat16 as some published
# Qwen3 FP8 checkpoints store weight_scale_inv (others use float16; its exponent range cannot
# hold every floored scale). The kernels take float32: a loader upcasts, which is exact.
SCALE_DTYPES = (torch.float32, torch.bfloat16)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

ScaleMode = Literal["block", "channel"]
SCALE_MODES: tuple[str, ...] = ("block", "channel")


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The float32 scale of groups whose largest magnitude is ``amax`` (module doc), the
    correctly rounded quotient. Divided by a tensor: torch on CUDA divides by a Python
    number as a multiplication by its rounded reciprocal, one ulp off amax / 448 for many
    amax, which moves the ties of bf16 inputs (common: x * 448 / amax is often short) to
    the other side from the kernels' division."""
    amax = amax.float().clamp(min=AMAX_FLOOR)
    return amax / torch.full_like(amax, FP8_E4M3_MAX)


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int],
                       scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_fp8, scale_inv)`` for w (N, K): one scale per ``block`` = (rows, columns) tile,
    scale_inv (cdiv(N, rows), cdiv(K, columns)) in ``scale_dtype``. With a bfloat16 scale the
    values are quantized with the rounded scale, so ``dequantize_fp8_block`` undoes exactly
    what was stored (an amax element may saturate at 448, 2^-9 below its value at most).

    Raises:
        TypeError: w not float32/bf16/fp16, or a scale dtype not in ``SCALE_DTYPES``.
        ValueError: w not 2-D, or a block that is not two ints >= 1.
    """
    _check_matrix("w", w)
    rows, cols = _check_block(block)
    if scale_dtype not in SCALE_DTYPES:
        raise TypeError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype}")
    n, k = w.shape
    nb, kb = -(-n // rows), -(-k // cols)
    padded = F.pad(w.float().abs(), (0, kb * cols - k, 0, nb * rows - n))
    scale = fp8_scale(padded.view(nb, rows, kb, cols).amax(dim=(1, 3))).to(scale_dtype)
    return quantize_with_scale(w, _expand(scale.float(), rows, cols, n, k)), scale


def dequantize_fp8_block(w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 ``w_fp8 * scale_inv`` with each scale spread over its ``block`` tile.

    Raises:
        TypeError: w_fp8 not float8_e4m3fn, or scale_inv not float32/bf16/fp16.
        ValueError: scale_inv not (cdiv(N, rows), cdiv(K, columns)).
    """
    rows, cols = _check_block(block)
    n, k = _check_fp8("w_fp8", w_fp8)
    _check_scale("scale_inv", scale_inv, (-(-n // rows), -(-k // cols)))
    return w_fp8.float() * _expand(scale_inv.float(), rows, cols, n, k)


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_fp8, scale)`` for w (N, K): one float32 scale per output channel (row), (N,).

    Raises:
        TypeError, ValueError: as :func:`quantize_fp8_block`.
    """
    _check_matrix("w", w)
    w_fp8, scale = quantize_fp8_block(w, (1, max(w.shape[1], 1)))
    return w_fp8, scale.view(-1)


def dequantize_fp8_per_channel(w_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``w_fp8 * scale[:, None]`` for a per-channel scale (N,).

    Raises:
        TypeError: w_fp8 not float8_e4m3fn, or scale not float32/bf16/fp16.
        ValueError: scale not (N,).
    """
    n, _ = _check_fp8("w_fp8", w_fp8)
    _check_scale("scale", scale, (n,))
    return w_fp8.float() * scale.float()[:, None]


def dequantize_fp8_weight(w_fp8: torch.Tensor, scale: torch.Tensor, mode: ScaleMode) -> torch.Tensor:
    """float32 W from its fp8 values and scales of ``mode``: FP8_GROUP x FP8_GROUP blocks or channels."""
    check_scale_mode(mode)
    if mode == "block":
        return dequantize_fp8_block(w_fp8, scale, (FP8_GROUP, FP8_GROUP))
    return dequantize_fp8_per_channel(w_fp8, scale)


def quantize_fp8_per_token_group(x: torch.Tensor, group: int = FP8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, scales)`` for activations x (M, K): one float32 scale per token and
    ``group`` columns, scales (M, cdiv(K, group)). The dynamic quantization the FP8 GEMM
    fuses into its K loop (block mode), written as torch for its reference; undone by
    ``dequantize_fp8_block(x_fp8, scales, (1, group))``.

    Raises:
        TypeError, ValueError: as :func:`quantize_fp8_block`.
    """
    return quantize_fp8_block(x, (1, group))


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, scales)`` with one float32 scale per token over its whole row, (M, 1): the
    activations of the per-channel GEMM."""
    _check_matrix("x", x)
    return quantize_fp8_per_token_group(x, max(x.shape[1], 1))


def check_scale_mode(mode: object) -> None:
    """Raise ValueError unless ``mode`` is one of ``SCALE_MODES``."""
    if mode not in SCALE_MODES:
        raise ValueError(f"mode must be one of {SCALE_MODES}, got {mode!r}")


def quantize_with_scale(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 of ``v`` over its (broadcast) float32 ``scale`` (module doc)."""
    return (v.float() * (1.0 / scale)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def _expand(scale: torch.Tensor, rows: int, cols: int, n: int, k: int) -> torch.Tensor:
    """A per-tile ``scale`` spread to the (n, k) elements of its tiles."""
    return scale.repeat_interleave(rows, dim=0)[:n].repeat_interleave(cols, dim=1)[:, :k]


def _check_matrix(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in _FLOAT_DTYPES:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name} must be a float32/bfloat16/float16 tensor, got {got}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


def _check_fp8(name: str, t: torch.Tensor) -> tuple[int, int]:
    if not isinstance(t, torch.Tensor) or t.dtype != FP8_DTYPE:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name} must be a float8_e4m3fn tensor, got {got}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    return t.shape[0], t.shape[1]


def _check_scale(name: str, scale: torch.Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(scale, torch.Tensor) or scale.dtype not in _FLOAT_DTYPES:
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"{name} must be a float32/bfloat16/float16 tensor, got {got}")
    if tuple(scale.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(scale.shape)}")


def _check_block(block: object) -> tuple[int, int]:
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block)):
        raise ValueError(f"block must be two ints >= 1 (rows, columns), got {block!r}")
    return block[0], block[1]


# ---- in the kernels ------------------------------------------------------------------

def exact_cast(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device round to e4m3 in fp32 before the cast
    (``to_e4m3``): off CUDA, that is under Triton's CPU interpreter."""
    return t.device.type != "cuda"


# The quantization constants as kernel constants.
_FP8_MAX: tl.constexpr = tl.constexpr(FP8_E4M3_MAX)
_AMAX_FLOOR: tl.constexpr = tl.constexpr(AMAX_FLOOR)


@triton.jit
def e4m3_scales(amax):
    """``(scale, 1 / scale)`` of rows whose largest magnitudes are ``amax`` (a vector), each
    correctly rounded: the scale as :func:`fp8_scale` divides."""
    scale = tl.math.div_rn(tl.maximum(amax, _AMAX_FLOOR), _FP8_MAX)
    return scale, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def quantize_e4m3(v, inv_scale, EXACT_CAST: tl.constexpr):
    """e4m3 of ``v * inv_scale`` (fp32; ``inv_scale`` = 1 / scale, broadcast), clamped to
    +-448: the module doc's rule."""
    return to_e4m3(tl.clamp(v.to(tl.float32) * inv_scale, -448.0, 448.0), EXACT_CAST)


@triton.jit
def to_e4m3(y, EXACT_CAST: tl.constexpr):
    """fp32 ``y`` (|y| <= 448) cast to e4m3, to nearest, ties to even. The GPU's conversion
    rounds so itself; Triton's CPU interpreter does not (seen on triton 3.9: it rounds ties
    away from zero and a value rounded up across a power of two loses its carry, 1.97
    becoming 1.0), so there (``EXACT_CAST``, :func:`exact_cast`) the value is first rounded
    in fp32 (:func:`round_to_e4m3`), after which the cast is exact."""
    if EXACT_CAST:
        y = round_to_e4m3(y)
    return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def round_to_e4m3(y):
    """fp32 ``y`` (|y| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32.

    With e = max(exponent of |y|, -6) (e4m3's subnormals share exponent -6), the e4m3
    values near y are the multiples of 2^(e - 3): |y| / 2^(e - 3) is exact, and adding and
    subtracting 2^23 rounds it to an integer, ties to even, as IEEE fp32 addition rounds."""
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)           # 2^(e - 3), exact
    inv_step = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)
    r = (tl.abs(y) * inv_step + 8388608.0) - 8388608.0
    magnitude = (r * step).to(tl.int32, bitcast=True)
    return (magnitude | (bits & -2147483648)).to(tl.float32, bitcast=True)  # y's sign bit


# ---- the FP8 KV cache --------------------------------------------------------------------
# An FP8 cache holds e4m3 values of K (V) by the module doc's rule, with one per-tensor
# scale per layer and cache (1.0 unless the checkpoint gives self_attn.k_scale / v_scale).
# An e4m3 value converts to bf16, fp16 and fp32 exactly, so the attention kernels turn the
# stored values into the model's dtype before their dots and fold the scales outside them:
# the K scale into the softmax scale, the V scale into the normalised output. The scales are
# (1,) float32 tensors on the device: kernels load them, so nothing is read on the host and a
# CUDA graph keeps reading the current value.

@triton.jit
def store_kv(ptr, x, mask, scale_ptr, KV_FP8: tl.constexpr, EXACT_CAST: tl.constexpr):
    """A 2-D tile ``x`` of K or V (model dtype) into the cache at ``ptr``: cast to the cache's
    dtype, or (KV_FP8) quantized by the layer's (1,) scale at ``scale_ptr``, times 1 / scale
    correctly rounded, as the reference (``quantize_kv_reference``) takes it."""
    if KV_FP8:
        scale = tl.load(scale_ptr + tl.arange(0, 1))                        # (1,)
        inv = tl.math.div_rn(tl.full((1,), 1.0, tl.float32), scale)[None, :]
        tl.store(ptr, quantize_e4m3(x, inv, EXACT_CAST), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


def is_fp8_cache(cache: torch.Tensor) -> bool:
    """Whether ``cache`` holds FP8 values."""
    return cache.dtype == FP8_DTYPE


def check_fp16_dots(fp16_dots: bool, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """An attention config's ``fp16_dots`` widens an FP8 cache's tiles for 16-bit q only.

    Raises:
        ValueError: ``fp16_dots`` with a cache in q's dtype, or with float32 q.
    """
    if fp16_dots and not (is_fp8_cache(k_cache) and q.dtype != torch.float32):
        raise ValueError(f"fp16_dots widens an FP8 cache for 16-bit q; got a {k_cache.dtype} cache and {q.dtype} q")


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


def check_rope_store_args(eps: float, positions: torch.Tensor, slot_mapping: torch.Tensor,
                          cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          **rows: torch.Tensor) -> tuple[int, int]:
    """The checks every fused norm + RoPE + K/V-store launcher shares: eps a number; positions
    and slots integer; a float32 table; caches of a float dtype or e4m3, (N, block_size, Hkv, D)
    with equal shapes and strides, D a power of two >= 2; every tensor (and ``rows``: the
    launcher's own inputs, already dtype-checked) with a contiguous last dim, on one device.
    Returns (Hkv, D).

    Raises:
        TypeError, ValueError: naming the argument.
    """
    check_dtype("cos_sin_cache", cos_sin_cache, (torch.float32,))
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(name, t, (torch.bfloat16, torch.float16, torch.float32, FP8_DTYPE))
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        check_dtype(name, t, (torch.int64, torch.int32))
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a number, got {type(eps).__name__}")
    tensors = {**rows, "positions": positions, "cos_sin_cache": cos_sin_cache, "k_cache": k_cache,
               "v_cache": v_cache, "slot_mapping": slot_mapping}
    for name, t in tensors.items():
        check_last_dim_contiguous(name, t)
    check_same_device(**tensors)
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must be (N, block_size, Hkv, D) with equal shapes and strides, got "
                         f"{tuple(k_cache.shape)}/{k_cache.stride()} and {tuple(v_cache.shape)}/{v_cache.stride()}")
    num_kv_heads, head_dim = k_cache.shape[2:]
    check_power_of_two("head_dim", head_dim, minimum=2)
    return num_kv_heads, head_dim

