"""FP8 (e4m3) quantization in torch: the one definition of the scales that every 8-bit
kernel follows, the quantize/dequantize halves of their torch references, and the
checkpoint's quantization config (:class:`Fp8Config`).

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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
# Smallest amax a scale is taken from (see the module doc); the kernels use the same value.
AMAX_FLOOR = 1e-10
# The weight block of Qwen3-FP8 checkpoints, and the activation group that goes with it.
FP8_BLOCK = (128, 128)
FP8_GROUP = 128
# Dtypes quantize_fp8_block stores a weight scale in: float32, or bfloat16 as some published
# Qwen3 FP8 checkpoints store weight_scale_inv (others use float16; its exponent range cannot
# hold every floored scale). The kernels take float32: a loader upcasts, which is exact.
SCALE_DTYPES = (torch.float32, torch.bfloat16)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

ScaleMode = Literal["block", "channel"]
SCALE_MODES: tuple[str, ...] = ("block", "channel")


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The float32 scale of groups whose largest magnitude is ``amax`` (module doc)."""
    return amax.float().clamp(min=AMAX_FLOOR) / FP8_E4M3_MAX


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
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
    return _quantize(w, _expand(scale.float(), rows, cols, n, k)), scale


def dequantize_fp8_block(w_fp8: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
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
    """float32 W from its fp8 values and scales of ``mode``: 128x128 blocks or channels."""
    check_scale_mode(mode)
    if mode == "block":
        return dequantize_fp8_block(w_fp8, scale)
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


def _quantize(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
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


@dataclass(frozen=True)
class Fp8Config:
    """The FP8 checkpoint format the engine serves: e4m3 weights with 128x128 block scales
    (``weight_block_size`` (128, 128): Qwen3-FP8 checkpoints, ``weight_scale_inv``) or
    per-output-channel scales (None: on-the-fly quantization, ``quantize_fp8_per_channel``),
    activations quantized dynamically per token (and 128-column group with block scales).

    Attributes:
        weight_block_size: (128, 128) or None (see above).
        modules_to_not_convert: modules kept in the checkpoint's dtype (the LM head, MoE
            routers, norms); a name matches an entry equal to it or a dotted prefix of it.
    """

    weight_block_size: tuple[int, int] | None = FP8_BLOCK
    modules_to_not_convert: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.weight_block_size not in (None, FP8_BLOCK):
            raise ValueError(f"weight_block_size must be {list(FP8_BLOCK)} (the block the FP8 kernels "
                             f"serve) or None (per-channel), got {self.weight_block_size!r}")
        if (not isinstance(self.modules_to_not_convert, tuple)
                or not all(isinstance(m, str) and m for m in self.modules_to_not_convert)):
            raise ValueError(f"modules_to_not_convert must be a tuple of module names, "
                             f"got {self.modules_to_not_convert!r}")

    @property
    def scale_mode(self) -> ScaleMode:
        """How the weights are scaled: "block" (128x128) or "channel"."""
        return "channel" if self.weight_block_size is None else "block"

    def converts(self, module: str) -> bool:
        """Whether the linear layer ``module`` (e.g. "model.layers.0.mlp.gate") is in fp8."""
        return not any(module == m or module.startswith(m + ".") for m in self.modules_to_not_convert)

    @classmethod
    def from_hf(cls, quantization_config: Mapping[str, object]) -> Fp8Config:
        """Read a ``config.json``'s ``quantization_config``, as Qwen3-FP8 checkpoints give it::

            {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", ...]}

        ``fmt`` and ``activation_scheme`` may be left out (their only served values are the
        defaults); ``weight_block_size`` may not (readers disagree on what its absence means).

        Raises:
            ValueError: naming the field: an unknown key, another quant_method, a format other
                than e4m3, static activation scales, a block other than [128, 128] or null, or
                modules_to_not_convert not a list of names.
        """
        if not isinstance(quantization_config, Mapping):
            raise ValueError(f"quantization_config must be a mapping, got {type(quantization_config).__name__}")
        known = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert"}
        unknown = sorted(set(quantization_config) - known)
        if unknown:
            raise ValueError(f"quantization_config has unknown key(s) {unknown}; known: {sorted(known)}")
        served = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        for key, want in served.items():
            got = quantization_config.get(key, None if key == "quant_method" else want)
            if got != want:
                raise ValueError(f"quantization_config.{key} must be {want!r}, got {got!r}")
        if "weight_block_size" not in quantization_config:
            raise ValueError("quantization_config.weight_block_size is missing: give [128, 128] or null")
        block = quantization_config["weight_block_size"]
        if block is not None and (not isinstance(block, (list, tuple)) or list(block) != list(FP8_BLOCK)):
            raise ValueError(f"quantization_config.weight_block_size must be {list(FP8_BLOCK)} or null, got {block!r}")
        skip = quantization_config.get("modules_to_not_convert") or []
        if not isinstance(skip, (list, tuple)):
            raise ValueError(f"quantization_config.modules_to_not_convert must be a list, got {skip!r}")
        return cls(weight_block_size=None if block is None else FP8_BLOCK, modules_to_not_convert=tuple(skip))
