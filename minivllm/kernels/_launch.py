"""Helpers shared by the kernel launchers: argument checks (each raises TypeError or
ValueError naming the offending argument, never an ``assert``), the one checker of
the paged-attention arguments, whether a launch takes part in programmatic dependent
launch, and the interpreter's bf16 workaround."""

from __future__ import annotations

import functools
import math
import numbers

import torch

try:   # host-side TMA descriptors: triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: pointer loads only
    TensorDescriptor = None


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can take part in programmatic dependent launch (PDL): a
    Hopper or later GPU and a triton whose ``CUDAOptions`` has ``launch_pdl``. A hardware fact,
    decided once per device. Triton's CPU interpreter runs no PDL launch on any device: the
    caller that turns PDL on for an engine (``Ops.build``) leaves it off there.

    Under PDL a kernel that only feeds others calls ``griddepcontrol.launch_dependents`` (a
    GEMV: after its K loop), and a kernel launched with ``launch_pdl`` may start before its
    predecessor ends: it reads only what no kernel writes (weights) before its
    ``griddepcontrol.wait``, which waits for the predecessor's completion and memory. The
    contract: weights are never written by the kernel just before such a launch, and a kernel
    whose correctness rests on stream order (the fused all-reduce) is never launched this way.
    Whether a launch takes part is its caller's choice (each launcher's ``pdl`` argument)."""
    if device.type != "cuda":
        return False
    return _pdl_supported_on(device.index if device.index is not None else torch.cuda.current_device())


def takes_pdl(pdl: bool, t: torch.Tensor) -> bool:
    """Whether a launch whose caller asked for ``pdl`` on tensors like ``t`` uses PDL: asked
    for, and possible on t's device (so ``pdl=True`` is harmless on the CPU)."""
    return pdl and t.is_cuda and pdl_supported(t.device)


@functools.lru_cache(maxsize=None)
def _pdl_supported_on(device_index: int) -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - a triton without the CUDA backend
        return False
    return ("launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
            and torch.cuda.get_device_capability(device_index)[0] >= 9)


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


def check_state_step_args(cu_seqlens: torch.Tensor, slots: torch.Tensor, has_initial_state: torch.Tensor) -> None:
    """A state kernel's per-sequence arguments, passed to it as they are (no cast launched):
    ``cu_seqlens`` int32 or int64 (B + 1,), ``slots`` int64 (B,), ``has_initial_state`` bool (B,).

    Raises:
        ValueError: the shapes disagree.
        TypeError: another dtype.
    """
    nseq = slots.shape[0]
    if slots.dim() != 1 or cu_seqlens.shape != (nseq + 1,) or has_initial_state.shape != (nseq,):
        raise ValueError(f"cu_seqlens must be ({nseq + 1},) and has_initial_state ({nseq},), got "
                         f"{tuple(cu_seqlens.shape)}, {tuple(has_initial_state.shape)}")
    check_dtype("cu_seqlens", cu_seqlens, (torch.int32, torch.int64))
    check_dtype("slots", slots, (torch.int64,))
    check_dtype("has_initial_state", has_initial_state, (torch.bool,))


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1): ``triton.next_power_of_2`` without
    its host cost, which matters as the launchers call it on every launch."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def check_power_of_two(name: str, value: int, minimum: int = 1) -> None:
    """Raise ValueError unless ``value`` is a power of two >= ``minimum``."""
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")


def check_tile_config(config: object, tiles: tuple[str, ...], flags: tuple[str, ...] = ()) -> None:
    """The rules every kernel config shares (ValueError naming the field): each of ``tiles``
    a power of two >= 16 (``tl.dot``'s minimum), ``num_warps`` a power of two,
    ``num_stages`` >= 1, each of ``flags`` a bool."""
    for name in tiles:
        check_power_of_two(name, getattr(config, name), minimum=16)
    check_power_of_two("num_warps", getattr(config, "num_warps"))
    if getattr(config, "num_stages") < 1:
        raise ValueError(f"num_stages must be >= 1, got {getattr(config, 'num_stages')}")
    for name in flags:
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(config, name)!r}")


def upcast_dot(q: torch.Tensor) -> bool:
    """Whether a kernel must feed ``tl.dot`` fp32 operands instead of q's dtype.

    Only for bf16 on the CPU interpreter (TRITON_INTERPRET=1): numpy has no bf16,
    the interpreter keeps bf16 as raw uint16 and its ``tl.dot`` multiplies those
    bits (seen on triton 3.9). Upcasting the bf16 values is exact, so the
    interpreter still checks the GPU path's arithmetic. Never true on CUDA.
    """
    return q.device.type != "cuda" and q.dtype == torch.bfloat16


# Dtypes of q and the K/V caches that the attention kernels accept.
ATTENTION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Scores are kept in base 2 (exp2 is one instruction): softmax scale * log2(e).
LOG2E = 1.4426950408889634


