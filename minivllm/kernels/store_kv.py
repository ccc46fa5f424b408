"""Write the new tokens' keys and values into the paged KV cache.

One program per token: it reads the token's slot, and copies its (Hkv, D) key and
value rows to ``cache[slot // block_size, slot % block_size]``. A slot of -1 marks
a padding row (e.g. a CUDA-graph batch padded to a captured size): every load and
store of that program is masked off, so nothing is written.

Torch reference: :func:`minivllm.kernels.reference.store_kv_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, check_last_dim_contiguous, check_same_device, next_pow2

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr,                   # (T, Hkv, D)
    k_cache_ptr, v_cache_ptr,             # (N, bs, Hkv, D), same strides
    slot_ptr,                             # (T,) int32/int64, -1 = skip
    stride_kt, stride_kh,                 # key strides (last dim contiguous)
    stride_vt, stride_vh,                 # value strides
    stride_cn, stride_cb, stride_ch,      # cache strides: block, offset in block, head
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,             # tokens per KV block
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,  # powers of two >= Hkv, D
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # A padding row (slot -1) has no valid heads. (Not `(slot >= 0) & ...`: the
    # interpreter rejects a scalar bool in a mask expression.)
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_DIM)  # (BLOCK_H, BLOCK_D)

    # The cache may hold far more than 2**31 elements: the block offset is int64.
    block = slot // BLOCK_SIZE
    cache_off = block * stride_cn + (slot % BLOCK_SIZE) * stride_cb \
        + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,           # (T, Hkv, D)
    value: torch.Tensor,         # (T, Hkv, D)
    k_cache: torch.Tensor,       # (N, bs, Hkv, D)
    v_cache: torch.Tensor,       # (N, bs, Hkv, D)
    slot_mapping: torch.Tensor,  # (T,) int64 (int32 accepted), -1 = padding row
) -> None:
    """Write each token's key/value at its cache slot, in place; slot -1 is skipped.

    ``key``/``value`` may be strided views (e.g. slices of a packed QKV output) as
    long as their last dimension is contiguous. Values are cast to the cache dtype.
    Slots are not bounds-checked against the pool (that would need a device->host
    sync); the caller's slot mapping is trusted.

    Raises:
        TypeError: a dtype is not a supported float type / slot_mapping is not an integer tensor.
        ValueError: shapes disagree, a last dimension is strided, caches differ in
            shape or strides, or tensors live on different devices.
    """
    _check_store_kv_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


def _check_store_kv_args(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Validate the arguments of :func:`store_kv` (raises TypeError / ValueError)."""
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(name, t, _FLOAT_DTYPES)
        check_last_dim_contiguous(name, t)
    check_dtype("slot_mapping", slot_mapping, (torch.int64, torch.int32))
    check_last_dim_contiguous("slot_mapping", slot_mapping)
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key and value must both be (T, Hkv, D), got {tuple(key.shape)} and {tuple(value.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must be (N, block_size, Hkv, D) with equal shapes and strides, got "
                         f"{tuple(k_cache.shape)}/{k_cache.stride()} and {tuple(v_cache.shape)}/{v_cache.stride()}")
    if k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache heads/head_dim {tuple(k_cache.shape[2:])} != key's {tuple(key.shape[1:])}")
    if slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"slot_mapping must be ({key.shape[0]},), got {tuple(slot_mapping.shape)}")
