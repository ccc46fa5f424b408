"""Helpers shared by the kernel launchers: argument checks (each raises TypeError or
ValueError naming the offending argument, never an ``assert``) and the interpreter's
bf16 workaround."""

from __future__ import annotations

import torch


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    """Raise TypeError unless ``t`` is a tensor of one of the ``allowed`` dtypes."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).removeprefix('torch.')}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Raise ValueError unless the last dimension has stride 1 (kernels vectorise along it)."""
    if t.dim() == 0 or (t.shape[-1] > 1 and t.stride(-1) != 1):
        raise ValueError(f"{name} must have a contiguous last dimension, got shape "
                         f"{tuple(t.shape)} strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor lives on the same device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def check_power_of_two(name: str, value: int, minimum: int = 1) -> None:
    """Raise ValueError unless ``value`` is a power of two >= ``minimum``."""
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")


def upcast_dot(q: torch.Tensor) -> bool:
    """Whether a kernel must feed ``tl.dot`` fp32 operands instead of q's dtype.

    Only for bf16 on the CPU interpreter (TRITON_INTERPRET=1): numpy has no bf16,
    the interpreter keeps bf16 as raw uint16 and its ``tl.dot`` multiplies those
    bits (seen on triton 3.9). Upcasting the bf16 values is exact, so the
    interpreter still checks the GPU path's arithmetic. Never true on CUDA.
    """
    return q.device.type != "cuda" and q.dtype == torch.bfloat16