def check_host_int(name: str, value: object, minimum: int) -> None:
    """Raise ValueError unless ``value`` is a host (Python/numpy) int >= ``minimum``.

    Grid sizes and split counts must be host ints: reading them from a device
    tensor would sync the host and break CUDA-graph capture.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be a host int >= {minimum}, got {value!r}")


def check_attention_args(
    q: torch.Tensor,             # decode (B, H, D); prefill (T, H, D)
    k_cache: torch.Tensor,       # (N, bs, Hkv, D)
    v_cache: torch.Tensor,       # (N, bs, Hkv, D), k_cache's shape and strides
    kv_lens: torch.Tensor,       # (B,) int32
    block_tables: torch.Tensor,  # (B, W) int32
    scale: float,
    cu_seqlens_q: torch.Tensor | None = None,  # prefill only: (B+1,) int32
) -> None:
    """Validate the arguments shared by the paged-attention launchers.

    ``cu_seqlens_q`` None means decode (one query row per sequence, so q's first
    dimension is B); otherwise q holds the concatenated new tokens of B sequences.

    The caches hold q's dtype, or both FP8 (e4m3, ``kernels/fp8.py``; their scales are
    checked by ``fp8.check_kv_scales``).

    Raises:
        TypeError: q not one of bf16/fp16/fp32, caches neither q's dtype nor both e4m3,
            or an index tensor is not int32.
        ValueError: mismatched shapes, strided last dimensions, H not a multiple of
            Hkv, head_dim or block_size not a power of two, tensors on different
            devices, or a scale that is not a finite positive number.
    """
    check_dtype("q", q, ATTENTION_DTYPES)
    check_dtype("k_cache", k_cache, (q.dtype, torch.float8_e4m3fn))
    check_dtype("v_cache", v_cache, (k_cache.dtype,))
    index = {"kv_lens": kv_lens, "block_tables": block_tables}
    if cu_seqlens_q is not None:
        index = {"cu_seqlens_q": cu_seqlens_q, **index}
    for name, t in index.items():
        check_dtype(name, t, (torch.int32,))
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, **index}
    for name, t in tensors.items():
        check_last_dim_contiguous(name, t)
    check_same_device(**tensors)
    _check_head_shapes(q, k_cache, v_cache)
    _check_batch_shapes(q, kv_lens, block_tables, cu_seqlens_q)
    if (isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale)
            or scale <= 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")


def _check_head_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """q (., H, D) against caches (N, bs, Hkv, D): equal D, H % Hkv == 0, powers of two."""
    if q.dim() != 3:
        raise ValueError(f"q must be (tokens, H, D), got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must be (N, block_size, Hkv, D) with equal shapes and strides")
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"q (H={num_heads}, D={head_dim}) does not fit the cache "
                         f"(Hkv={num_kv_heads}, D={cache_dim}): need equal D and H % Hkv == 0")
    check_power_of_two("head_dim", head_dim, minimum=16)
    check_power_of_two("block_size", block_size)


def _check_batch_shapes(q: torch.Tensor, kv_lens: torch.Tensor, block_tables: torch.Tensor,
                        cu_seqlens_q: torch.Tensor | None) -> None:
    """kv_lens (B,), block_tables (B, W), and q (B, H, D) for decode or cu_seqlens_q (B+1,) for prefill."""
    batch = kv_lens.shape[0] if kv_lens.dim() == 1 else -1
    ok = batch >= 0 and block_tables.dim() == 2 and block_tables.shape[0] == batch
    if cu_seqlens_q is None:
        ok = ok and q.shape[0] == batch
        rows = f"q {tuple(q.shape)}"
    else:
        ok = ok and cu_seqlens_q.shape == (batch + 1,)
        rows = f"cu_seqlens_q {tuple(cu_seqlens_q.shape)}"
    if not ok:
        want = "q (B, H, D)" if cu_seqlens_q is None else "cu_seqlens_q (B+1,)"
        raise ValueError(f"need kv_lens (B,), block_tables (B, W) and {want}; got kv_lens "
                         f"{tuple(kv_lens.shape)}, block_tables {tuple(block_tables.shape)}, {rows}")


def tma_rows_allowed(t: torch.Tensor, row_bytes: int) -> bool:
    """Whether tiles of ``t``, seen as a 2-D array of rows of ``row_bytes``, can come by
    tensor-memory copy (TMA): host descriptors exist in this triton, the base and the rows
    are 16-byte aligned, and the device is a Hopper or later GPU, or the CPU interpreter
    (which emulates descriptors, so CI runs the TMA paths too)."""
    if TensorDescriptor is None or t.data_ptr() % 16 or row_bytes % 16:
        return False
    if t.device.type == "cuda":
        return torch.cuda.get_device_capability(t.device)[0] >= 9
    return True


def tma_allowed(k_cache: torch.Tensor, block_n: int) -> bool:
    """Whether an attention kernel's whole K/V tiles can come by tensor-memory copy (TMA):
    the cache's blocks hold whole tiles (block_size % block_n == 0), and each layer's cache
    is one contiguous (N, bs, Hkv, D) tensor, so a 2-D (N*bs, Hkv*D) array of rows that
    ``tma_rows_allowed`` accepts."""
    if k_cache.shape[1] % block_n or not k_cache.is_contiguous():
        return False
    return tma_rows_allowed(k_cache, k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size())


def cache_descriptor(cache: torch.Tensor, block_n: int) -> object:
    """A (block_n, D) box descriptor over ``cache`` seen as (N*bs, Hkv*D) rows (a few us
    of host time per launch; a captured CUDA graph keeps the encoded copy)."""
    rows = cache.view(cache.shape[0] * cache.shape[1], cache.shape[2] * cache.shape[3])
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [block_n, cache.shape[3]])


def kv_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int, tma: bool) -> tuple[bool, object, object]:
    """(by boxes, K descriptor, V descriptor) of an attention launch: whole tiles come by
    tensor-memory copy where ``tma`` is asked and :func:`tma_allowed`; else the caches
    themselves stand in for the descriptors (the kernel does not read them)."""
    if not (tma and tma_allowed(k_cache, block_n)):
        return False, k_cache, v_cache
    return True, cache_descriptor(k_cache, block_n), cache_descriptor(v_cache, block_n)
